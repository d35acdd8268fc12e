"""The --device option of examples/train.py and ``python -m pyddp.bench ddp`` (pyddp.devices).

On a machine without a GPU: the parsing of both command lines, what ``auto``
resolves to, the refusal of ``cuda`` before any rank starts, the placement of
ranks on GPUs (a pure function, for 1, 2 and 4 GPUs), the choice of torch
DDP's backend from NCCL's version, the benchmark's report on CUDA from a given
result, and a real 2-rank run of train.py with ``--device auto`` against the
one-process reference. The CUDA runs themselves are for a machine with a GPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import signal
import subprocess
import sys
from collections import Counter

import pytest
import torch

from paths import REPO
from pyddp import _launch, devices
from pyddp.bench import ddp as bench_ddp

TRAIN = os.path.join(REPO, "examples", "train.py")
REFUSAL_SECONDS = 120
"""Bound on a refused run: the interpreter imports torch and pyddp (seconds, more on a
loaded 2-core machine), then stops before any rank."""
RUN_SECONDS = 300
"""Bound on a 2-epoch training run (about 7 s on an idle 2-core machine)."""
EPOCHS = "2"
"""Enough to see training: the test accuracy goes from chance to about 95%."""


def _train_module():
    """examples/train.py, imported as a module (examples/ is not a package)."""
    spec = importlib.util.spec_from_file_location("pyddp_example_train", TRAIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bench_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pyddp.bench ddp")
    bench_ddp.add_arguments(parser)
    return parser


def _env(**extra: str) -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (REPO, os.environ.get("PYTHONPATH")) if p), **extra)


def _run(argv: list, timeout: float, **env: str) -> subprocess.CompletedProcess:
    """Runs ``argv`` in a session of its own; on timeout kills that session and fails."""
    process = subprocess.Popen(argv, cwd=REPO, env=_env(**env), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate(timeout=10)
        pytest.fail(f"{argv} still running after {timeout} s:\n{out[-2000:]}\n{err[-2000:]}")
    return subprocess.CompletedProcess(argv, process.returncode, out, err)


@pytest.fixture
def no_gpu(monkeypatch):
    """torch sees no GPU, whatever the machine."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def gpus(monkeypatch):
    """A machine with GPUs and a pyddp that carries CUDA tensors, as far as resolve asks."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(devices, "HAS_CUDA", True)


# --- parsing ----------------------------------------------------------------------


def test_train_parses_device_with_cpu_by_default():
    parser = _train_module()._parser()
    assert parser.parse_args([]).device == "cpu"
    for choice in ("cpu", "cuda", "auto"):
        assert parser.parse_args(["--device", choice]).device == choice


def test_train_rejects_an_unknown_device(capsys):
    with pytest.raises(SystemExit) as exit_:
        _train_module()._parser().parse_args(["--device", "gpu"])
    assert exit_.value.code == 2
    assert "invalid choice: 'gpu'" in capsys.readouterr().err


def test_bench_ddp_parses_cpu_and_cuda_with_cpu_by_default(capsys):
    parser = _bench_parser()
    assert parser.parse_args([]).device == "cpu"
    assert parser.parse_args(["--device", "cuda"]).device == "cuda"
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["--device", "auto"])
    assert exit_.value.code == 2
    assert "invalid choice: 'auto'" in capsys.readouterr().err


# --- resolving the choice ---------------------------------------------------------------


def test_auto_resolves_to_cpu_without_a_gpu(no_gpu):
    assert devices.resolve("auto", pyddp_groups=True) == "cpu"
    assert devices.resolve("auto", pyddp_groups=False) == "cpu"
    assert devices.resolve("cpu", pyddp_groups=True) == "cpu"


def test_auto_resolves_to_what_this_machine_has():
    import pyddp

    cuda = torch.cuda.is_available() and pyddp.has_cuda()
    assert devices.resolve("auto", pyddp_groups=True) == ("cuda" if cuda else "cpu")


def test_auto_resolves_to_cuda_with_gpus(gpus):
    assert devices.resolve("auto", pyddp_groups=True) == "cuda"
    assert devices.resolve("cuda", pyddp_groups=True) == "cuda"


def test_cuda_without_a_gpu_is_refused_saying_what_to_do(no_gpu):
    with pytest.raises(devices.DeviceUnavailable) as error:
        devices.resolve("cuda", pyddp_groups=True)
    assert "--device cuda:" in str(error.value)
    assert "--device cpu" in str(error.value)


def test_ranks_on_cuda_need_a_pyddp_built_with_cuda(gpus, monkeypatch):
    monkeypatch.setattr(devices, "HAS_CUDA", False)
    with pytest.raises(devices.DeviceUnavailable, match="PYDDP_BUILD_CUDA=1"):
        devices.resolve("cuda", pyddp_groups=True)
    # One process moves no tensor between ranks; auto falls back rather than fail.
    assert devices.resolve("cuda", pyddp_groups=False) == "cuda"
    assert devices.resolve("auto", pyddp_groups=True) == "cpu"


def test_the_refusal_tells_a_cpu_build_of_torch_from_a_hidden_gpu():
    cpu_build = devices.cuda_refusal(False, True, True, None)
    assert "is a CPU build" in cpu_build and "CUDA build of torch" in cpu_build
    hidden = devices.cuda_refusal(False, True, True, "13.0")
    assert "sees no GPU" in hidden and "CUDA_VISIBLE_DEVICES" in hidden
    assert devices.cuda_refusal(True, True, True, "13.0") is None


def test_resolve_rejects_an_unknown_choice():
    with pytest.raises(ValueError, match="--device must be one of"):
        devices.resolve("tpu", pyddp_groups=False)


# --- placing ranks on GPUs -----------------------------------------------------------


@pytest.mark.parametrize("count, expected", [
    (1, [0, 0, 0, 0, 0, 0, 0, 0]),
    (2, [0, 1, 0, 1, 0, 1, 0, 1]),
    (4, [0, 1, 2, 3, 0, 1, 2, 3]),
])
def test_local_ranks_take_gpus_round_robin(count, expected):
    placed = [devices.gpu_index(local_rank, count) for local_rank in range(8)]
    assert placed == expected
    # Every GPU gets its share of the 8 ranks.
    assert Counter(placed) == {gpu: 8 // count for gpu in range(count)}


def test_placement_needs_a_gpu_and_a_local_rank():
    with pytest.raises(ValueError, match="no GPU"):
        devices.gpu_index(0, 0)
    with pytest.raises(ValueError, match="local rank"):
        devices.gpu_index(-1, 2)


@pytest.mark.parametrize("ranks, count, shared", [
    (1, 1, False), (2, 1, True), (2, 2, False), (4, 2, True), (4, 4, False), (2, 4, False)])
def test_the_sharing_note_is_one_line_where_ranks_share_gpus(ranks, count, shared):
    note = devices.sharing_note(ranks, count)
    assert devices.shares_gpu(ranks, count) == shared
    if not shared:
        assert note is None
        return
    assert "\n" not in note
    assert note.startswith(f"{ranks} ranks on {count} GPU(s)")
    assert "MPS" in note


@pytest.mark.parametrize("ranks, count, local_rank, gpu, sharing", [
    (2, 1, 1, 0, True), (2, 2, 1, 1, False), (4, 2, 3, 1, True), (4, 4, 2, 2, False)])
def test_use_gpu_makes_the_rank_gpu_current(monkeypatch, ranks, count, local_rank, gpu,
                                            sharing):
    chosen = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setenv("NCCL_MULTI_RANK_GPU_ENABLE", "0")
    device = devices.use_gpu(local_rank, ranks)
    assert device == torch.device("cuda", gpu)
    assert chosen == [device]
    assert os.environ["NCCL_MULTI_RANK_GPU_ENABLE"] == ("1" if sharing else "0")


@pytest.mark.parametrize("ranks, count, version, refused", [
    (2, 1, (2, 28, 9), True), (2, 1, (2, 30, 7), False), (2, 2, (2, 28, 9), False),
    (4, 2, (2, 29, 0), True), (1, 1, (2, 18, 0), False)])
def test_nccl_is_refused_only_for_ranks_sharing_a_gpu_before_2_30(ranks, count, version,
                                                                   refused):
    why = devices.nccl_refusal(ranks, count, version)
    if not refused:
        assert why is None
        return
    assert why == (f"{ranks} ranks on {count} GPU(s) need NCCL >= 2.30, torch has "
                   f"{version[0]}.{version[1]}")


# --- refusing cuda before any rank starts ------------------------------------------------


def test_train_refuses_cuda_without_starting_ranks(no_gpu, monkeypatch, capsys):
    module = _train_module()

    def no_ranks(*args, **kwargs):
        raise AssertionError("ranks were started")
    monkeypatch.setattr(module, "spawn", no_ranks)
    monkeypatch.setattr(module, "train", no_ranks)
    for nproc in ("2", "1"):
        with pytest.raises(SystemExit) as exit_:
            module.main(["--device", "cuda", "--nproc", nproc])
        assert exit_.value.code == 2
        assert "--device cuda:" in capsys.readouterr().err


def test_train_under_torchrun_refuses_cuda_before_making_its_group(no_gpu, monkeypatch,
                                                                    capsys):
    import pyddp

    module = _train_module()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")

    def no_group(*args, **kwargs):
        raise AssertionError("a group was made")
    monkeypatch.setattr(pyddp, "init_process_group", no_group)
    with pytest.raises(SystemExit) as exit_:
        module.main(["--device", "cuda"])
    assert exit_.value.code == 2
    assert "--device cuda:" in capsys.readouterr().err


def test_bench_ddp_refuses_cuda_without_starting_ranks(no_gpu, monkeypatch, capsys):
    def no_ranks(*args, **kwargs):
        raise AssertionError("ranks were started")
    monkeypatch.setattr(_launch, "spawn", no_ranks)
    assert bench_ddp.main(_bench_parser().parse_args(["--device", "cuda"])) == 2
    err = capsys.readouterr().err
    assert err.startswith("pyddp.bench ddp: --device cuda:")
    assert "--device cpu" in err


@pytest.mark.multiprocess
@pytest.mark.parametrize("argv", [
    [TRAIN, "--device", "cuda"],
    ["-m", "pyddp.bench", "ddp", "--device", "cuda"],
], ids=["train.py", "bench ddp"])
def test_the_command_refuses_cuda_without_a_visible_gpu(argv):
    # No GPU visible, whatever the machine: a CPU build of torch sees none anyway.
    result = _run([sys.executable, *argv], REFUSAL_SECONDS, CUDA_VISIBLE_DEVICES="")
    assert result.returncode == 2, result.stderr[-3000:]
    assert "--device cuda:" in result.stderr
    assert "--device cpu" in result.stderr
    # Nothing trained or timed: the refusal came before the ranks.
    assert "digits:" not in result.stdout and "round 1/" not in result.stdout


# --- the benchmark on CUDA: backend, names, report ----------------------------------------


def test_bench_on_the_cpu_keeps_its_variants():
    setup = bench_ddp.make_setup("cpu", 2)
    assert setup == bench_ddp.Setup("cpu", "gloo")
    assert setup.variants == ("no communication", "pyddp DDP (shm)", "torch DDP (gloo)")


@pytest.mark.parametrize("count, version, backend", [
    (1, (2, 28, 9), "gloo"), (1, (2, 30, 7), "nccl"), (2, (2, 28, 9), "nccl")])
def test_bench_on_cuda_picks_nccl_where_it_can_run_the_ranks(monkeypatch, count, version,
                                                             backend):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: version)
    setup = bench_ddp.make_setup("cuda", 2)
    assert setup.torch_backend == backend
    assert (setup.why_not_nccl is None) == (backend == "nccl")
    assert setup.variants == ("no communication (cuda)", "pyddp DDP (auto, cuda)",
                              f"torch DDP ({backend}, cuda)")


def test_bench_on_cuda_without_nccl_in_torch_takes_gloo(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    assert bench_ddp.make_setup("cuda", 2) == bench_ddp.Setup(
        "cuda", "gloo", "this torch build has no NCCL")


def _report(variants, **extra) -> dict:
    base, ours, theirs = variants
    return {"step_s": {base: [0.010, 0.011, 0.012], ours: [0.012, 0.0135, 0.0145],
                       theirs: [0.018, 0.019, 0.022]},
            "pyddp_wait_s": 0.0005, "identical": True, **extra}


def test_bench_report_on_the_cpu_is_as_before():
    setup = bench_ddp.Setup("cpu", "gloo")
    # The text of the report before --device, for the same result.
    assert bench_ddp._render(_report(setup.variants, pyddp_transports={"cpu": "shm"},
                                     device_name="cpu"), setup) == (
        "variant               step (ms)  overhead (ms)  overhead / torch\n"
        "no communication           11.0              -                 -\n"
        "pyddp DDP (shm)            13.5            2.5             0.31x\n"
        "torch DDP (gloo)           19.0            8.0             1.00x\n"
        "pyddp: 0.5 ms per step waiting for all-reduces at the end of backward (4% of its step)\n"
        "pyddp parameters bitwise identical on every rank: yes\n"
        "target, pyddp overhead <= 0.25 x torch DDP + gloo's: not met (2.5 ms vs 8.0 ms)")


def test_bench_report_on_cuda_names_backends_and_devices():
    setup = bench_ddp.Setup("cuda", "gloo", "2 ranks on 1 GPU(s) need NCCL >= 2.30, torch "
                                            "has 2.28")
    text = bench_ddp._render(_report(setup.variants, pyddp_transports={"cpu": "shm",
                                                                       "cuda": "cuda_ipc"},
                                     device_name="cuda:0 (a GPU)"), setup)
    lines = text.splitlines()
    width = len("no communication (cuda)")
    assert lines[1].startswith("no communication (cuda)".ljust(width))
    assert lines[2].startswith("pyddp DDP (auto, cuda)".ljust(width) + "       13.5")
    assert lines[3].startswith("torch DDP (gloo, cuda)".ljust(width) + "       19.0")
    assert "device: cuda; rank 0 on cuda:0 (a GPU)" in lines
    assert "pyddp DDP: group of backend 'auto', cuda tensors over cuda_ipc" in lines
    assert ("torch DDP: over gloo, not NCCL: 2 ranks on 1 GPU(s) need NCCL >= 2.30, torch "
            "has 2.28") in lines
    assert not any(line.startswith("target") for line in lines)


# --- checkpoints and a real run -----------------------------------------------------


def test_a_checkpoint_resumes_onto_the_device_given(tmp_path):
    module = _train_module()
    torch.manual_seed(1)
    saved = module.DigitsCNN()
    optimizer = torch.optim.SGD(saved.parameters(), lr=0.1, momentum=0.9)
    saved(torch.zeros(2, 1, 8, 8)).sum().backward()
    optimizer.step()
    module._save(str(tmp_path), saved, optimizer, 7)
    torch.manual_seed(2)
    fresh = module.DigitsCNN()
    fresh_optimizer = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    assert module._resume(str(tmp_path), fresh, fresh_optimizer, torch.device("cpu")) == 7
    for a, b in zip(saved.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b) and b.device == torch.device("cpu")
    assert torch.equal(optimizer.state_dict()["state"][0]["momentum_buffer"],
                       fresh_optimizer.state_dict()["state"][0]["momentum_buffer"])


def _epochs(output: str) -> list:
    """(loss, test accuracy %) of each epoch that rank 0 printed."""
    found = re.findall(r"epoch +\d+/\d+ +loss ([0-9.]+) +test accuracy +([0-9.]+)%", output)
    assert len(found) == int(EPOCHS), output[-3000:]
    return [(float(loss), float(accuracy)) for loss, accuracy in found]


@pytest.mark.multiprocess
def test_two_ranks_with_device_auto_train_as_one_process_does():
    reference = _run([sys.executable, TRAIN, "--nproc", "1", "--device", "cpu",
                      "--epochs", EPOCHS], RUN_SECONDS)
    assert reference.returncode == 0, reference.stderr[-3000:]
    # No GPU visible, whatever the machine: auto means the CPU.
    ranks = _run([sys.executable, TRAIN, "--device", "auto", "--epochs", EPOCHS],
                 RUN_SECONDS, CUDA_VISIBLE_DEVICES="")
    assert ranks.returncode == 0, ranks.stderr[-3000:]
    assert "2 rank(s)" in ranks.stdout and "cuda" not in ranks.stdout
    one_image = 100 / 359  # percent: the test set has 359 images
    for (loss, accuracy), (ref_loss, ref_accuracy) in zip(_epochs(ranks.stdout),
                                                          _epochs(reference.stdout)):
        # The same global batches: the same model up to the order of float sums.
        assert loss == pytest.approx(ref_loss, abs=1e-3)
        assert abs(accuracy - ref_accuracy) <= one_image
    assert _epochs(ranks.stdout)[-1][1] > 90.0
