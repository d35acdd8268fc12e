"""Collectives on 2, 3 and 4 spawned ranks against independent references.

Each world size starts its ranks once (module fixture) with six groups:
``auto`` (backend "auto", default settings: small all-reduces direct,
large ones ring),
``ring`` (ring forced, 256-byte slots and the minimum 2 slots, so small
tensors take many pieces), ``direct`` (one-shot all-reduce forced, with
256-byte staging buffers, so small tensors take many rounds, staged with
streaming stores),
``two_shot`` (two-shot all-reduce forced, with 320-byte staging buffers) and
``streaming`` (ring forced, with 320-byte slots that every rank writes with
streaming stores, transport/slot_stores.h) and ``cma`` (all_gather,
broadcast, all_reduce and reduce_scatter read the peers' tensors through the
kernel at every size: cross-memory attach, tests/collectives/test_cma.py). The case
functions shared with the GPU and multi-host suites are in
tests/support/collective_suite.py.
"""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist

import pyddp
from collective_cases import BITWISE_OPS, LARGE, ReduceOp, check_equal, make_input
from collective_suite import (_all_gather_cases, _all_reduce_cases, _bitwise_cases,
                              _broadcast_cases, _half_types_accumulate_in_fp32, _random_floats,
                              _reduce_scatter_cases)
from harness import RankContext, Ranks

GROUPS = ("auto", "ring", "direct", "two_shot", "streaming")


def _setup(ctx: RankContext) -> None:
    def group(name: str, backend: str = "shm", **opts) -> pyddp.ProcessGroup:
        options = pyddp.GroupOptions()
        for key, value in opts.items():
            setattr(options, key, value)
        store = dist.FileStore(ctx.store_path(name), ctx.world_size)
        return pyddp.new_group(backend, store=store, rank=ctx.rank, world_size=ctx.world_size,
                               timeout=datetime.timedelta(seconds=60), options=options)

    ctx.groups["auto"] = group("auto", backend="auto")
    ctx.groups["ring"] = group("ring", algo=pyddp.Algo.RING, slot_bytes=256, num_slots=2)
    # 256-byte staging buffers: direct all-reduces of more take several
    # rounds. Streaming stores forced, as for the slots of "streaming" below.
    ctx.groups["direct"] = group("direct", algo=pyddp.Algo.DIRECT, direct_max_bytes=256,
                                 slot_stores=pyddp.SlotStores.STREAMING)
    # Two-shot forced with 320-byte staging buffers: several rounds, and
    # blocks of unequal sizes within a round.
    ctx.groups["two_shot"] = group("two_shot", algo=pyddp.Algo.TWO_SHOT, direct_max_bytes=0,
                                   two_shot_max_bytes=320)
    # Streaming stores forced: auto picks them only where they measure faster.
    ctx.groups["streaming"] = group("streaming", algo=pyddp.Algo.RING, slot_bytes=320,
                                    num_slots=2, slot_stores=pyddp.SlotStores.STREAMING)
    # Every all_gather, broadcast, all_reduce and reduce_scatter of a byte or
    # more reads the peers' plain tensors through the kernel (cross-memory
    # attach).
    ctx.groups["cma"] = group("cma", cma=pyddp.CmaReads.ALWAYS, cma_min_bytes=1)
    dist.init_process_group("gloo", store=dist.FileStore(ctx.store_path("gloo"), ctx.world_size),
                            rank=ctx.rank, world_size=ctx.world_size)


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda n: f"world{n}")
def ranks(request):
    pool = Ranks(request.param, setup=_setup)
    yield pool
    pool.close()


# --- functions run on every rank -------------------------------------------


