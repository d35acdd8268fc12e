"""pyddp's GPU paths: the CPU suite's correctness cases on CUDA tensors.

Two spawned ranks on device 0 (several ranks share the one GPU of this
project's GPU machines; with several GPUs, rank r takes device r). The
groups carry the CPU suite's names, so its case functions (collective_suite) run
unchanged with ``ctx.state["device"]`` set:

- ``auto``: backend "auto", default settings (cuda_ipc chosen, or NCCL when
  cuda_ipc cannot connect);
- ``ring``, ``direct``, ``two_shot``: cuda_ipc with the algorithm forced and
  the CPU suite's small slots and staging buffers (many pieces and rounds);
- ``cuda_host``: the fused programs on host threads, the tensors staged
  through host memory (chosen where ranks share a GPU without MPS);
- ``nccl``: NCCL's own collectives through pyddp's NcclEngine, and
  ``nccl_ring``: pyddp's ring over NCCL send/recv with the small slots (two
  ranks on one GPU need NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1, else
  skipped).

pyddp's DistributedDataParallel trains a module on the GPU through these
groups to what one process computes on the CPU (test_ddp's cases and reference).

Every test is marked ``cuda`` and skips without a GPU.
"""

from __future__ import annotations

import datetime
import gc
import os
import time

import pytest
import torch
import torch.distributed as dist

import pyddp
from collective_suite import (_all_gather_cases, _all_reduce_cases, _broadcast_cases,
                              _half_types_accumulate_in_fp32, _random_floats,
                              _reduce_scatter_cases)
from ddp_cases import (Case, assert_close_records, assert_identical_records, make_model, pack,
                       reference, train, unpack)
from harness import RankContext, Ranks
from pyddp.bench import peers

WORLD = 2

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.multiprocess,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not pyddp._C.has_cuda, reason="pyddp was built without CUDA"),
]


def _shares_gpu() -> bool:
    return torch.cuda.device_count() < WORLD


def _nccl_reason() -> str:
    """Why NCCL cannot run two ranks here; "" if it can."""
    version = tuple(torch.cuda.nccl.version()[:2])
    if _shares_gpu() and version < peers.NCCL_MULTI_RANK_GPU_VERSION:
        return f"two ranks on one GPU need NCCL >= 2.30, torch has {version}"
    return ""


