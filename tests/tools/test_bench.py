"""Tests of the benchmark CLI (python -m pyddp.bench): arithmetic, references, outputs, launch.

The pure parts (busbw factors, sizes, argument checks, the reports) run in
this process. The collectives' local references are checked against a
collective simulated on every rank's actual buffers. A few real runs (spawned
ranks, mpirun when it is installed, torchrun) check that every op comes out
with no wrong element for every peer that can run here, that the others
are listed as skipped with their reason, and that the JSON, CSV and plot files
are written. Speed is never asserted.
"""

import csv
import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import types

import pytest
import torch

import pyddp
import pyddp.bench.cli as cli
from paths import REPO
from pyddp import _launch
from pyddp.bench import peers
from pyddp.bench.across_hosts import (flat_ring_inter_host_bytes, hierarchical_inter_host_bytes,
                                      placement, ring_sends)
from pyddp.bench.peers import MESSAGE_OPS, PEERS, mpi_launchable
from pyddp.bench.metrics import Result, Skipped, busbw_factor
from pyddp.bench.ops import OPS, REDOPS, REDUCING_OPS, SENTINEL
from pyddp.bench.report import render, summary
from pyddp.bench.sizes import format_size, parse_size, size_sweep
from pyddp.bench.worker import Launch, launched_rank

DATA_OPS = ("all_reduce", "all_gather", "broadcast", "reduce_scatter", "all_to_all", "sendrecv")
ALL_OPS = (*DATA_OPS, "barrier")  # a barrier has no buffer: one point per run, size 0
DEEPSPEED_SEGMENT = "deepspeed_allreduce_buffer"
RUN_TIMEOUT = 240


# --- arithmetic -------------------------------------------------------------------------------

@pytest.mark.parametrize("world_size, expected", [
    (1, {"all_reduce": 0.0, "all_gather": 0.0, "reduce_scatter": 0.0, "broadcast": 1.0,
         "all_to_all": 0.0, "sendrecv": 1.0}),
    (2, {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5, "broadcast": 1.0,
         "all_to_all": 0.5, "sendrecv": 1.0}),
    (4, {"all_reduce": 1.5, "all_gather": 0.75, "reduce_scatter": 0.75, "broadcast": 1.0,
         "all_to_all": 0.75, "sendrecv": 1.0}),
    (8, {"all_reduce": 1.75, "all_gather": 0.875, "reduce_scatter": 0.875, "broadcast": 1.0,
         "all_to_all": 0.875, "sendrecv": 1.0}),
])
def test_busbw_factors_match_nccl_tests(world_size, expected):
    assert {op: busbw_factor(op, world_size) for op in expected} == expected


def test_busbw_factor_rejects_unknown_op_and_world():
    with pytest.raises(ValueError, match="gather"):
        busbw_factor("gather", 2)
    with pytest.raises(ValueError, match="positive"):
        busbw_factor("all_reduce", 0)


def test_result_bandwidths_from_timing():
    # 1 MiB all-reduced 10 times in 10 ms on 4 ranks: 1 ms a call,
    # algbw = 1048576 B / 1 ms = 1.048576 GB/s, busbw = algbw * 2 * 3 / 4.
    r = Result.from_timing("all_reduce", "x", "x lib", "cpu", 4, 1 << 20, 1 << 18, "float32",
                           "sum", -1, 10, 0.010, 0)
    assert r.time_us == pytest.approx(1000.0)
    assert r.algbw_gbps == pytest.approx(1.048576)
    assert r.busbw_gbps == pytest.approx(1.048576 * 1.5)
    g = Result.from_timing("all_gather", "x", "x lib", "cpu", 2, 4000, 1000, "float32", "none",
                           -1, 4, 0.002, None)
    assert g.algbw_gbps == pytest.approx(4000 / 0.0005 / 1e9)
    assert g.busbw_gbps == pytest.approx(g.algbw_gbps / 2)