def _bitwise_ops_refuse_floating_tensors(ctx: RankContext) -> None:
    pg, n = ctx.groups["auto"], ctx.world_size
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        for op in BITWISE_OPS:
            name = str(op).rsplit(".", 1)[-1]
            needs = (f"rank {ctx.rank}: %s: ReduceOp.{name} needs an integer tensor .*, "
                     f"got {str(dtype).removeprefix('torch.')}")
            with pytest.raises(TypeError, match=needs % "all_reduce"):
                pg.all_reduce(torch.ones(3, dtype=dtype), op)
            with pytest.raises(TypeError, match=needs % "reduce"):
                pg.reduce(torch.ones(3, dtype=dtype), 0, op)
            with pytest.raises(TypeError, match=needs % "reduce_scatter_single"):
                pg.reduce_scatter_single(torch.ones(3, dtype=dtype),
                                         torch.ones(3 * n, dtype=dtype), op)
    # Refused before anything was queued: the group still reduces.
    t = torch.ones(2, dtype=torch.int32) << ctx.rank
    pg.all_reduce(t, ReduceOp.BOR)
    check_equal(t, torch.full((2,), (1 << n) - 1, dtype=torch.int32), "all_reduce after refusals")


def _aliases_and_module_functions(ctx: RankContext) -> None:
    n = ctx.world_size
    # The default group can be destroyed and created again.
    pyddp.init_process_group("shm", store=dist.FileStore(ctx.store_path("default0"), n),
                             rank=ctx.rank, world_size=n)
    pyddp.barrier()
    pyddp.destroy_process_group()
    pyddp.init_process_group("shm", store=dist.FileStore(ctx.store_path("default"), n),
                             rank=ctx.rank, world_size=n)
    try:
        assert pyddp.is_initialized()
        assert pyddp.get_rank() == ctx.rank and pyddp.get_world_size() == n
        out = torch.zeros(2 * n)
        pyddp.all_gather_into_tensor(out, torch.full((2,), float(ctx.rank)))
        check_equal(out, torch.arange(n, dtype=torch.float32).repeat_interleave(2), "alias gather")
        out2 = torch.zeros(3)
        pyddp.reduce_scatter_tensor(out2, torch.ones(3 * n), op=ReduceOp.MAX)
        check_equal(out2, torch.ones(3), "alias reduce_scatter")
        t = torch.ones(4)
        pyddp.all_reduce(t, op=dist.ReduceOp(ReduceOp.SUM))  # a ReduceOp instance works too
        check_equal(t, torch.full((4,), float(n)), "module all_reduce")
        b = torch.full((2,), float(ctx.rank))
        pyddp.broadcast(b, src=n - 1)
        check_equal(b, torch.full((2,), float(n - 1)), "module broadcast")
        pyddp.barrier()
    finally:
        pyddp.destroy_process_group()
    assert not pyddp.is_initialized()


def _non_contiguous(ctx: RankContext) -> None:
    pg = ctx.groups["ring"]
    n = ctx.world_size
    base = torch.arange(40, dtype=torch.float32).reshape(4, 10)
    t = base.clone()
    view = t[:, ::2]  # every other column: not contiguous
    assert not view.is_contiguous()
    pg.all_reduce(view)
    expected = base.clone()
    expected[:, ::2] *= n
    check_equal(t, expected, "all_reduce into a strided view (other elements untouched)")

    src_t = (base + ctx.rank).t()  # transposed
    pg.broadcast(src_t, 0)
    check_equal(src_t, base.t(), "broadcast into a transposed tensor")

    out = torch.zeros(n, 4, 3).transpose(1, 2)  # non-contiguous output
    inp = (torch.arange(12, dtype=torch.float32).reshape(3, 4) + 100 * ctx.rank)
    pg.all_gather_single(out, inp.t())  # non-contiguous input
    for r in range(n):
        # Block r holds rank r's input in its logical (row-major) element order.
        theirs = (torch.arange(12, dtype=torch.float32).reshape(3, 4) + 100 * r).t()
        check_equal(out[r], theirs.reshape(3, 4), f"all_gather_single strided block {r}")

    # Strided output of reduce_scatter, strided entries of a gather list.
    rs_in = torch.arange(2 * n * 3, dtype=torch.float32).reshape(2 * n, 3)
    rs_out = torch.zeros(3, 2).t()  # (2, 3), not contiguous
    pg.reduce_scatter_single(rs_out, rs_in.t().contiguous().t())
    check_equal(rs_out.flatten(), n * rs_in.flatten()[ctx.rank * 6:(ctx.rank + 1) * 6],
                "reduce_scatter_single into a strided output")
    parts = [torch.zeros(3, 2).t() for _ in range(n)]
    pg.all_gather(parts, torch.full((2, 3), float(ctx.rank)))
    for r in range(n):
        check_equal(parts[r], torch.full((2, 3), float(r)), f"all_gather strided entry {r}")

    # In-place gather: the input is this rank's block of the output.
    out = torch.zeros(n * 3)
    mine = out[ctx.rank * 3:(ctx.rank + 1) * 3]
    mine.fill_(float(ctx.rank + 1))
    pg.all_gather_single(out, mine)
    check_equal(out, (torch.arange(n, dtype=torch.float32) + 1).repeat_interleave(3),
                "in-place all_gather_single")


