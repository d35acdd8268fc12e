"""The NCCL backend and the NCCL ring transport.

CPU tests (every build):
- the build reports truthfully whether CUDA and NCCL are compiled in (the
  shared object's NEEDED libraries are the independent witness), and the
  NCCL it links is the one torch loads;
- in a CUDA build without a GPU, creating an NcclBackend fails at once with
  an error naming the device and NCCL;
- the NCCL ring transport's logic (p2p.h: ring verbs as send/receive groups,
  the descriptor check) runs under the real ring algorithms over a simulated
  network of threads in which a send completes only once its receiver has
  posted the matching receive, as NCCL allows: results are checked against
  references, and a pairing that could deadlock on a GPU fails here.

GPU tests (marked ``cuda``): NcclBackend on 2 spawned ranks (device 0 for
both, or devices 0 and 1 when there are two), every collective against
references; skipped without a GPU, or when 2 ranks would share a GPU with
NCCL < 2.30.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist

import pyddp
from collective_cases import (DTYPES, LARGE, ReduceOp, check_equal, dtype_op_pairs, make_input,
                              reference_reduce)
from harness import RankContext, Ranks

_C = pyddp._C
RED_OPS = {ReduceOp.SUM: _C.RedOp.SUM, ReduceOp.AVG: _C.RedOp.AVG,
           ReduceOp.PRODUCT: _C.RedOp.PRODUCT, ReduceOp.MIN: _C.RedOp.MIN,
           ReduceOp.MAX: _C.RedOp.MAX}
MULTI_RANK_NCCL = (2, 30, 0)


def _needed_libraries(path: str) -> set:
    out = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True)
    return {line.split("[", 1)[1].split("]", 1)[0]
            for line in out.stdout.splitlines() if "(NEEDED)" in line}


# --- the build ---------------------------------------------------------------


def test_has_cuda_matches_the_shared_object():
    assert shutil.which("readelf"), "readelf (binutils) is needed to inspect the extension"
    needed = _needed_libraries(_C.__file__)
    assert isinstance(_C.has_cuda, bool)
    assert _C.has_cuda == ("libnccl.so.2" in needed), needed
    assert _C.has_cuda == ("libc10_cuda.so" in needed), needed
    assert not _C.has_cuda or torch.version.cuda is not None
    assert hasattr(_C, "NcclBackend") == _C.has_cuda
    assert hasattr(_C, "nccl_version") == _C.has_cuda


@pytest.mark.skipif(not _C.has_cuda, reason="CPU-only build of pyddp: no NCCL compiled in")
def test_nccl_version_is_the_one_torch_loads():
    version = _C.nccl_version()
    assert version == tuple(torch.cuda.nccl.version())
    assert version >= (2, 10, 0)
    try:
        wheel = importlib.metadata.version(f"nvidia-nccl-cu{torch.version.cuda.split('.')[0]}")
    except importlib.metadata.PackageNotFoundError:
        return  # torch found NCCL elsewhere (PYDDP_NCCL_HOME builds); torch's is checked above
    assert ".".join(map(str, version)) == wheel


@pytest.mark.skipif(not _C.has_cuda or torch.cuda.device_count() > 0,
                    reason="needs a CUDA build of pyddp on a machine without a GPU")
def test_nccl_backend_without_a_gpu_fails_clearly():
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        with pytest.raises(dist.DistBackendError) as err:
            _C.NcclBackend(store, 0, 1, 5000, 0)
        message = str(err.value)
        assert "rank 0" in message and "CUDA device 0" in message
        assert "0 CUDA devices are visible" in message and "NCCL" in message
        with pytest.raises(ValueError, match="rank 2 is not in"):
            _C.NcclBackend(store, 2, 2, 5000, 0)


def _setup_py(env: dict, tmp_path) -> subprocess.CompletedProcess:
    """Runs setup.py's build planning only (``--name``) with `env` added."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run([sys.executable, "setup.py", "--name"], cwd=root, capture_output=True,
                          text=True, env={**os.environ, **env}, timeout=120)


