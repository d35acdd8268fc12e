"""The GPU peers of ``python -m pyddp.bench`` as far as a machine without a GPU can take them.

gloo_cuda (torch's gloo on CUDA tensors), limit_cuda (every rank's
device-to-device copy), symm_mem_one_shot and symm_mem_two_shot (torch's
symmetric-memory all-reduce kernels): they parse, say why they cannot run
here, refuse what they cannot do, turn a failed join into a skip rather than a
failed sweep, take their buffers from the allocator they name, and the report
compares every CUDA peer with limit_cuda and gloo_cuda, per op and size, from
rows of one run. Their timings need a GPU: tests/gpu/check.sh runs them there.
"""

import datetime
import importlib.util
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import pyddp
from pyddp.bench import cli, ops, peers, worker
from pyddp.bench.metrics import Result, Skipped
from pyddp.bench.peers import (BASELINES, GlooCudaPeer, LimitCudaPeer, RankContext,
                               SymmMemOneShotPeer, SymmMemTwoShotPeer, Unavailable)
from pyddp.bench.report import render, summary
from paths import REPO

GPU_PEERS = ("gloo_cuda", "limit_cuda", "symm_mem_one_shot", "symm_mem_two_shot")
SYMM_MEM = (SymmMemOneShotPeer, SymmMemTwoShotPeer)
RUN_TIMEOUT = 240


def _ctx(world_size: int = 2, local_world_size: int = 2, hosts: int = 1) -> RankContext:
    return RankContext(0, world_size, 0, local_world_size, dist.HashStore(),
                       datetime.timedelta(seconds=30), False, hosts)


# --- names and options -------------------------------------------------------------------------

def test_gpu_peers_are_listed_and_parse():
    assert set(GPU_PEERS) <= set(peers.PEERS)
    options = cli.parse_options(["--peers", ",".join(GPU_PEERS)])
    assert options.plan.peers == list(GPU_PEERS)
    assert set(GPU_PEERS) <= set(cli.parse_options(["--peers", "all"]).plan.peers)
    assert set(GPU_PEERS) <= set(cli.parse_options([]).plan.peers)
    help_text = cli.build_parser().format_help()
    assert all(name in help_text for name in GPU_PEERS)
    # Every rank compares CUDA peers with the copy limit and with gloo, as the CPU ones.
    assert peers.CEILINGS["cuda"] == "limit_cuda" and peers.FLOORS["cuda"] == "gloo_cuda"


# --- why they do not run here ------------------------------------------------------------------

def test_each_gpu_peer_says_why_it_cannot_run_here():
    for name in GPU_PEERS:
        reason = peers.PEERS[name].probe(_ctx())
        if not torch.cuda.is_available():
            # This torch is a CPU build, or a CUDA build that sees no GPU.
            assert reason == "no CUDA device", name
        elif name in ("gloo_cuda", "limit_cuda"):
            assert reason is None, name


def test_symm_mem_probes_name_what_is_missing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for cls in SYMM_MEM:
        operator = f"symm_mem::{cls._op}"
        reason = cls.probe(_ctx())
        if torch.version.cuda is None:
            assert reason == (f"torch {torch.__version__} has no CUDA kernel for "
                              f"{operator}"), reason
        else:
            assert reason is None
        assert "every rank on one host" in cls.probe(_ctx(world_size=4, local_world_size=2))
        assert "every rank on one host" in cls.probe(_ctx(hosts=2))

    def no_operator(name, key):
        raise RuntimeError(f"operator {name} does not exist")

    monkeypatch.setattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", no_operator)
    assert SymmMemTwoShotPeer.probe(_ctx()) == (
        f"torch {torch.__version__} has no operator symm_mem::two_shot_all_reduce_")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None if
                        name == "torch.distributed._symmetric_memory" else
                        real_find_spec(name, *args))
    assert SymmMemOneShotPeer.probe(_ctx()) == (
        f"torch {torch.__version__} has no torch.distributed._symmetric_memory")