def _async_work(ctx: RankContext) -> None:
    pg = ctx.groups["auto"]
    n = ctx.world_size
    tensors = [torch.full((100 * (i + 1),), float(i + ctx.rank)) for i in range(5)]
    works = [pg.all_reduce(t, async_op=True) for t in tensors]
    assert all(isinstance(w, pyddp.Work) for w in works)
    for i, work in reversed(list(enumerate(works))):
        assert work.wait(datetime.timedelta(seconds=30)) is True
        assert work.is_completed()
        assert work.exception() is None
        value = work.get_future().wait()
        assert isinstance(value, list) and value[0] is not None
        expected = torch.full((100 * (i + 1),), float(n * i + n * (n - 1) // 2))
        check_equal(tensors[i], expected, f"async all_reduce {i}")
        check_equal(value[0], expected, f"future value {i}")
    # A future's callback sees the outputs.
    t = torch.ones(8)
    fut = pg.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0] * 2)
    check_equal(fut.wait(), torch.full((8,), 2.0 * n), "future.then")
    # Async calls of different kinds keep call order.
    g = torch.zeros(n * 2)
    w1 = pg.all_gather_single(g, torch.full((2,), float(ctx.rank)), async_op=True)
    b = torch.full((3,), float(ctx.rank))
    w2 = pg.broadcast(b, 1, async_op=True)
    w3 = pg.barrier(async_op=True)
    w3.wait()
    assert w1.is_completed() and w2.is_completed()
    check_equal(b, torch.ones(3), "async broadcast")