def test_setup_refuses_a_cuda_build_it_cannot_make(tmp_path):
    """A toolkit whose major version differs from torch's: a CPU-only build
    with a warning saying why; forced with PYDDP_BUILD_CUDA=1, an error."""
    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.parent.mkdir()
    other = int(torch.version.cuda.split(".")[0]) - 1 if torch.version.cuda else 12
    nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {other}.4, V{other}.4.1'\n")
    nvcc.chmod(0o755)
    env = {"CUDA_HOME": str(tmp_path)}
    planned = _setup_py(env, tmp_path)
    assert planned.returncode == 0, planned.stderr
    forced = _setup_py({**env, "PYDDP_BUILD_CUDA": "1"}, tmp_path)
    assert forced.returncode != 0
    if torch.version.cuda:
        why = (f"nvcc in {tmp_path} is CUDA {other}.4 but torch was built with CUDA "
               f"{torch.version.cuda}")
        assert "building the CPU-only extension (no CUDA, no NCCL): " + why in planned.stderr
    else:
        why = f"torch {torch.__version__} is a CPU build"
        assert "CPU-only extension" not in planned.stderr, planned.stderr
    assert "PYDDP_BUILD_CUDA=1, but the CUDA build is impossible: " + why in forced.stderr


# --- the ring transport's logic over a simulated network ------------------------

SIM_COUNTS = [0, 1, 3, 1001]
# 64-byte pieces: 16 float32 or 8 float64 elements, so 1001 elements take many.
SIM_PIECE = 64


def _sim(kind, inputs, ops, **kw):
    outputs, errors = _C._testing.p2p_ring(kind, inputs, [RED_OPS[o] for o in ops],
                                           kw.pop("piece_bytes", SIM_PIECE), **kw)
    return outputs, errors


def _ok(errors):
    assert errors == [""] * len(errors), errors


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_sim_all_reduce(n):
    for dtype, op in dtype_op_pairs():
        for count in SIM_COUNTS:
            inputs = [make_input(r, count, dtype, op) for r in range(n)]
            expected = reference_reduce(inputs, op)
            outputs, errors = _sim("all_reduce", inputs, [op] * n, repeats=2)
            _ok(errors)
            for r in range(n):
                check_equal(outputs[r], expected, f"rank {r} {dtype} {op} count={count}")


@pytest.mark.parametrize("n", [2, 3, 4])
def test_sim_all_reduce_in_place(n):
    for dtype in DTYPES:
        for op in (ReduceOp.SUM, ReduceOp.MAX):
            for count in SIM_COUNTS:
                inputs = [make_input(r, count, dtype, op) for r in range(n)]
                outputs, errors = _sim("all_reduce", inputs, [op] * n, in_place=True)
                _ok(errors)
                for r in range(n):
                    check_equal(outputs[r], reference_reduce(inputs, op),
                                f"rank {r} {dtype} {op} count={count} in place")


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_sim_reduce_scatter(n):
    for dtype, op in dtype_op_pairs():
        for count in SIM_COUNTS:
            inputs = [make_input(r, count * n, dtype, op) for r in range(n)]
            expected = reference_reduce(inputs, op)
            outputs, errors = _sim("reduce_scatter", inputs, [op] * n, repeats=2)
            _ok(errors)
            for r in range(n):
                check_equal(outputs[r], expected[r * count:(r + 1) * count],
                            f"rank {r} {dtype} {op} count={count}")


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_sim_all_gather(n):
    for dtype in DTYPES:
        for count in SIM_COUNTS:
            inputs = [make_input(r, count, dtype) for r in range(n)]
            outputs, errors = _sim("all_gather", inputs, [ReduceOp.SUM] * n, repeats=2)
            _ok(errors)
            for r in range(n):
                check_equal(outputs[r], torch.cat(inputs), f"rank {r} {dtype} count={count}")


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_sim_broadcast(n):
    for dtype in (torch.float64, torch.int8, torch.bfloat16):
        for count in SIM_COUNTS:
            for root in range(n):
                inputs = [make_input(r, count, dtype) for r in range(n)]
                outputs, errors = _sim("broadcast", inputs, [ReduceOp.SUM] * n, root=root,
                                       repeats=2)
                _ok(errors)
                for r in range(n):
                    check_equal(outputs[r], inputs[root], f"rank {r} root={root} count={count}")


def test_sim_barrier():
    _, errors = _sim("barrier", [torch.empty(0)] * 3, [ReduceOp.SUM] * 3, repeats=3)
    _ok(errors)