def test_sizes():
    assert [parse_size(t) for t in ("4096", "4K", "64m", "1G")] == [4096, 4096, 64 << 20, 1 << 30]
    assert [format_size(n) for n in (4096, 64 << 20, 1 << 30, 100)] == ["4K", "64M", "1G", "100"]
    assert size_sweep(4 << 10, 64 << 20, 16) == [4 << 10, 64 << 10, 1 << 20, 16 << 20]
    with pytest.raises(ValueError):
        parse_size("4KB")
    with pytest.raises(ValueError):
        size_sweep(8, 4, 2)


# --- the collectives' references against a simulated collective -----------------------------

class _Recorder:
    """A peer whose bound calls do nothing: the test performs the collective itself."""

    def all_reduce(self, *buffers_and_arguments):
        return lambda: None

    all_gather = broadcast = reduce_scatter = all_to_all = sendrecv = all_reduce


def _reduce(stacked: torch.Tensor, redop: str) -> torch.Tensor:
    if redop == "sum":
        return stacked.sum(0)
    if redop == "prod":
        return stacked.prod(0)
    if redop == "min":
        return stacked.min(0).values
    if redop == "max":
        return stacked.max(0).values
    return stacked.sum(0) / stacked.shape[0]


def _simulate(op: str, cases: list, redop: str, root: int) -> None:
    """Does ``op`` across the ranks' actual buffers, as the library under test should."""
    if op == "all_reduce":
        result = _reduce(torch.stack([c.tensor.double() for c in cases]), redop)
        for c in cases:
            c.tensor.copy_(result)
    elif op == "broadcast":
        for c in cases:
            c.tensor.copy_(cases[root].tensor)
    elif op == "all_gather":
        gathered = torch.cat([c.input for c in cases])
        for c in cases:
            c.output.copy_(gathered)
    elif op == "all_to_all":
        n = len(cases)
        for source, c in enumerate(cases):
            for dest, block in enumerate(c.input.chunk(n)):
                cases[dest].output.chunk(n)[source].copy_(block)
    elif op == "sendrecv":
        for rank, c in enumerate(cases):
            cases[(rank + 1) % len(cases)].output.copy_(c.input)
    else:
        result = _reduce(torch.stack([c.input.double() for c in cases]), redop)
        for rank, c in enumerate(cases):
            block = c.output.numel()
            c.output.copy_(result[rank * block:(rank + 1) * block])


def _output(op: str, case) -> torch.Tensor:
    return case.tensor if op in ("all_reduce", "broadcast") else case.output


@pytest.mark.parametrize("op", DATA_OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8,
                                   torch.uint8, torch.int64])
def test_reference_matches_simulated_collective(op, dtype):
    world_size, root, nbytes = 3, 2, 3 * 1000 * dtype.itemsize
    redops = REDOPS if op in REDUCING_OPS else ("sum",)
    for redop in redops:
        if redop == "avg" and not dtype.is_floating_point:
            continue
        cases = [OPS[op](nbytes, dtype, torch.device("cpu"), r, world_size, redop, root)
                 for r in range(world_size)]
        for c in cases:
            c.bind(_Recorder())()
        # Before the collective, ranks other than broadcast's root hold wrong outputs.
        before = [c.count_wrong() for c in cases]
        assert all(w > 0 for r, w in enumerate(before) if not (op == "broadcast" and r == root))
        _simulate(op, cases, redop, root)
        assert [c.count_wrong() for c in cases] == [0, 0, 0], (op, dtype, redop)
        out = _output(op, cases[1])
        out[7] = SENTINEL
        assert cases[1].count_wrong() == 1
        for c in cases:
            c.reset()
        _simulate(op, cases, redop, root)
        assert [c.count_wrong() for c in cases] == [0, 0, 0]


