"""The GPU's fused collectives (csrc/device/programs.h) run on the emulated grid: one CPU
thread per channel, between real processes over shared memory, through the "emulated"
backend and pyddp's one front end. Every fused protocol, op and dtype on 2, 3 and 4
ranks, against references computed from every rank's input; counts of 0, 1, fewer than
ranks, not divisible by ranks and of many rounds (small chunks); twice in a row; ranks
that called different collectives; a peer that never comes, a peer that dies (in a
staged collective and in one that reads a registered buffer in place), and a group
destroyed under a waiting peer.
"""

from __future__ import annotations

import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist

import pyddp
from collective_cases import (BITWISE_OPS, INT_DTYPES, check_equal, dtype_op_pairs, make_input,
                              reference_reduce)
from harness import Died, RankContext, Ranks

pytestmark = pytest.mark.multiprocess

TIMEOUT = datetime.timedelta(seconds=60)
# 256-byte chunks: a few hundred elements take many rounds on every channel.
CHUNK = 256
COUNTS = [0, 1, 3, 61, 1000, 5000]
ALGOS = {"one_shot": pyddp.Algo.DIRECT, "two_shot": pyddp.Algo.TWO_SHOT}


def _group(ctx: RankContext, name: str, algo=pyddp.Algo.AUTO, timeout=TIMEOUT):
    options = pyddp.GroupOptions()
    options.slot_bytes = CHUNK
    options.algo = algo
    if algo == pyddp.Algo.TWO_SHOT:
        options.two_shot_max_bytes = 1024
    return pyddp.create_group("emulated", store=dist.FileStore(ctx.store_path(name),
                                                               ctx.world_size),
                              rank=ctx.rank, world_size=ctx.world_size, timeout=timeout,
                              options=options)


def _setup(ctx: RankContext) -> None:
    for name, algo in ALGOS.items():
        ctx.groups[name] = _group(ctx, name, algo)


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda n: f"world{n}")
def ranks(request):
    pool = Ranks(request.param, setup=_setup)
    yield pool
    pool.close()


def _all_reduce(ctx: RankContext, algo: str) -> None:
    pg, n, r = ctx.groups[algo], ctx.world_size, ctx.rank
    cases = [(d, op) for d, op in dtype_op_pairs()] + [(d, op) for d in INT_DTYPES
                                                       for op in BITWISE_OPS]
    for dtype, op in cases:
        for count in COUNTS:
            expected = reference_reduce([make_input(k, count, dtype, op) for k in range(n)], op)
            for rep in range(2):
                t = make_input(r, count, dtype, op)
                pg.all_reduce(t, op)
                check_equal(t, expected, f"{algo} all_reduce {dtype} {op} count={count} "
                                         f"rep={rep}")


def test_all_reduce(ranks):
    for algo in ALGOS:
        ranks.run(_all_reduce, algo)


def _gathers(ctx: RankContext) -> None:
    pg, n, r = ctx.groups["one_shot"], ctx.world_size, ctx.rank
    for dtype in (torch.float32, torch.bfloat16, torch.int8, torch.int64):
        for count in COUNTS:
            mine = make_input(r, count, dtype)
            everyone = [make_input(k, count, dtype) for k in range(n)]
            for rep in range(2):
                out = torch.full((n * count,), 7, dtype=dtype)
                pg.all_gather_single(out, mine)
                check_equal(out, torch.cat(everyone), f"all_gather {dtype} {count} {rep}")
                outs = [torch.full((count,), 7, dtype=dtype) for _ in range(n)]
                pg.all_gather(outs, mine)
                for k in range(n):
                    check_equal(outs[k], everyone[k], f"all_gather list {dtype} {count}")
                for root in range(n):
                    t = mine.clone()
                    pg.broadcast(t, root)
                    check_equal(t, everyone[root], f"broadcast {dtype} {count} root={root}")
            for op in (pyddp.ReduceOp.SUM, pyddp.ReduceOp.MAX):
                inputs = [make_input(k, n * count, dtype, op, salt=1) for k in range(n)]
                out = torch.full((count,), 7, dtype=dtype)
                pg.reduce_scatter_single(out, inputs[r], op)
                check_equal(out, reference_reduce(inputs, op)[r * count:(r + 1) * count],
                            f"reduce_scatter {dtype} {op} {count}")
            pg.barrier()


def test_all_gather_broadcast_reduce_scatter_barrier(ranks):
    ranks.run(_gathers)