def test_sim_pieces_of_one_element():
    """8-byte pieces: a float64 piece per step, partials of half types 2 per piece."""
    for dtype in (torch.float64, torch.float16, torch.int64):
        inputs = [make_input(r, 37, dtype) for r in range(3)]
        outputs, errors = _sim("all_reduce", inputs, [ReduceOp.SUM] * 3, piece_bytes=8)
        _ok(errors)
        for out in outputs:
            check_equal(out, reference_reduce(inputs, ReduceOp.SUM), f"{dtype}")


def test_sim_missing_flush_is_caught():
    """The chain's root ends on a send: without flush() it never goes out."""
    inputs = [torch.arange(100, dtype=torch.float32)] * 3
    _, errors = _sim("broadcast", inputs, [ReduceOp.SUM] * 3, root=1, flush=False,
                     timeout_ms=2000)
    assert any("rank 1 finished broadcast #1 with a send still pending" in e
               for e in errors), errors
    assert all(errors), errors


def test_sim_descriptor_mismatch_fails_on_every_rank():
    def run(kind, inputs, ops, **kw):
        _, errors = _sim(kind, inputs, ops, **kw)
        assert all(errors), errors
        return errors

    x = torch.ones(10)
    # count
    errors = run("all_reduce", [x, torch.ones(11), x], [ReduceOp.SUM] * 3)
    for e in errors:
        assert "collective #1 differs between ranks" in e and "count from 10 to 11" in e, e
    assert "rank 1 called all_reduce(count=11, dtype=float32, op=SUM)" in errors[1]
    # op and dtype
    errors = run("all_reduce", [x, x.double()], [ReduceOp.SUM, ReduceOp.MAX])
    assert all("dtype from float32 to float64" in e and "op from SUM to MAX" in e
               for e in errors), errors
    # a rank one collective ahead (it skipped one)
    errors = run("all_gather", [x, x], [ReduceOp.SUM] * 2, seqs=[4, 5])
    assert all("sequence number from 4 to 5" in e for e in errors), errors
    # agreeing ranks at any sequence number pass
    _, errors = _sim("broadcast", [x, x], [ReduceOp.SUM] * 2, root=1, seqs=[9, 9])
    _ok(errors)


# --- GPU: NcclBackend on spawned ranks -----------------------------------------


def _gpu_skip_reason():
    if not _C.has_cuda:
        return "CPU-only build of pyddp"
    if torch.cuda.device_count() == 0:
        return "no CUDA GPU visible"
    if torch.cuda.device_count() == 1 and _C.nccl_version() < MULTI_RANK_NCCL:
        return (f"2 ranks on one GPU need NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1; "
                f"NCCL is {_C.nccl_version()}")
    return None


GPU_SKIP = _gpu_skip_reason()
cuda = pytest.mark.cuda
needs_gpu = pytest.mark.skipif(GPU_SKIP is not None, reason=GPU_SKIP or "")
TIMEOUT_MS = 60_000
SHORT_MS = 3_000
GPU_COUNTS = [0, 1, 3, 1001, LARGE]


def _gpu_setup(ctx: RankContext) -> None:
    device = ctx.rank if torch.cuda.device_count() >= ctx.world_size else 0
    torch.cuda.set_device(device)
    ctx.state["device"] = torch.device("cuda", device)
    for name, timeout in (("nccl", TIMEOUT_MS), ("short", SHORT_MS)):
        store = dist.FileStore(ctx.store_path(name), ctx.world_size)
        ctx.groups[name] = _C.NcclBackend(store, ctx.rank, ctx.world_size, timeout, device)


@pytest.fixture(scope="module")
def gpu_ranks():
    if GPU_SKIP is not None:
        pytest.skip(GPU_SKIP)
    pool = Ranks(2, setup=_gpu_setup, env={"NCCL_MULTI_RANK_GPU_ENABLE": "1"})
    yield pool
    pool.close()


def _gpu_all_reduce(ctx: RankContext) -> None:
    pg, dev = ctx.groups["nccl"], ctx.state["device"]
    for dtype, op in dtype_op_pairs():
        for count in GPU_COUNTS:
            inputs = [make_input(r, count, dtype, op) for r in range(ctx.world_size)]
            expected = reference_reduce(inputs, op)
            for rep in range(2):
                t = inputs[ctx.rank].to(dev)
                pg.all_reduce(t, RED_OPS[op], False)
                check_equal(t.cpu(), expected, f"all_reduce {dtype} {op} count={count} rep={rep}")