def test_gpu_peers_refuse_what_they_cannot_do():
    cpu = torch.device("cpu")
    gloo = GlooCudaPeer(cpu)
    assert all(gloo.unsupported(op, "sum", torch.float32) is None
               for op in ("all_reduce", "all_gather", "broadcast", "reduce_scatter",
                          "all_to_all"))
    assert "stage no CUDA tensor" in gloo.unsupported("sendrecv", "sum", torch.float32)
    assert "the gloo row times it" in gloo.unsupported("barrier", "sum", torch.float32)
    limit = LimitCudaPeer(cpu)
    assert limit.unsupported("all_gather", "sum", torch.float32) is None
    assert "moves no bytes" in limit.unsupported("barrier", "sum", torch.float32)
    assert not limit.checked and gloo.checked
    for cls in SYMM_MEM:
        peer = cls.__new__(cls)
        assert peer.checked and peer.memory == "symmetric"
        assert peer.unsupported("all_reduce", "sum", torch.float32) is None
        assert peer.unsupported("all_reduce", "sum", torch.bfloat16) is None
        assert "is an all_reduce" in peer.unsupported("all_gather", "sum", torch.float32)
        assert "sums only" in peer.unsupported("all_reduce", "max", torch.float32)
        assert "float32 and bfloat16" in peer.unsupported("all_reduce", "sum", torch.float16)


# --- joining -----------------------------------------------------------------------------------