def _strided_and_coalesced(ctx: RankContext) -> None:
    pg, n, r = ctx.groups["two_shot"], ctx.world_size, ctx.rank
    base = make_input(r, 2 * 333, torch.float32).view(333, 2)
    view = base[:, 1]  # not contiguous: through a copy and back
    expected = reference_reduce([make_input(k, 2 * 333, torch.float32).view(333, 2)[:, 1]
                                 for k in range(n)], pyddp.ReduceOp.SUM)
    pg.all_reduce(view)
    check_equal(view, expected, "a strided all_reduce")
    ts = [make_input(r, c, torch.float64, salt=c) for c in (5, 0, 17)]
    pg.all_reduce_coalesced(ts)
    for t, c in zip(ts, (5, 0, 17)):
        check_equal(t, reference_reduce([make_input(k, c, torch.float64, salt=c)
                                         for k in range(n)], pyddp.ReduceOp.SUM),
                    f"coalesced {c}")


def test_strided_and_coalesced_calls(ranks):
    ranks.run(_strided_and_coalesced)


def _mismatch(ctx: RankContext) -> str:
    pg = _group(ctx, f"mismatch{ctx.world_size}")
    try:
        with pytest.raises(dist.DistBackendError) as error:
            pg.all_reduce(torch.ones(10 if ctx.rank == 0 else 12))
        return str(error.value)
    finally:
        pg.shutdown()


def test_ranks_that_call_different_collectives_fail_on_every_rank(ranks):
    for r, message in enumerate(ranks.run(_mismatch)):
        assert "differs between ranks" in message, (r, message)
        assert "count" in message, (r, message)


def _late_peer(ctx: RankContext) -> tuple:
    pg = _group(ctx, "late", timeout=datetime.timedelta(seconds=2))
    if ctx.rank == 1:
        time.sleep(4)
        return None
    start = time.monotonic()
    with pytest.raises(dist.DistBackendError) as error:
        pg.all_reduce(torch.ones(4))
    return str(error.value), time.monotonic() - start


def test_a_peer_that_never_comes_is_named_at_the_timeout():
    pool = Ranks(2)
    try:
        (message, took), _ = pool.run(_late_peer)
        assert "timed out after 2000 ms waiting for rank 1" in message, message
        assert 1.5 < took < 30, took
    finally:
        pool.close()


def _dying_peer(ctx: RankContext, registered: bool) -> tuple:
    pg = _group(ctx, "dying")
    t = torch.ones(100_000)
    if registered:
        # in a registered buffer, above the one-shot sizes: read in place
        t = pyddp.empty(100_000)
        pg.register_buffer(t)
        pg.all_reduce(t)
        assert pg._engines["cpu"].registered_launches == 1
    if ctx.rank == ctx.world_size - 1:
        os._exit(3)
    start = time.monotonic()
    with pytest.raises(dist.DistBackendError) as error:
        pg.all_reduce(t)
    return str(error.value), time.monotonic() - start


@pytest.mark.parametrize("registered", [False, True], ids=["staged", "registered"])
@pytest.mark.parametrize("world", [2, 3])
def test_a_dead_peer_is_named_at_once(world, registered):
    pool = Ranks(world)
    try:
        results = pool.run_each([_dying_peer] * world, registered, allow_dead=True)
        assert isinstance(results[-1], Died) and results[-1].exitcode == 3
        dead = world - 1
        for message, took in results[:-1]:
            assert f"rank {dead} (pid {pool.pid(dead)}) exited" in message, message
            assert took < 15, took
    finally:
        pool.close()


def _destroyed_under_a_waiter(ctx: RankContext) -> str:
    pg = _group(ctx, "destroyed")
    if ctx.rank == 1:
        pg.all_reduce(torch.ones(4))  # a collective rank 0 is in too
        pyddp.destroy_process_group(pg)
        return ""
    pg.all_reduce(torch.ones(4))
    with pytest.raises(dist.DistBackendError) as error:
        pg.all_reduce(torch.ones(4))  # rank 1 never joins this one
    pg.shutdown()
    return str(error.value)


def test_a_peer_that_destroys_its_group_is_named_at_once():
    pool = Ranks(2)
    try:
        message, _ = pool.run(_destroyed_under_a_waiter)
        assert "rank 1 gave up while rank 0 waited for it" in message, message
        assert "rank 1 destroyed its process group" in message, message
    finally:
        pool.close()