def _gpu_reduce_scatter(ctx: RankContext) -> None:
    pg, dev, n = ctx.groups["nccl"], ctx.state["device"], ctx.world_size
    for dtype, op in dtype_op_pairs():
        for count in [0, 1, 3, 1001, LARGE // n]:
            inputs = [make_input(r, count * n, dtype, op) for r in range(n)]
            expected = reference_reduce(inputs, op)[ctx.rank * count:(ctx.rank + 1) * count]
            for rep in range(2):
                out = torch.full((count,), 7, dtype=dtype, device=dev)
                pg.reduce_scatter_single(out, inputs[ctx.rank].to(dev), RED_OPS[op], False)
                check_equal(out.cpu(), expected, f"reduce_scatter {dtype} {op} count={count}")
            # in place: the output is this rank's block of the input
            whole = inputs[ctx.rank].to(dev)
            block = whole[ctx.rank * count:(ctx.rank + 1) * count]
            pg.reduce_scatter_single(block, whole, RED_OPS[op], False)
            check_equal(block.cpu(), expected, f"reduce_scatter in place {dtype} {op}")


def _gpu_all_gather(ctx: RankContext) -> None:
    pg, dev, n = ctx.groups["nccl"], ctx.state["device"], ctx.world_size
    for dtype in DTYPES:
        for count in GPU_COUNTS:
            inputs = [make_input(r, count, dtype) for r in range(n)]
            expected = torch.cat(inputs)
            for rep in range(2):
                out = torch.empty(count * n, dtype=dtype, device=dev)
                pg.all_gather_single(out, inputs[ctx.rank].to(dev), False)
                check_equal(out.cpu(), expected, f"all_gather_single {dtype} count={count}")
                parts = [torch.empty(count, dtype=dtype, device=dev) for _ in range(n)]
                pg.all_gather(parts, inputs[ctx.rank].to(dev), False)
                for r in range(n):
                    check_equal(parts[r].cpu(), inputs[r], f"all_gather {dtype} block {r}")
            # in place: the input is this rank's block of the output
            out = torch.zeros(count * n, dtype=dtype, device=dev)
            out[ctx.rank * count:(ctx.rank + 1) * count] = inputs[ctx.rank].to(dev)
            pg.all_gather_single(out, out[ctx.rank * count:(ctx.rank + 1) * count], False)
            check_equal(out.cpu(), expected, f"all_gather_single in place {dtype}")


def _gpu_broadcast(ctx: RankContext) -> None:
    pg, dev = ctx.groups["nccl"], ctx.state["device"]
    for dtype in DTYPES:
        for count in GPU_COUNTS:
            for root in range(ctx.world_size):
                inputs = [make_input(r, count, dtype) for r in range(ctx.world_size)]
                t = inputs[ctx.rank].to(dev)
                pg.broadcast(t, root, False)
                check_equal(t.cpu(), inputs[root], f"broadcast {dtype} count={count} root={root}")


def _gpu_stream_semantics(ctx: RankContext) -> None:
    """Work on a side stream, async handles, futures, non-contiguous views."""
    pg, dev, n = ctx.groups["nccl"], ctx.state["device"], ctx.world_size
    expected = float(sum(range(1, n + 1)))
    side = torch.cuda.Stream(device=dev)
    with torch.cuda.stream(side):
        # written on the side stream just before the call: the collective
        # must wait for it, and the result is read on the same stream
        t = torch.empty(LARGE, device=dev)
        t.fill_(ctx.rank + 1)
        work = pg.all_reduce(t, _C.RedOp.SUM, True)
        work.wait()
        assert torch.all(t == expected).item(), "all_reduce on a side stream"
        fut = pg.all_reduce(t, _C.RedOp.SUM, True).get_future()
        value = fut.wait()[0]  # wait(), not value(): it makes this stream wait
        assert value is t or value.data_ptr() == t.data_ptr()
        assert torch.all(value == expected * n).item(), "future value"
        doubled = fut.then(lambda f: f.value()[0] * 2).wait()
        assert torch.all(doubled == expected * n * 2).item(), "future then"
    torch.cuda.synchronize(dev)
    assert work.is_completed() and work.is_success()
    # a strided view is reduced in place, its gaps untouched
    base = torch.full((2 * 1001,), -1.0, device=dev)
    view = base[::2]
    view.fill_(ctx.rank + 1)
    pg.all_reduce(view, _C.RedOp.MAX, False)
    assert torch.all(base[::2] == n).item() and torch.all(base[1::2] == -1).item()
    # many queued asynchronous collectives complete in order
    ts = [torch.full((1000,), float(i + ctx.rank), device=dev) for i in range(50)]
    works = [pg.all_reduce(x, _C.RedOp.SUM, True) for x in ts]
    for i, (x, w) in enumerate(zip(ts, works)):
        w.wait()
        assert torch.all(x == n * i + sum(range(n))).item(), f"queued all_reduce {i}"
    pg.barrier(False)
    w = pg.barrier(True)
    assert w.wait() and w.is_completed()


def _gpu_bad_arguments(ctx: RankContext) -> str:
    pg, dev = ctx.groups["nccl"], ctx.state["device"]
    assert pg.timeout_ms == TIMEOUT_MS and pg.device == dev.index
    with pytest.raises(TypeError, match=f"rank {ctx.rank}: all_reduce: tensor is on cpu"):
        pg.all_reduce(torch.ones(4), _C.RedOp.SUM, False)
    with pytest.raises(TypeError, match="AVG needs a floating-point tensor"):
        pg.all_reduce(torch.ones(4, dtype=torch.int32, device=dev), _C.RedOp.AVG, False)
    with pytest.raises(TypeError, match="has dtype"):
        pg.all_reduce(torch.ones(4, dtype=torch.complex64, device=dev), _C.RedOp.SUM, False)
    with pytest.raises(ValueError, match="expected 8"):
        pg.all_gather_single(torch.empty(7, device=dev), torch.empty(4, device=dev), False)
    with pytest.raises(ValueError, match="src=5 is not a rank"):
        pg.broadcast(torch.ones(4, device=dev), 5, False)
    # nothing was enqueued: the group still works
    t = torch.ones(4, device=dev)
    pg.all_reduce(t, _C.RedOp.SUM, False)
    return str(t.cpu().tolist())


def _gpu_timeout(ctx: RankContext) -> str:
    """Rank 0 all-reduces alone on the short-timeout group: the collective
    fails at the deadline (while enqueuing, should NCCL wait for the peer
    there, else in Work.wait), and the group refuses later collectives."""
    pg, dev = ctx.groups["short"], ctx.state["device"]
    # Together first, so that NCCL has connected what this size needs.
    pg.all_reduce(torch.ones(4, device=dev), _C.RedOp.SUM, False)
    torch.cuda.synchronize(dev)
    if ctx.rank != 0:
        return ""
    with pytest.raises(dist.DistBackendError, match="did not finish within"):
        pg.all_reduce(torch.ones(4, device=dev), _C.RedOp.SUM, True).wait(
            datetime.timedelta(seconds=30))
    with pytest.raises(dist.DistBackendError, match="refused: an earlier collective failed"):
        pg.all_reduce(torch.ones(4, device=dev), _C.RedOp.SUM, False)
    return "failed"


@cuda
@needs_gpu
def test_gpu_all_reduce(gpu_ranks):
    gpu_ranks.run(_gpu_all_reduce, timeout=600)


@cuda
@needs_gpu
def test_gpu_reduce_scatter(gpu_ranks):
    gpu_ranks.run(_gpu_reduce_scatter, timeout=600)


@cuda
@needs_gpu
def test_gpu_all_gather(gpu_ranks):
    gpu_ranks.run(_gpu_all_gather, timeout=600)


@cuda
@needs_gpu
def test_gpu_broadcast(gpu_ranks):
    gpu_ranks.run(_gpu_broadcast, timeout=600)


@cuda
@needs_gpu
def test_gpu_stream_semantics(gpu_ranks):
    gpu_ranks.run(_gpu_stream_semantics)


@cuda
@needs_gpu
def test_gpu_bad_arguments(gpu_ranks):
    assert gpu_ranks.run(_gpu_bad_arguments) == ["[2.0, 2.0, 2.0, 2.0]"] * 2


@cuda
@needs_gpu
def test_gpu_timeout_fails_the_work_and_the_group(gpu_ranks):
    assert gpu_ranks.run(_gpu_timeout, timeout=120) == ["failed", ""]