def test_case_sizes_follow_nccl_tests():
    cpu = torch.device("cpu")
    ar = OPS["all_reduce"](4096, torch.float32, cpu, 0, 4, "sum", 0)
    assert (ar.count, ar.nbytes) == (1024, 4096)
    ag = OPS["all_gather"](4096, torch.float32, cpu, 1, 4, "sum", 0)
    assert (ag.count, ag.nbytes, ag.input.numel()) == (1024, 4096, 256)
    rs = OPS["reduce_scatter"](4000, torch.float32, cpu, 1, 3, "sum", 0)
    assert (rs.count, rs.nbytes, rs.output.numel()) == (999, 3996, 333)
    # all_to_all counts each rank's whole send buffer, n blocks (nccl-tests' alltoall).
    a2a = OPS["all_to_all"](4000, torch.float32, cpu, 1, 3, "sum", 0)
    assert (a2a.count, a2a.nbytes, a2a.input.numel(), a2a.output.numel()) == (999, 3996, 999, 999)
    sr = OPS["sendrecv"](4096, torch.float32, cpu, 1, 3, "sum", 0)
    assert (sr.count, sr.nbytes, sr.input.numel(), sr.output.numel()) == (1024, 4096, 1024, 1024)


def test_sendrecv_is_a_ring_and_all_to_all_routes_blocks():
    """The references, by hand: rank 1 of 3 receives rank 0's buffer, and block 1 of every
    rank's all_to_all input, in rank order."""
    cpu = torch.device("cpu")
    sr = [OPS["sendrecv"](32, torch.float32, cpu, r, 3, "sum", 0) for r in range(3)]
    sr[1].output.copy_(sr[0].input)
    assert sr[1].count_wrong() == 0
    sr[1].output.copy_(sr[2].input)
    assert sr[1].count_wrong() == 8
    a2a = [OPS["all_to_all"](48, torch.float32, cpu, r, 3, "sum", 0) for r in range(3)]
    a2a[1].output.copy_(torch.cat([a2a[r].input[4:8] for r in range(3)]))
    assert a2a[1].count_wrong() == 0
    a2a[1].output.copy_(torch.cat([a2a[r].input[0:4] for r in range(3)]))
    assert a2a[1].count_wrong() == 12


# --- bytes between simulated hosts ------------------------------------------------------------

def test_placement_splits_ranks_host_by_host():
    assert placement(4, 2) == ["host0", "host0", "host1", "host1"]
    assert placement(3, 3) == ["host0", "host1", "host2"]
    assert placement(5, 1) == ["host0"] * 5
    with pytest.raises(ValueError, match="do not split evenly"):
        placement(3, 2)


def test_ring_sends_twice_n_minus_one_blocks():
    assert [ring_sends(1200, m) for m in (1, 2, 3, 4)] == [0, 1200, 1600, 1800]


def test_flat_ring_counts_the_links_that_cross_hosts():
    # 4 ranks: each sends 2 * 3/4 * 1000 = 1500 to the next; 1->2 and 3->0 cross.
    assert flat_ring_inter_host_bytes(1000, ["a", "a", "b", "b"]) == [0, 1500, 0, 1500]
    # Interleaved, every link crosses.
    assert flat_ring_inter_host_bytes(1000, ["a", "b", "a", "b"]) == [1500] * 4
    # 2 hosts x 4 ranks: 2 * 7/8 * 800 = 1400 from ranks 3 and 7.
    assert flat_ring_inter_host_bytes(800, ["a"] * 4 + ["b"] * 4) == [0, 0, 0, 1400] * 2
    # 3 hosts x 2 ranks: 2 * 5/6 * 1200 = 2000 from ranks 1, 3 and 5.
    assert flat_ring_inter_host_bytes(1200, list("aabbcc")) == [0, 2000] * 3
    assert flat_ring_inter_host_bytes(1000, ["a"] * 3) == [0, 0, 0]


def test_hierarchical_all_reduces_one_shard_per_rank_across_hosts():
    # 2 hosts x 2 ranks: shards of 500 over rings of 2 hosts: 2 * 1/2 * 500 each, 2000 in all
    # against the flat ring's 3000.
    assert hierarchical_inter_host_bytes(1000, ["a", "a", "b", "b"]) == [500] * 4
    # 2 hosts x 4 ranks: shards of 200, 200 each, 1600 in all against 2800.
    assert hierarchical_inter_host_bytes(800, ["a"] * 4 + ["b"] * 4) == [200] * 8
    # 3 hosts x 2 ranks: shards of 600 over rings of 3: 2 * 2/3 * 600 = 800 each.
    assert hierarchical_inter_host_bytes(1200, list("aabbcc")) == [800] * 6
    # One rank per host: gloo alone, the flat ring.
    assert hierarchical_inter_host_bytes(900, ["a", "b", "c"]) == [1200] * 3 == \
        flat_ring_inter_host_bytes(900, ["a", "b", "c"])
    with pytest.raises(ValueError, match="different numbers of ranks"):
        hierarchical_inter_host_bytes(1000, ["a", "a", "b"])