def _setup(ctx: RankContext) -> None:
    device = torch.device("cuda", ctx.rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    ctx.state["device"] = device

    def group(name: str, backend: str, **opts) -> pyddp.ProcessGroup:
        options = pyddp.GroupOptions()
        for key, value in opts.items():
            setattr(options, key, value)
        store = dist.FileStore(ctx.store_path(name), ctx.world_size)
        return pyddp.new_group(backend, store=store, rank=ctx.rank, world_size=ctx.world_size,
                               timeout=datetime.timedelta(seconds=120), options=options)

    ctx.groups["auto"] = group("auto", "auto")
    ctx.groups["ring"] = group("ring", "cuda_ipc", algo=pyddp.Algo.RING, slot_bytes=256,
                               num_slots=2)
    ctx.groups["direct"] = group("direct", "cuda_ipc", algo=pyddp.Algo.DIRECT,
                                 direct_max_bytes=256)
    ctx.groups["two_shot"] = group("two_shot", "cuda_ipc", algo=pyddp.Algo.TWO_SHOT,
                                   direct_max_bytes=0, two_shot_max_bytes=320)
    # the fused programs on host threads, CUDA tensors staged through host
    # memory (what "auto" takes where ranks share a GPU without MPS)
    ctx.groups["cuda_host"] = group("cuda_host", "cuda_host", slot_bytes=256)
    if not _nccl_reason():
        ctx.groups["nccl"] = group("nccl", "nccl")
        ctx.groups["nccl_ring"] = group("nccl_ring", "nccl_ring", slot_bytes=256, num_slots=2)


@pytest.fixture(scope="module")
def ranks():
    env = {"NCCL_MULTI_RANK_GPU_ENABLE": "1"} if _shares_gpu() else {}
    pool = Ranks(WORLD, setup=_setup, env={**env, "PYDDP_DEBUG": os.environ.get(
        "PYDDP_DEBUG", "")})
    yield pool
    pool.close()


GROUPS = ["auto", "ring", "direct", "two_shot", "cuda_host", "nccl", "nccl_ring"]


def _skip_missing(group: str) -> None:
    if group.startswith("nccl") and _nccl_reason():
        pytest.skip(_nccl_reason())


@pytest.mark.parametrize("group", GROUPS)
def test_all_reduce_every_dtype_and_op(ranks, group):
    _skip_missing(group)
    ranks.run(_all_reduce_cases, group, timeout=600)


@pytest.mark.parametrize("group", ["auto", "ring", "cuda_host", "nccl", "nccl_ring"])
def test_reduce_scatter_every_dtype_and_op(ranks, group):
    _skip_missing(group)
    ranks.run(_reduce_scatter_cases, group, timeout=600)


@pytest.mark.parametrize("group", ["auto", "ring", "cuda_host", "nccl", "nccl_ring"])
def test_all_gather_every_dtype(ranks, group):
    _skip_missing(group)
    ranks.run(_all_gather_cases, group, timeout=600)


@pytest.mark.parametrize("group", ["auto", "ring", "cuda_host", "nccl", "nccl_ring"])
def test_broadcast_every_dtype_and_root(ranks, group):
    _skip_missing(group)
    ranks.run(_broadcast_cases, group, timeout=600)


@pytest.mark.parametrize("group", ["auto", "ring", "direct", "two_shot", "cuda_host"])
def test_half_types_accumulate_in_fp32(ranks, group):
    ranks.run(_half_types_accumulate_in_fp32, group)


@pytest.mark.parametrize("group", ["auto", "ring", "direct", "two_shot", "cuda_host"])
def test_results_are_bitwise_identical_across_ranks(ranks, group):
    digests = ranks.run(_random_floats, group)
    assert all(d == digests[0] for d in digests)


def _stream_semantics(ctx: RankContext) -> None:
    """Work queued on a side stream is waited for; wait() orders the caller's stream."""
    pg, dev, n = ctx.groups["ring"], ctx.state["device"], ctx.world_size
    side = torch.cuda.Stream(device=dev)
    with torch.cuda.stream(side):
        t = torch.empty(1 << 20, device=dev)
        t.fill_(ctx.rank + 1)  # queued just before the call: the collective must see it
        work = pg.all_reduce(t, async_op=True)
        work.wait()
        assert torch.all(t == n * (n + 1) / 2).item(), "all_reduce on a side stream"
        doubled = pg.all_reduce(t, async_op=True).get_future().then(
            lambda f: f.value()[0] * 2).wait()
        assert torch.all(doubled == n * n * (n + 1)).item(), "future then"
    torch.cuda.synchronize(dev)
    # A CPU tensor on a CUDA-only group is refused, naming both devices.
    with pytest.raises(TypeError, match=f"rank {ctx.rank}: all_reduce: tensor is on cpu"):
        pg.all_reduce(torch.ones(2))
    # pyddp's CUDA transports take no bitwise op.
    with pytest.raises(TypeError, match=f"rank {ctx.rank}: all_reduce: ReduceOp.BXOR is "
                                        "supported on CPU tensors only"):
        pg.all_reduce(torch.ones(2, dtype=torch.int32, device=dev), pyddp.ReduceOp.BXOR)


def test_stream_semantics(ranks):
    ranks.run(_stream_semantics)


def _tensors_outlive_their_group(ctx: RankContext, backend: str) -> float:
    """A tensor a collective used, freed after its group is destroyed: the caching
    allocator then records an event on the group's stream (the collective's
    record_stream), which must still exist. Twice, so a group follows a destroyed one."""
    dev, n = ctx.state["device"], ctx.world_size
    for life in range(2):
        store = dist.FileStore(ctx.store_path(f"{backend}_life{life}"), n)
        pg = pyddp.new_group(backend, store=store, rank=ctx.rank, world_size=n,
                             timeout=datetime.timedelta(seconds=60))
        t = torch.full((1 << 20,), float(ctx.rank + 1), device=dev)
        pg.all_reduce(t)
        total = t[-1].item()
        pyddp.destroy_process_group(pg)
        del pg
        gc.collect()  # the engine, and with it the stream, is gone
        del t
        torch.cuda.synchronize(dev)
    return total


@pytest.mark.parametrize("backend", ["cuda_ipc", "nccl"])
def test_tensors_outlive_their_group(ranks, backend):
    _skip_missing(backend)
    assert ranks.run(_tensors_outlive_their_group, backend) == [WORLD * (WORLD + 1) / 2] * WORLD


def _auto_serves_both_devices(ctx: RankContext) -> str:
    pg, dev = ctx.groups["auto"], ctx.state["device"]
    cpu, gpu = torch.ones(3), torch.ones(3, device=dev)
    pg.all_reduce(cpu)
    pg.all_reduce(gpu)
    assert torch.equal(cpu, gpu.cpu()) and cpu[0].item() == ctx.world_size
    return pg.transports()


def test_auto_group_serves_cpu_and_cuda_tensors(ranks):
    # Two processes on one host: cuda_ipc connects.
    assert ranks.run(_auto_serves_both_devices) == [{"cpu": "shm", "cuda": "cuda_ipc"}] * WORLD


def _auto_transport(ctx: RankContext) -> str:
    dev, n = ctx.state["device"], ctx.world_size
    pg = pyddp.new_group("auto", store=dist.FileStore(ctx.store_path("auto_turns"), n),
                         rank=ctx.rank, world_size=n, timeout=datetime.timedelta(seconds=60))
    t = torch.full((1000,), float(ctx.rank + 1), device=dev)
    pg.all_reduce(t)
    assert torch.all(t == n * (n + 1) / 2).item()
    transport = pg.transports()["cuda"]
    pyddp.destroy_process_group(pg)
    return transport


def test_auto_runs_the_programs_on_the_host_where_kernels_take_turns(ranks):
    # tests/gpu/check.sh says whether MPS serves the ranks (PYDDP_CHECK_MPS)
    mps = os.environ.get("PYDDP_CHECK_MPS")
    if mps is None or not _shares_gpu():
        pytest.skip("needs ranks that share a GPU, with PYDDP_CHECK_MPS=on or off")
    expected = "cuda_ipc" if mps == "on" else "cuda_host"
    assert ranks.run(_auto_transport) == [expected] * WORLD


def _barrier_meets_on_both_engines(ctx: RankContext) -> tuple:
    """The auto group's barrier once it has a CPU and a CUDA engine: it returns after
    every rank entered it, with the CUDA engine's queued collectives done."""
    pg, dev = ctx.groups["auto"], ctx.state["device"]
    pg.all_reduce(torch.ones(3))
    pending = pg.all_reduce(torch.ones(1 << 22, device=dev), async_op=True)
    time.sleep(0.3 * ctx.rank)
    entered = time.time()
    pg.barrier()
    left = time.time()
    assert pending.is_completed(), "a CUDA all_reduce queued before the barrier is not done"
    pg.barrier(async_op=True).wait()
    return entered, left


def test_barrier_meets_on_both_engines(ranks):
    times = ranks.run(_barrier_meets_on_both_engines)
    last_entry = max(entered for entered, _ in times)
    assert all(left >= last_entry for _, left in times), times


def _registered_buffers(ctx: RankContext) -> None:
    """Collectives on CUDA tensors in a registered buffer read the peers' in place: the
    "two_shot" group (every all_reduce size in place), tensors at offsets that differ by
    rank, against references made on the CPU; a plain tensor beside them stages."""
    pg, dev, n, r = ctx.groups["two_shot"], ctx.state["device"], ctx.world_size, ctx.rank
    engine = pg._engines["cuda"]
    assert pg.can_register(dev) and isinstance(engine, pyddp._C.FusedEngine)
    buffer = torch.zeros(1 << 22, dtype=torch.uint8, device=dev)
    pg.register_buffer(buffer)
    start = engine.registered_launches
    count = 100_003
    inputs = [torch.randn(n * count, generator=torch.Generator().manual_seed(k))
              for k in range(n)]

    def window(offset: int, elements: int) -> torch.Tensor:
        return buffer[offset:offset + 4 * elements].view(torch.float32)

    t = window(256 * (r + 1), count)
    t.copy_(inputs[r][:count])
    pg.all_reduce(t)
    expected = sum(x[:count].double() for x in inputs).float()
    torch.testing.assert_close(t.cpu(), expected, rtol=1e-5, atol=1e-5)
    whole = window(0, n * count)
    whole.zero_()
    mine = whole[r * count:(r + 1) * count]
    mine.copy_(inputs[r][:count])
    pg.all_gather_single(whole, mine)
    assert torch.equal(whole.cpu(), torch.cat([x[:count] for x in inputs]))
    for root in range(n):
        t = window(512, count)
        t.copy_(inputs[r][:count])
        pg.broadcast(t, root)
        assert torch.equal(t.cpu(), inputs[root][:count])
    source = window(0, n * count)
    source.copy_(inputs[r])
    out = torch.empty(count, device=dev)
    pg.reduce_scatter_single(out, source)
    expected = sum(x.double() for x in inputs).float()[r * count:(r + 1) * count]
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-5)
    assert engine.registered_launches - start == 3 + n
    plain = inputs[r][:count].to(dev)
    pg.all_reduce(plain)
    assert engine.registered_launches - start == 3 + n
    pg.deregister_buffer(buffer)


