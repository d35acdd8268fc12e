"""NCCL's own collectives through pyddp's NcclEngine.

CPU test (CUDA builds): without a GPU, creating an NcclEngine fails at once with
an error naming the device and NCCL.

GPU tests (marked ``cuda``): NcclEngine on 1 and on 2 spawned ranks (device 0
for all, or device r for rank r when there are enough), every collective against
references; skipped without a GPU, and on 2 ranks when they would share a GPU
with NCCL < 2.30.
"""

from __future__ import annotations

import datetime
import os
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


def _nccl_engine(store, rank: int, size: int, timeout_ms: int, device: int):
    options = pyddp.GroupOptions()
    options.timeout_ms = timeout_ms
    engine, _, _ = _C.make_engine(store, rank, size, options, torch.device("cuda", device), "nccl")
    return engine


@pytest.mark.skipif(not _C.has_cuda or torch.cuda.device_count() > 0,
                    reason="needs a CUDA build of pyddp on a machine without a GPU")
def test_nccl_engine_without_a_gpu_fails_clearly():
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        with pytest.raises(dist.DistBackendError) as err:
            _nccl_engine(store, 0, 1, 5000, 0)
        message = str(err.value)
        assert "rank 0" in message and "CUDA device 0" in message
        assert "0 CUDA devices are visible" in message and "NCCL" in message
        with pytest.raises(ValueError, match="rank 2 is not in"):
            _nccl_engine(store, 2, 2, 5000, 0)



def _gpu_skip_reason(world_size: int):
    if not _C.has_cuda:
        return "CPU-only build of pyddp"
    gpus = torch.cuda.device_count()
    if gpus == 0:
        return "no CUDA GPU visible"
    if gpus < world_size and _C.nccl_version() < MULTI_RANK_NCCL:
        return (f"{world_size} ranks on {gpus} GPU(s) need NCCL >= 2.30 with "
                f"NCCL_MULTI_RANK_GPU_ENABLE=1; NCCL is {_C.nccl_version()}")
    return None


GPU_SKIP = _gpu_skip_reason(1)
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
        ctx.groups[name] = _nccl_engine(store, ctx.rank, ctx.world_size, timeout, device)


@pytest.fixture(scope="module", params=[1, 2], ids=lambda n: f"world{n}")
def gpu_ranks(request):
    reason = _gpu_skip_reason(request.param)
    if reason is not None:
        pytest.skip(reason)
    pool = Ranks(request.param, setup=_gpu_setup, env={"NCCL_MULTI_RANK_GPU_ENABLE": "1"})
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
    assert pg.timeout_ms == TIMEOUT_MS and pg.device == dev
    with pytest.raises(TypeError, match=f"rank {ctx.rank}: all_reduce: tensor is on cpu"):
        pg.all_reduce(torch.ones(4), _C.RedOp.SUM, False)
    with pytest.raises(TypeError, match="AVG needs a floating-point tensor"):
        pg.all_reduce(torch.ones(4, dtype=torch.int32, device=dev), _C.RedOp.AVG, False)
    with pytest.raises(TypeError, match="has dtype"):
        pg.all_reduce(torch.ones(4, dtype=torch.complex64, device=dev), _C.RedOp.SUM, False)
    with pytest.raises(TypeError, match=f"rank {ctx.rank}: all_reduce: ReduceOp.BAND is "
                                        "supported on CPU tensors only .NCCL has no bitwise"):
        pg.all_reduce(torch.ones(4, dtype=torch.int32, device=dev), _C.RedOp.BAND, False)
    with pytest.raises(ValueError, match=f"expected {4 * ctx.world_size}"):
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


@pytest.mark.multiprocess
@cuda
@needs_gpu
def test_gpu_all_reduce(gpu_ranks):
    gpu_ranks.run(_gpu_all_reduce, timeout=600)


@pytest.mark.multiprocess
@cuda
@needs_gpu
def test_gpu_reduce_scatter(gpu_ranks):
    gpu_ranks.run(_gpu_reduce_scatter, timeout=600)


@pytest.mark.multiprocess
@cuda
@needs_gpu
def test_gpu_all_gather(gpu_ranks):
    gpu_ranks.run(_gpu_all_gather, timeout=600)


@pytest.mark.multiprocess
@cuda
@needs_gpu
def test_gpu_broadcast(gpu_ranks):
    gpu_ranks.run(_gpu_broadcast, timeout=600)


@pytest.mark.multiprocess
@cuda
@needs_gpu
def test_gpu_stream_semantics(gpu_ranks):
    gpu_ranks.run(_gpu_stream_semantics)


@pytest.mark.multiprocess
@cuda
@needs_gpu
def test_gpu_bad_arguments(gpu_ranks):
    n = gpu_ranks.world_size
    assert gpu_ranks.run(_gpu_bad_arguments) == [str([float(n)] * 4)] * n


@pytest.mark.multiprocess
@cuda
@needs_gpu
def test_gpu_timeout_fails_the_work_and_the_group(gpu_ranks):
    if gpu_ranks.world_size < 2:
        pytest.skip("needs a peer that does not join")
    assert gpu_ranks.run(_gpu_timeout, timeout=120) == ["failed", ""]