# --- command line -----------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["-b", "64M", "-e", "4K"], "-b/-e/-f"),
    (["-f", "1"], "at least 2"),
    (["-b", "2"], "less than one float32"),
    (["--ops", "all_reduce,gather"], "choose 'all' or a comma list"),
    (["--ops", "sendrecv", "--world-size", "1"], "sendrecv needs at least 2 ranks"),
    (["--hosts", "3", "--world-size", "4"], "--hosts 3: 4 ranks do not split evenly"),
    (["--hosts", "0"], "at least 1"),
    (["--hosts", "2", "--world-size", "4", "--peers", "pyddp,gloo,mpi,limit"],
     "only pyddp and gloo run across simulated hosts, not mpi, limit"),
    (["--backends", "pyddp,horovod"], "choose 'all' or a comma list"),
    (["-d", "int8", "--world-size", "30"], "does not hold exactly"),
    (["-o", "avg", "-d", "int32"], "avg needs a floating-point"),
    (["--ops", "broadcast", "--root", "2"], "--root 2 is not a rank"),
    (["--iters", "0"], "at least 1"),
    (["--timeout", "-1"], "must be positive"),
    (["--dtype", "complex64"], "invalid choice"),
])
def test_bad_arguments_fail_clearly(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_options(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_world_size_must_match_torchrun(capsys):
    with pytest.raises(SystemExit):
        cli.parse_options(["--world-size", "3"], Launch(0, 2, 0, 2, False))
    assert "differs from torchrun's WORLD_SIZE 2" in capsys.readouterr().err
    assert cli.parse_options([], Launch(1, 4, 1, 4, False)).plan.world_size == 4


def test_all_expands_and_defaults():
    options = cli.parse_options(["--ops", "all", "--backends", "all"])
    assert options.plan.ops == list(OPS)
    assert options.plan.peers == list(PEERS)
    assert cli.parse_options(["--baseline", "mpi"]).baselines == {"cpu": "mpi", "cuda": "mpi"}
    plan = cli.parse_options([]).plan
    assert (plan.world_size, plan.ops, plan.sizes[0], plan.sizes[-1]) == (
        2, ["all_reduce"], 4096, 64 << 20)


def test_new_ops_are_accepted():
    plan = cli.parse_options(["--ops", "all_reduce,all_to_all,sendrecv"]).plan
    assert plan.ops == ["all_reduce", "all_to_all", "sendrecv"]


def test_hosts_default_to_pyddp_and_gloo(capsys):
    plan = cli.parse_options(["--hosts", "2", "--world-size", "4"]).plan
    assert (plan.hosts, plan.world_size, plan.peers) == (2, 4, ["pyddp", "gloo"])
    assert cli.parse_options(["--hosts", "2", "--peers", "gloo"]).plan.peers == ["gloo"]
    assert cli.parse_options([]).plan.hosts == 1
    with pytest.raises(SystemExit):
        cli.parse_options(["--hosts", "2"], Launch(0, 2, 0, 2, False))
    assert "under torchrun it starts none" in capsys.readouterr().err


def test_peers_is_another_name_for_backends():
    assert cli.parse_options(["--peers", "pyddp,gloo"]) == cli.parse_options(
        ["--backends", "pyddp,gloo"])
    assert cli.parse_options(["--peers", "gloo"]).plan.peers == ["gloo"]


def test_launched_rank_reads_torchrun_and_mpirun():
    assert launched_rank({}) is None
    assert launched_rank({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                          "LOCAL_WORLD_SIZE": "2"}) == Launch(1, 4, 1, 2, False)
    assert launched_rank({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "3",
                          "OMPI_COMM_WORLD_LOCAL_RANK": "2",
                          "OMPI_COMM_WORLD_LOCAL_SIZE": "3"}) == Launch(2, 3, 2, 3, True)


def test_under_mpirun_the_tool_refuses(monkeypatch, capsys):
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    assert cli.main([]) == 2
    assert "starts mpirun itself" in capsys.readouterr().err


def test_ddp_subcommand_without_its_module(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, cli.SUBCOMMANDS["ddp"][0], None)
    assert cli.main(["ddp", "--steps", "3"]) == 2
    assert "pyddp.bench.ddp" in capsys.readouterr().err


def test_ddp_subcommand_hands_over_its_arguments(monkeypatch):
    module = types.ModuleType(cli.SUBCOMMANDS["ddp"][0], "A fake DDP benchmark.")
    module.add_arguments = lambda parser: parser.add_argument("--steps", type=int, required=True)
    module.main = lambda args: args.steps + 1
    monkeypatch.setitem(sys.modules, cli.SUBCOMMANDS["ddp"][0], module)
    assert cli.main(["ddp", "--steps", "6"]) == 7
    with pytest.raises(SystemExit):
        cli.main(["ddp"])


# --- reports ----------------------------------------------------------------------------------

def _result(peer: str, size: int, time_us: float, device: str = "cpu",
            wrong=0) -> Result:
    return Result.from_timing("all_reduce", peer, peer, device, 2, size, size // 4,
                              "float32", "sum", -1, 1, time_us / 1e6, wrong)


def test_summary_is_baseline_time_over_backend_time():
    results = [_result("gloo", 4096, 100.0), _result("pyddp", 4096, 25.0),
               _result("gloo", 65536, 300.0), _result("pyddp", 65536, 400.0),
               _result("mpi", 4096, 50.0)]
    text = summary(results, ["pyddp", "gloo", "mpi"], "gloo")
    rows = {line.split()[0]: line.split()[1:] for line in text.splitlines()
            if not line.startswith("#")}
    assert rows["4096"] == ["100.0", "4.00x", "2.00x"]
    assert rows["65536"] == ["300.0", "0.75x", "-"]
    assert summary(results, ["pyddp", "mpi"], "nccl") is None


def test_render_compares_every_peer_with_mpi_when_it_ran():
    results = [_result("gloo", 4096, 100.0), _result("pyddp", 4096, 20.0),
               _result("mpi", 4096, 30.0), _result("limit", 4096, 10.0)]
    text = render(results, [], ["all_reduce"], ["pyddp", "gloo", "mpi", "limit"],
                  {"cpu": "gloo"}, checked=True)
    block = text.split("# summary: all_reduce on cpu, speed-up over mpi")[1].split("\n\n")[0]
    rows = {line.split()[0]: line.split()[1:] for line in block.splitlines()[2:]}
    # MPI time / pyddp time, then over gloo and the limit row
    assert rows["4096"] == ["30.0", "1.50x", "0.30x", "3.00x"], block
    without = render([r for r in results if r.peer != "mpi"], [], ["all_reduce"],
                     ["pyddp", "gloo", "limit"], {"cpu": "gloo"}, checked=True)
    assert "speed-up over mpi" not in without


def test_render_lists_skips_and_unchecked_runs():
    skipped = [Skipped("nccl", None, "no CUDA device"),
               Skipped("deepspeed", "all_gather", "all_reduce only")]
    text = render([_result("gloo", 64, 10.0, wrong=None)], skipped, ["all_reduce"],
                  ["gloo", "nccl"], {"cpu": "gloo", "cuda": "nccl"}, checked=False)
    assert "# skipped: nccl: no CUDA device" in text
    assert "# skipped: deepspeed all_gather: all_reduce only" in text
    assert "N/A" in text and "not checked" in text
    failed = render([_result("gloo", 64, 10.0, wrong=3)], [], ["all_reduce"], ["gloo"],
                    {"cpu": "gloo"}, checked=True)
    assert failed.endswith("# wrong elements: 3 FAILED")


class _FakeBar:
    """Stands in for tqdm.tqdm: records what the progress bar is told."""

    def __init__(self, total, **kwargs):
        self.total, self.n, self.closed, self.kwargs = total, 0, False, kwargs

    def refresh(self):
        pass

    def set_postfix_str(self, text, refresh=True):
        self.postfix = text

    def update(self):
        self.n += 1

    def close(self):
        self.closed = True


def test_progress_total_shrinks_with_skips(monkeypatch):
    fake = types.ModuleType("tqdm")
    fake.__spec__ = importlib.machinery.ModuleSpec("tqdm", None)
    fake.tqdm = _FakeBar
    monkeypatch.setitem(sys.modules, "tqdm", fake)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    plan = cli.parse_options(["-b", "4K", "-e", "64K", "-f", "4", "--ops", "all_reduce,broadcast",
                              "--backends", "pyddp,gloo,deepspeed"]).plan
    progress = cli._Progress(plan, quiet=False)
    bar = progress._bar
    assert bar.total == 3 * 2 * 3 and bar.kwargs["file"] is sys.stderr
    progress(Skipped("deepspeed", "broadcast", "all_reduce only"))
    progress(Skipped("gloo", None, "gone"))
    progress(_result("pyddp", 4096, 1.0))
    assert (bar.total, bar.n, bar.postfix) == (18 - 3 - 6, 1, "all_reduce pyddp 4K")
    progress.close()
    assert bar.closed
    assert cli._Progress(plan, quiet=True)._bar is None
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert cli._Progress(plan, quiet=False)._bar is None


# --- real runs --------------------------------------------------------------------------------

def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _deepspeed_segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(DEEPSPEED_SEGMENT)}


def _by_peer(results: list[dict]) -> dict[str, set[tuple[str, int]]]:
    found: dict[str, set[tuple[str, int]]] = {}
    for r in results:
        found.setdefault(r["peer"], set()).add((r["op"], r["size"]))
    return found


def _skips(document: dict) -> dict[tuple[str, str], str]:
    return {(s["peer"], s["op"] or "*"): s["reason"] for s in document["skipped"]}


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """One spawned run of every op on 2 ranks, every peer, with every output file."""
    out = tmp_path_factory.mktemp("bench")
    paths = {kind: str(out / f"run.{kind}") for kind in ("json", "csv", "png")}
    before = _deepspeed_segments()
    argv = ["--world-size", "2", "-b", "64", "-e", "4K", "-f", "64", "--ops", "all",
            "--backends", "all", "--iters", "3", "--warmup", "1", "--trials", "2", "--quiet",
            "--json", paths["json"], "--csv", paths["csv"]]
    if _installed("matplotlib"):
        argv += ["--plot", paths["png"]]
    process = subprocess.run([sys.executable, "-m", "pyddp.bench", *argv], cwd=REPO,
                             env=dict(os.environ, PYTHONPATH=REPO), capture_output=True,
                             text=True, timeout=RUN_TIMEOUT)
    with open(paths["json"], encoding="utf-8") as f:
        document = json.load(f)
    return process, document, paths, before


@pytest.mark.multiprocess
def test_every_op_is_right_for_every_backend_that_runs(cpu_run):
    process, document, _, _ = cpu_run
    assert process.returncode == 0, process.stderr
    assert "# wrong elements: 0 OK" in process.stdout
    # The limit peer moves bytes without computing the collective, and a barrier has
    # no output: never checked.
    assert all((r["wrong"] is None) == (r["peer"] == "limit" or r["op"] == "barrier")
               for r in document["results"])
    assert all(r["wrong"] in (0, None) for r in document["results"])
    data = {(op, size) for op in DATA_OPS for size in (64, 4096)}
    points = data | {("barrier", 0)}  # timed once, at the first size
    found, skips = _by_peer(document["results"]), _skips(document)
    assert found["pyddp"] == points and found["gloo"] == points and found["limit"] == data
    assert found["pyddp_registered"] == points
    assert "moves no bytes" in skips[("limit", "barrier")]
    mpi_reason = mpi_launchable()
    if mpi_reason is None:
        assert found["mpi"] == points
    else:
        assert skips[("mpi", "*")] == mpi_reason
    if _installed("deepspeed"):
        assert found["deepspeed"] == {("all_reduce", 64), ("all_reduce", 4096)}
        for op in ALL_OPS[1:]:
            assert "all_reduce only" in skips[("deepspeed", op)]
    else:
        assert skips[("deepspeed", "*")] == "deepspeed is not installed"
    # Ranks share GPUs round-robin: with a GPU every GPU peer runs, except
    # NCCL ones when two ranks share a GPU and NCCL is older than 2.30.
    nccl_ok = torch.cuda.is_available() and (
        torch.cuda.device_count() >= 2
        or tuple(torch.cuda.nccl.version()[:2]) >= peers.NCCL_MULTI_RANK_GPU_VERSION)
    # pyddp's cuda_ipc and NCCL ring transports have no messages between pairs of ranks.
    messageless = ("pyddp_ipc", "pyddp_ipc_one_shot", "pyddp_ipc_two_shot",
                   "pyddp_ipc_registered", "pyddp_nccl_ring")
    for gpu in ("nccl", "pyddp_ipc", "pyddp_ipc_one_shot", "pyddp_ipc_two_shot",
                "pyddp_ipc_registered", "pyddp_nccl", "pyddp_nccl_ring"):
        nccl = gpu in ("nccl", "pyddp_nccl", "pyddp_nccl_ring")
        if not torch.cuda.is_available():
            assert skips[(gpu, "*")] == "no CUDA device"
            assert f"# skipped: {gpu}: " in process.stdout
        elif gpu.startswith("pyddp") and not pyddp._C.has_cuda:
            assert "this pyddp build has no" in skips[(gpu, "*")]
        elif nccl and not nccl_ok:
            assert "need NCCL >= 2.30" in skips[(gpu, "*")]
        elif gpu in messageless:
            assert found[gpu] == {(op, size) for op, size in points if op not in MESSAGE_OPS}
            for op in MESSAGE_OPS:
                assert "no messages between pairs of ranks" in skips[(gpu, op)], gpu
        else:
            assert found[gpu] == points, gpu


@pytest.mark.multiprocess
def test_outputs_are_written(cpu_run):
    process, document, paths, before = cpu_run
    assert document["plan"]["world_size"] == 2 and document["plan"]["ops"] == list(ALL_OPS)
    with open(paths["csv"], encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(document["results"]) > 0
    assert [(r["peer"], r["op"], int(r["size"]), None if r["wrong"] == "" else int(r["wrong"]))
            for r in rows] == [
        (r["peer"], r["op"], r["size"], r["wrong"]) for r in document["results"]]
    if _installed("matplotlib"):
        with open(paths["png"], "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        assert os.path.getsize(paths["png"]) > 10_000
    assert _deepspeed_segments() <= before, "DeepSpeed's shared memory was left in /dev/shm"
    assert "# all_reduce  peer: pyddp" in process.stdout
    assert "# summary: all_reduce on cpu, speed-up over gloo" in process.stdout
    assert "# summary: all_reduce on cpu, speed-up over limit" in process.stdout


def _run_cli(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pyddp.bench", *argv], cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=REPO, **env), capture_output=True,
                          text=True, timeout=RUN_TIMEOUT)


@pytest.mark.multiprocess
def test_three_ranks_other_dtype_and_reduction(tmp_path):
    path = str(tmp_path / "run.json")
    process = _run_cli(["--world-size", "3", "-d", "bfloat16", "-o", "max", "--root", "1",
                        "-b", "6", "-e", "6K", "-f", "1024", "--ops", "all",
                        "--backends", "pyddp,gloo", "--iters", "2", "--warmup", "0",
                        "--trials", "1", "--json", path], {})
    assert process.returncode == 0, process.stderr
    with open(path, encoding="utf-8") as f:
        results = json.load(f)["results"]
    assert len(results) == 2 * (len(DATA_OPS) * 2 + 1)  # 2 peers, 2 sizes, 1 barrier
    assert all(r["wrong"] == (None if r["op"] == "barrier" else 0) for r in results)
    assert all(r["dtype"] == "bfloat16" for r in results)
    assert {r["redop"] for r in results if r["op"] in REDUCING_OPS} == {"max"}
    assert {r["root"] for r in results if r["op"] == "broadcast"} == {1}


@pytest.mark.multiprocess
def test_a_failing_rank_is_named():
    process = _run_cli(["-b", "4K", "-e", "4K", "--backends", "pyddp,gloo", "--iters", "1"],
                       {"PYDDP_SLOT_BYTES": "3"})
    assert process.returncode == 1
    assert "failed" in process.stderr and "rank " in process.stderr
    assert "PYDDP_SLOT_BYTES" in process.stderr


@pytest.mark.multiprocess
def test_under_torchrun_the_tool_is_the_ranks(tmp_path):
    path = str(tmp_path / "run.json")
    process = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "pyddp.bench", "-b", "1K", "-e", "1K", "--ops", "all_reduce,reduce_scatter",
         "--backends", "pyddp,gloo,mpi", "--iters", "2", "--trials", "1", "--json", path],
        cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True,
        timeout=RUN_TIMEOUT)
    assert process.returncode == 0, process.stderr
    assert process.stdout.count("# wrong elements: 0 OK") == 1
    with open(path, encoding="utf-8") as f:
        document = json.load(f)
    assert _by_peer(document["results"]) == {
        name: {("all_reduce", 1024), ("reduce_scatter", 1024)} for name in ("pyddp", "gloo")}
    assert all(r["wrong"] == 0 for r in document["results"])
    assert (mpi_launchable() or "not started by mpirun") in _skips(document)[("mpi", "*")]


def test_simulated_hosts_are_refused_with_the_reason(monkeypatch, capsys):
    monkeypatch.setattr(_launch, "simulated_hosts_unavailable", lambda: "no namespaces here")
    assert cli.main(["--hosts", "2", "--world-size", "4", "-q"]) == 1
    assert "--hosts 2: cannot simulate hosts here: no namespaces here" in capsys.readouterr().err


@pytest.mark.multiprocess
def test_two_simulated_hosts_run_pyddp_auto_beside_gloo(tmp_path):
    reason = _launch.simulated_hosts_unavailable()
    if reason is not None:
        pytest.skip(f"simulated hosts: {reason}")
    before = {n for n in os.listdir("/dev/shm") if n.startswith("pyddp")}
    path = str(tmp_path / "run.json")
    process = _run_cli(["--hosts", "2", "--world-size", "4", "-b", "64K", "-e", "64K",
                        "--iters", "2", "--warmup", "1", "--trials", "1", "--json", path], {})
    assert process.returncode == 0, process.stderr
    with open(path, encoding="utf-8") as f:
        document = json.load(f)
    assert document["plan"]["hosts"] == 2
    assert _by_peer(document["results"]) == {"pyddp": {("all_reduce", 65536)},
                                             "gloo": {("all_reduce", 65536)}}
    assert all(r["wrong"] == 0 for r in document["results"])
    detail = next(r["detail"] for r in document["results"] if r["peer"] == "pyddp")
    assert detail.startswith("pyddp auto") and "hierarchical (shm inside each host" in detail
    assert "ranks 0,1 on host0" in detail and "ranks 2,3 on host1" in detail
    out = process.stdout
    assert "# summary: all_reduce on cpu, speed-up over gloo" in out
    assert "loopback is not a network" in out and "only the ratio" in out
    # 64 KiB on 2 hosts x 2 ranks: the flat ring's 2 crossing links carry 2 * 3/4 * 65536
    # each; pyddp's 4 ranks each all-reduce a 32 KiB shard across 2 hosts: 2 * 1/2 * 32768.
    assert ["65536", "196608", "131072", "0.667", "98304", "32768"] in [
        line.split() for line in out.splitlines()]
    assert {n for n in os.listdir("/dev/shm") if n.startswith("pyddp")} <= before