def _queued_calls_own_their_tensors(ctx: RankContext) -> None:
    """A call run at once borrows its tensors; one queued behind running work
    keeps them (TransportEngine::submit): temporaries that nothing else holds, and
    whose memory the allocator hands out again at once, still give the
    right results."""
    pg = ctx.groups["auto"]
    n, r = ctx.world_size, ctx.rank
    for count in (1001, LARGE):
        ahead = pg.all_reduce(torch.ones(LARGE), async_op=True)  # the calls below queue
        gathered = torch.zeros(n * count)
        works = [pg.all_gather_single(gathered, torch.full((count,), float(r)), async_op=True)]
        scattered = torch.zeros(count)
        works.append(pg.reduce_scatter_single(
            scattered, torch.arange(n * count, dtype=torch.float32) + r, async_op=True))
        works.append(pg.all_reduce(torch.full((count,), float(r + 1)), async_op=True))
        works.append(pg.broadcast(torch.full((count,), float(r)), 1, async_op=True))
        # Write over whatever the temporaries' memory would be if it had been freed.
        junk = [torch.full((n * count,), -7.0) for _ in range(8)] + \
               [torch.full((count,), -7.0) for _ in range(8)]
        for work in [ahead] + works:
            assert work.wait(datetime.timedelta(seconds=60)) is True
        del junk
        check_equal(gathered, torch.arange(n, dtype=torch.float32).repeat_interleave(count),
                    f"queued all_gather_single of a temporary, {count}")
        block = torch.arange(r * count, (r + 1) * count, dtype=torch.float32)
        check_equal(scattered, n * block + n * (n - 1) // 2,
                    f"queued reduce_scatter_single of a temporary, {count}")
        check_equal(works[2].result()[0], torch.full((count,), float(n * (n + 1) // 2)),
                    f"queued all_reduce of a temporary, {count}")
        check_equal(works[3].result()[0], torch.ones(count),
                    f"queued broadcast of a temporary, {count}")


def _future_ready_after_wait(ctx: RankContext) -> None:
    pg = ctx.groups["auto"]
    for i in range(2000):
        t = torch.full((4,), float(i))
        work = pg.all_reduce(t, async_op=True)
        work.wait()
        assert work.get_future().value()[0][0].item() == i * ctx.world_size


def _collective_inside_callback(ctx: RankContext) -> None:
    pg = ctx.groups["auto"]
    n = float(ctx.world_size)
    for queued_behind in (False, True):
        x = torch.ones(5)

        def then(fut):
            pg.all_reduce(x)  # synchronous, on the group's own worker thread
            return fut.value()[0] + x

        if ctx.rank == 1:
            time.sleep(0.2)  # rank 0's first call is still running when .then() attaches
        first = pg.all_reduce(torch.ones(5), async_op=True)
        chained = first.get_future().then(then)
        # DDP's pattern: the next bucket is queued while the callback of the
        # previous one runs its own collective, ahead of the queued one.
        later = torch.full((7,), 3.0)
        behind = pg.all_reduce(later, async_op=True) if queued_behind else None
        check_equal(chained.wait(), torch.full((5,), 2 * n), "collective inside a callback")
        check_equal(x, torch.full((5,), n), "the callback's all_reduce")
        if behind is not None:
            behind.wait()
            check_equal(later, torch.full((7,), 3.0 * n), "the call queued behind the callback")


def _no_segment_in_dev_shm(ctx: RankContext) -> list:
    from harness import pyddp_segments

    return pyddp_segments()


def _barrier_orders(ctx: RankContext) -> tuple:
    pg = ctx.groups["auto"]
    time.sleep(0.3 * ctx.rank)
    entered = time.time()
    pg.barrier()
    return entered, time.time()


def _agrees_with_gloo(ctx: RankContext) -> None:
    pg = ctx.groups["auto"]
    n = ctx.world_size
    for count in (5, 1000, 70001):
        for op in (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX):
            mine = make_input(ctx.rank, count, torch.float32, op)
            ours, theirs = mine.clone(), mine.clone()
            pg.all_reduce(ours, op)
            dist.all_reduce(theirs, op)
            check_equal(ours, theirs, f"all_reduce vs gloo {op} count={count}")
        mine = make_input(ctx.rank, count, torch.int64)
        ours, theirs = torch.zeros(n * count, dtype=torch.int64), torch.zeros(n * count,
                                                                              dtype=torch.int64)
        pg.all_gather_single(ours, mine)
        dist.all_gather_into_tensor(theirs, mine)
        check_equal(ours, theirs, f"all_gather vs gloo count={count}")
        ours, theirs = mine.clone(), mine.clone()
        pg.broadcast(ours, n - 1)
        dist.broadcast(theirs, n - 1)
        check_equal(ours, theirs, f"broadcast vs gloo count={count}")
        full = make_input(ctx.rank, n * count, torch.float32)
        ours = torch.zeros(count)
        pg.reduce_scatter_single(ours, full)
        theirs = full.clone()
        dist.all_reduce(theirs)
        check_equal(ours, theirs[ctx.rank * count:(ctx.rank + 1) * count],
                    f"reduce_scatter vs gloo all_reduce slice count={count}")


# --- tests ------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.parametrize("group", GROUPS + ("cma",))
def test_all_reduce_every_dtype_and_op(ranks, group):
    ranks.run(_all_reduce_cases, group)


@pytest.mark.multiprocess
@pytest.mark.parametrize("group", ["auto", "ring", "direct", "streaming", "cma"])
def test_reduce_scatter_every_dtype_and_op(ranks, group):
    ranks.run(_reduce_scatter_cases, group)


@pytest.mark.multiprocess
@pytest.mark.parametrize("group", GROUPS)
def test_bitwise_ops_on_every_integer_type(ranks, group):
    ranks.run(_bitwise_cases, group)


@pytest.mark.multiprocess
def test_bitwise_ops_refuse_floating_tensors(ranks):
    ranks.run(_bitwise_ops_refuse_floating_tensors)


@pytest.mark.multiprocess
@pytest.mark.parametrize("group", ["auto", "ring", "direct", "streaming", "cma"])
def test_all_gather_every_dtype(ranks, group):
    ranks.run(_all_gather_cases, group)


@pytest.mark.multiprocess
@pytest.mark.parametrize("group", ["auto", "ring", "streaming", "cma"])
def test_broadcast_every_dtype_and_root(ranks, group):
    ranks.run(_broadcast_cases, group)


@pytest.mark.multiprocess
def test_aliases_and_default_group_functions(ranks):
    ranks.run(_aliases_and_module_functions)


def _transports(ctx: RankContext) -> list:
    return [ctx.groups[name].transports() for name in ("auto", "ring")]


@pytest.mark.multiprocess
def test_cpu_tensors_travel_over_shm_in_auto_and_shm_groups(ranks):
    assert ranks.run(_transports) == [[{"cpu": "shm"}, {"cpu": "shm"}]] * ranks.world_size


@pytest.mark.multiprocess
def test_non_contiguous_tensors(ranks):
    ranks.run(_non_contiguous)


@pytest.mark.multiprocess
def test_async_work_and_futures(ranks):
    ranks.run(_async_work)


@pytest.mark.multiprocess
def test_queued_calls_keep_tensors_only_they_hold(ranks):
    ranks.run(_queued_calls_own_their_tensors)


@pytest.mark.multiprocess
def test_future_is_ready_when_wait_returns(ranks):
    ranks.run(_future_ready_after_wait)


@pytest.mark.multiprocess
def test_synchronous_collective_inside_a_future_callback(ranks):
    ranks.run(_collective_inside_callback)


@pytest.mark.multiprocess
@pytest.mark.parametrize("group", GROUPS + ("cma",))
def test_half_types_accumulate_in_fp32_on_every_path(ranks, group):
    ranks.run(_half_types_accumulate_in_fp32, group)


@pytest.mark.multiprocess
@pytest.mark.parametrize("group", GROUPS + ("cma",))
def test_results_are_bitwise_identical_across_ranks(ranks, group):
    digests = ranks.run(_random_floats, group)
    assert all(d == digests[0] for d in digests)


@pytest.mark.multiprocess
def test_segments_are_unlinked_once_every_rank_connected(ranks):
    assert ranks.run(_no_segment_in_dev_shm) == [[]] * ranks.world_size


@pytest.mark.multiprocess
def test_barrier_waits_for_every_rank(ranks):
    times = ranks.run(_barrier_orders)
    last_entry = max(entered for entered, _ in times)
    assert all(left >= last_entry for _, left in times), times


@pytest.mark.multiprocess
def test_agrees_with_torch_gloo(ranks):
    ranks.run(_agrees_with_gloo)


def test_world_size_one_runs_every_collective_locally():
    pg = pyddp.new_group("shm", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for algo_count in (3, 100_000):
            t = torch.arange(algo_count, dtype=torch.float32)
            pg.all_reduce(t, ReduceOp.AVG)
            check_equal(t, torch.arange(algo_count, dtype=torch.float32), "all_reduce")
            out = torch.zeros(algo_count)
            pg.all_gather_single(out, t)
            check_equal(out, t, "all_gather_single")
            parts = [torch.zeros(algo_count)]
            pg.all_gather(parts, t)
            check_equal(parts[0], t, "all_gather")
            pg.broadcast(t, 0)
            check_equal(t, torch.arange(algo_count, dtype=torch.float32), "broadcast")
            rs = torch.zeros(algo_count)
            pg.reduce_scatter_single(rs, t, ReduceOp.MAX)
            check_equal(rs, t, "reduce_scatter_single")
            pg.barrier()
    finally:
        pg.shutdown()