@pytest.fixture
def one_rank_world(tmp_path):
    """This process as the one rank of a gloo world, as a bench rank has it."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield RankContext(0, 1, 0, 1, store, datetime.timedelta(seconds=30), False, 1)
    dist.destroy_process_group()


def test_a_symm_mem_peer_that_cannot_join_is_unavailable_and_leaves_no_group(
        one_rank_world, monkeypatch):
    # On this machine the peer gets as far as torch's allocator, which has no symmetric
    # memory for the device it is given: the peer must say so and release its group.
    monkeypatch.setattr(peers.devices, "use_gpu", lambda rank, world: torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    groups = len(dist.distributed_c10d._world.pg_map)
    with pytest.raises(Unavailable, match="torch symm_mem one_shot_all_reduce failed here: "
                                          ".*does not support device type cpu"):
        SymmMemOneShotPeer.open(one_rank_world)
    assert len(dist.distributed_c10d._world.pg_map) == groups


class _UnavailablePeer(GlooCudaPeer):
    """A peer whose join always shows that it cannot run."""

    name = "unavailable"

    @classmethod
    def probe(cls, ctx: RankContext):
        return None

    @classmethod
    def open(cls, ctx: RankContext):
        raise Unavailable("joining showed it cannot run here")


def test_the_sweep_skips_a_peer_that_turns_out_unavailable(tmp_path, monkeypatch):
    monkeypatch.setitem(worker.PEERS, _UnavailablePeer.name, _UnavailablePeer)
    plan = worker.Plan(world_size=1, sizes=[64], ops=["all_reduce"],
                       peers=[_UnavailablePeer.name, "gloo"], dtype="float32", redop="sum",
                       root=0, iters=2, warmup=0, target_seconds=0.01, timeout_seconds=30,
                       check=True, threads=1, trials=1, hosts=1)
    launch = worker.Launch(0, 1, 0, 1, False)
    events = list(worker.sweep(plan, launch, dist.FileStore(str(tmp_path / "store"), 1)))
    assert events[0] == Skipped(_UnavailablePeer.name, None, "joining showed it cannot run here")
    assert [(e.peer, e.size, e.wrong) for e in events[1:]] == [("gloo", 64, 0)]
    assert not dist.is_initialized()


# --- buffers -----------------------------------------------------------------------------------

def test_cases_take_their_buffers_from_the_memory_a_peer_names():
    cpu = torch.device("cpu")
    plain = ops.OPS["all_reduce"](4096, torch.float32, cpu, 0, 2, "sum", 0)
    assert not pyddp.is_registered(plain.tensor)
    registered = ops.OPS["all_gather"](4096, torch.float32, cpu, 0, 2, "sum", 0,
                                       memory="registered")
    assert pyddp.is_registered(registered.input) and pyddp.is_registered(registered.output)
    # torch's symmetric memory lives on GPUs only: the case asks torch for it all the same.
    with pytest.raises(RuntimeError, match="SymmetricMemory does not support device type cpu"):
        ops.OPS["all_reduce"](4096, torch.float32, cpu, 0, 2, "sum", 0, memory="symmetric")
    with pytest.raises(ValueError, match="unknown memory 'pinned'"):
        ops.OPS["all_reduce"](4096, torch.float32, cpu, 0, 2, "sum", 0, memory="pinned")
    assert {cls.memory for cls in peers.PEERS.values()} == set(ops.MEMORIES)


# --- the report --------------------------------------------------------------------------------

def _result(peer: str, size: int, time_us: float, device: str = "cuda",
            op: str = "all_reduce") -> Result:
    return Result.from_timing(op, peer, peer, device, 2, size, size // 4, "float32", "sum", -1,
                              1, time_us / 1e6, None if peer.startswith("limit") else 0)


def _rows(text: str, title: str) -> dict[str, list[str]]:
    """The rows of the summary block whose first line starts with ``title``, by size."""
    block = next(b for b in text.split("\n\n") if b.startswith(title))
    return {line.split()[0]: line.split()[1:] for line in block.splitlines()[2:]}


def test_every_cuda_peer_is_compared_with_limit_cuda_and_gloo_cuda():
    names = ["gloo", "gloo_cuda", "pyddp_ipc_two_shot", "symm_mem_two_shot", "limit_cuda"]
    results = [
        _result("gloo", 4096, 700.0, device="cpu"),
        _result("gloo_cuda", 4096, 500.0), _result("pyddp_ipc_two_shot", 4096, 40.0),
        _result("symm_mem_two_shot", 4096, 20.0), _result("limit_cuda", 4096, 10.0),
        _result("gloo_cuda", 1 << 26, 5000.0), _result("pyddp_ipc_two_shot", 1 << 26, 200.0),
        _result("limit_cuda", 1 << 26, 50.0),
    ]
    skipped = [Skipped("nccl", None, "2 ranks on 1 GPU(s) need NCCL >= 2.30, torch has 2.28")]
    text = render(results, skipped, ["all_reduce"], ["nccl", *names], dict(BASELINES), True)
    # gloo_cuda time / peer time, and limit_cuda time / peer time, size by size; "-" where a
    # peer has no point at that size.
    assert _rows(text, "# summary: all_reduce on cuda, speed-up over gloo_cuda") == {
        "4096": ["500.0", "12.50x", "25.00x", "50.00x"],
        "67108864": ["5000.0", "25.00x", "-", "100.00x"],
    }
    assert _rows(text, "# summary: all_reduce on cuda, speed-up over limit_cuda") == {
        "4096": ["10.0", "0.02x", "0.25x", "0.50x"],
        "67108864": ["50.0", "0.01x", "0.25x", "-"],
    }
    # NCCL did not run here, and CPU peers are compared among themselves only.
    assert "speed-up over nccl" not in text
    assert "summary: all_reduce on cpu" not in text  # gloo alone on the CPU: nothing to compare
    assert "# skipped: nccl: 2 ranks on 1 GPU(s)" in text
    # A reference named twice (--baseline gloo_cuda) gets one block.
    twice = render(results, [], ["all_reduce"], names, {"cpu": "gloo_cuda", "cuda": "gloo_cuda"},
                   True)
    assert twice.count("speed-up over gloo_cuda") == 1


def test_summary_with_limit_cuda_as_reference_is_its_time_over_each_peer():
    results = [_result("limit_cuda", 1024, 4.0, op="broadcast"),
               _result("pyddp_ipc_one_shot", 1024, 16.0, op="broadcast"),
               _result("gloo_cuda", 1024, 400.0, op="broadcast")]
    text = summary(results, ["pyddp_ipc_one_shot", "gloo_cuda", "limit_cuda"], "limit_cuda")
    assert text.splitlines()[0] == (
        "# summary: broadcast on cuda, speed-up over limit_cuda (limit_cuda time / peer time "
        "= busbw ratio; above 1 is faster)")
    assert _rows(text, "# summary") == {"1024": ["4.0", "0.25x", "0.01x"]}


# --- a real run --------------------------------------------------------------------------------

@pytest.mark.multiprocess
def test_a_run_lists_every_gpu_peer_it_could_not_run_with_why():
    process = subprocess.run(
        [sys.executable, "-m", "pyddp.bench", "--peers", "gloo," + ",".join(GPU_PEERS),
         "-b", "1K", "-e", "1K", "--iters", "2", "--trials", "1", "-w", "0", "--quiet"],
        cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True,
        timeout=RUN_TIMEOUT)
    assert process.returncode == 0, process.stderr
    assert "# wrong elements: 0 OK" in process.stdout
    for name in GPU_PEERS:
        if torch.cuda.is_available():
            assert f"peer: {name} " in process.stdout or f"# skipped: {name}: " in process.stdout
        else:
            assert f"# skipped: {name}: no CUDA device" in process.stdout