def test_registered_buffers_are_read_in_place(ranks):
    ranks.run(_registered_buffers)


# Buckets of one parameter each and gradients as bucket views; no_sync micro-batches.
DDP_CASES = {
    "default": Case(),
    "small_buckets_as_views": Case(ddp={"bucket_cap_mb": 0.001, "gradient_as_bucket_view": True}),
    "accumulate": Case(accumulate=1, model={"batchnorm": True}),
}
# cuBLAS and the CPU sum a matrix product in different orders.
GPU_RTOL, GPU_ATOL = 1e-3, 1e-5


def _ddp_trains(ctx: RankContext, group: str, case: Case) -> bytes:
    device = ctx.state["device"]
    model = make_model(case, ctx.rank).to(device)
    pg = ctx.groups[group]
    ddp = pyddp.DistributedDataParallel(model, device_ids=[device], process_group=pg,
                                        **case.ddp)
    engine = pg._engines["cuda"]
    start = getattr(engine, "registered_launches", 0)
    records = train(case, model, ddp, ctx.rank, ddp.no_sync, device=device)
    return pack((records, getattr(engine, "registered_launches", 0) - start))


@pytest.mark.parametrize("group", ["auto", "ring", "nccl"])
@pytest.mark.parametrize("case", DDP_CASES)
def test_ddp_trains_as_one_process_does(ranks, group, case):
    _skip_missing(group)
    results = [unpack(r) for r in ranks.run(_ddp_trains, group, DDP_CASES[case])]
    records = [r[0] for r in results]
    what = f"DDP on the GPU over {group}, case {case}"
    if group == "ring":
        # the fused engine's two-shot at every size: the buckets read in place
        assert all(launches > 0 for _, launches in results), results
    assert_identical_records(records, what)
    assert_close_records(records[0], reference(DDP_CASES[case], WORLD), what,
                         rtol=GPU_RTOL, atol=GPU_ATOL)
