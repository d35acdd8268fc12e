"""Registered buffers of the fused collectives (ProcessGroup.register_buffer; the registered
launches of csrc/device/programs.h) on the emulated grid, between real processes: each rank
registers a buffer of pyddp.empty memory, its peers map it, and a collective on a tensor
that lies in it on every rank (at offsets that may differ) reads the peers' bytes where
they lie.

Against references computed from every rank's input: all_reduce (every op and dtype),
all_gather, reduce_scatter (apart and in place) and broadcast on 2, 3 and 4 ranks, at
offsets and counts that split unevenly over channels and ranks; which path ran, from the
engine's count of registered launches; a plain tensor beside them staged; the one-shot
sizes staged under "auto"; ranks that disagree on the window; registrations refused on
every rank alike (a tensor peers cannot map, sizes that differ, an overlap); the end of a
registration; an abort under a registered collective (a peer that dies in one:
test_fused_emulated.py).
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

import pyddp
from collective_cases import (BITWISE_OPS, INT_DTYPES, check_equal, dtype_op_pairs, make_input,
                              reference_reduce)
from harness import RankContext, Ranks, raises

pytestmark = pytest.mark.multiprocess

TIMEOUT = datetime.timedelta(seconds=60)
CHUNK = 256  # the emulated grid's chunks (slot_bytes): a few channels for small tensors
COUNTS = [1, 3, 61, 1000, 5000]
# Bytes of each rank's registered buffer: room for the largest case at an offset.
BUFFER_BYTES = 1 << 20
# The fused all-reduce's one-shot window (kFusedOneShotMaxBytes in
# csrc/algorithms/select.h): at most this many bytes per rank stage under "auto".
FUSED_ONE_SHOT_MAX = 256 * 1024


def _group(ctx: RankContext, name: str, algo=pyddp.Algo.TWO_SHOT, timeout=TIMEOUT):
    options = pyddp.GroupOptions()
    options.slot_bytes = CHUNK
    options.algo = algo
    return pyddp.create_group("emulated", store=dist.FileStore(ctx.store_path(name),
                                                               ctx.world_size),
                              rank=ctx.rank, world_size=ctx.world_size, timeout=timeout,
                              options=options)


def _engine(pg) -> "pyddp._C.FusedEngine":
    engine = pg._engines["cpu"]
    assert isinstance(engine, pyddp._C.FusedEngine)
    return engine


def _setup(ctx: RankContext) -> None:
    pg = _group(ctx, "registered")
    buffer = pyddp.empty(BUFFER_BYTES, dtype=torch.uint8)
    pg.register_buffer(buffer)
    ctx.groups["registered"] = pg
    ctx.groups["buffer"] = buffer


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda n: f"world{n}")
def ranks(request):
    pool = Ranks(request.param, setup=_setup)
    yield pool
    pool.close()


def _window(ctx: RankContext, offset: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """`count` elements of the registered buffer from byte `offset`."""
    size = torch.tensor([], dtype=dtype).element_size()
    return ctx.groups["buffer"][offset:offset + count * size].view(dtype)


class Launches:
    """Counts the engine's registered launches over a block of calls."""

    def __init__(self, pg) -> None:
        self._engine = _engine(pg)
        self._start = self._engine.registered_launches

    @property
    def made(self) -> int:
        return self._engine.registered_launches - self._start


def _all_reduce(ctx: RankContext) -> None:
    pg, n, r = ctx.groups["registered"], ctx.world_size, ctx.rank
    cases = list(dtype_op_pairs()) + [(d, op) for d in INT_DTYPES for op in BITWISE_OPS]
    launches = Launches(pg)
    calls = 0
    for dtype, op in cases:
        for count in COUNTS:
            expected = reference_reduce([make_input(k, count, dtype, op) for k in range(n)], op)
            # the same offset on every rank, and one that differs by rank
            for offset in (0, 4096 + 16 * (r + 1)):
                t = _window(ctx, offset, count, dtype)
                t.copy_(make_input(r, count, dtype, op))
                pg.all_reduce(t, op)
                calls += 1
                check_equal(t, expected, f"registered all_reduce {dtype} {op} count={count} "
                                         f"offset={offset}")
    assert launches.made == calls, (launches.made, calls)
    # a plain tensor in the same group stages, with the same result
    plain = make_input(r, 1000, torch.float32)
    pg.all_reduce(plain)
    check_equal(plain, reference_reduce([make_input(k, 1000, torch.float32)
                                         for k in range(n)], pyddp.ReduceOp.SUM), "plain")
    assert launches.made == calls


def test_all_reduce_reads_registered_buffers_in_place(ranks):
    ranks.run(_all_reduce)


def _gathers(ctx: RankContext) -> None:
    pg, n, r = ctx.groups["registered"], ctx.world_size, ctx.rank
    launches = Launches(pg)
    calls = 0
    for dtype in (torch.float32, torch.bfloat16, torch.int8, torch.int64):
        size = torch.tensor([], dtype=dtype).element_size()
        for count in COUNTS:
            everyone = [make_input(k, count, dtype) for k in range(n)]
            mine = _window(ctx, 128, count, dtype)
            mine.copy_(everyone[r])
            # all_gather: the registered input into a plain output
            out = torch.full((n * count,), 7, dtype=dtype)
            pg.all_gather_single(out, mine)
            check_equal(out, torch.cat(everyone), f"all_gather {dtype} {count}")
            # ... and in place: the input is this rank's block of a registered output
            whole = _window(ctx, 0, n * count, dtype)
            whole.fill_(7)
            whole[r * count:(r + 1) * count].copy_(everyone[r])
            pg.all_gather_single(whole, whole[r * count:(r + 1) * count])
            check_equal(whole, torch.cat(everyone), f"all_gather in place {dtype} {count}")
            # broadcast from every root
            for root in range(n):
                t = _window(ctx, 64, count, dtype)
                t.copy_(everyone[r])
                pg.broadcast(t, root)
                check_equal(t, everyone[root], f"broadcast {dtype} {count} root={root}")
            calls += 2 + n
            for op in (pyddp.ReduceOp.SUM, pyddp.ReduceOp.MAX):
                inputs = [make_input(k, n * count, dtype, op, salt=1) for k in range(n)]
                expected = reference_reduce(inputs, op)[r * count:(r + 1) * count]
                # reduce_scatter: a registered input into a plain output ...
                source = _window(ctx, 0, n * count, dtype)
                source.copy_(inputs[r])
                out = torch.full((count,), 7, dtype=dtype)
                pg.reduce_scatter_single(out, source, op)
                check_equal(out, expected, f"reduce_scatter {dtype} {op} {count}")
                # ... and into its own block of the input
                source.copy_(inputs[r])
                own = source[r * count:(r + 1) * count]
                pg.reduce_scatter_single(own, source, op)
                check_equal(own, expected, f"reduce_scatter in place {dtype} {op} {count}")
                calls += 2
            assert size * n * count <= BUFFER_BYTES
    assert launches.made == calls, (launches.made, calls)


def test_all_gather_reduce_scatter_and_broadcast_read_in_place(ranks):
    ranks.run(_gathers)


def _auto_sizes(ctx: RankContext) -> None:
    # "auto": all_reduces up to the one-shot window stage (one barrier where in
    # place takes three), larger ones read in place
    pg = _group(ctx, "auto", algo=pyddp.Algo.AUTO)
    buffer = pyddp.empty(2 * FUSED_ONE_SHOT_MAX, dtype=torch.uint8)
    pg.register_buffer(buffer)
    n, r = ctx.world_size, ctx.rank
    made = []
    for count in (FUSED_ONE_SHOT_MAX // 4, FUSED_ONE_SHOT_MAX // 4 + 1):
        launches = Launches(pg)
        t = buffer[:count * 4].view(torch.float32)
        t.copy_(make_input(r, count, torch.float32))
        pg.all_reduce(t)
        check_equal(t, reference_reduce([make_input(k, count, torch.float32) for k in range(n)],
                                        pyddp.ReduceOp.SUM), f"auto all_reduce {count}")
        made.append(launches.made)
    pg.shutdown()
    assert made == [0, 1], made


def test_auto_stages_the_one_shot_sizes_and_reads_larger_ones_in_place():
    pool = Ranks(2)
    try:
        pool.run(_auto_sizes)
    finally:
        pool.close()


def _disagreeing_windows(ctx: RankContext) -> str:
    # rank 0's tensor lies in the registered buffer, rank 1's does not
    pg = _group(ctx, "disagree")
    buffer = pyddp.empty(4096, dtype=torch.uint8)
    pg.register_buffer(buffer)
    t = buffer[:400].view(torch.float32) if ctx.rank == 0 else torch.ones(100)
    try:
        with pytest.raises(dist.DistBackendError) as error:
            pg.all_reduce(t)
        return str(error.value)
    finally:
        pg.shutdown()


def test_ranks_whose_tensors_lie_in_different_windows_fail_naming_it():
    pool = Ranks(2)
    try:
        for r, message in enumerate(pool.run(_disagreeing_windows)):
            assert "differs between ranks" in message, (r, message)
            assert "registered=buffer 1" in message, (r, message)
    finally:
        pool.close()


def _refusals(ctx: RankContext) -> list:
    pg = _group(ctx, "refusals")
    seen = []
    # a tensor peers cannot map: not pyddp.empty memory, on rank 1 only
    mine = torch.zeros(256) if ctx.rank == 1 else pyddp.empty(256)
    with pytest.raises(dist.DistBackendError) as error:
        pg.register_buffer(mine)
    seen.append(str(error.value))
    # sizes that differ
    with pytest.raises(ValueError) as error:
        pg.register_buffer(pyddp.empty(256 + ctx.rank))
    seen.append(str(error.value))
    # an overlap with a registered buffer, on rank 0 only
    buffer = pyddp.empty(1024, dtype=torch.uint8)
    pg.register_buffer(buffer)
    overlap = buffer[512:] if ctx.rank == 0 else pyddp.empty(512, dtype=torch.uint8)
    with pytest.raises(dist.DistBackendError) as error:
        pg.register_buffer(overlap)
    seen.append(str(error.value))
    # the group still works, and registers after the refusals
    other = pyddp.empty(64)
    pg.register_buffer(other)
    other.fill_(ctx.rank + 1)
    pg.all_gather_single(out := torch.zeros(64 * ctx.world_size), other)
    check_equal(out, torch.cat([torch.full((64,), k + 1.0) for k in range(ctx.world_size)]),
                "after refusals")
    shm = pyddp.create_group("shm", store=dist.FileStore(ctx.store_path("shm"),
                                                          ctx.world_size),
                             rank=ctx.rank, world_size=ctx.world_size)
    assert not shm.can_register("cpu")
    raises(TypeError, "reads no registered buffers", shm.register_buffer, other)
    shm.shutdown()
    pg.shutdown()
    return seen


def test_a_registration_one_rank_cannot_make_fails_every_rank_alike():
    pool = Ranks(2)
    try:
        for r, (unmappable, sizes, overlap) in enumerate(pool.run(_refusals)):
            assert "rank 1 could not register its tensor" in unmappable, (r, unmappable)
            assert "pyddp.empty" in unmappable, (r, unmappable)
            assert "rank 0 registered 1024 bytes, rank 1 1028" in sizes or \
                "registered 1028 bytes, rank 0 1024" in sizes, (r, sizes)
            assert "rank 0 could not register its tensor" in overlap, (r, overlap)
            assert "overlaps registered buffer 3" in overlap, (r, overlap)
    finally:
        pool.close()


def _deregistered(ctx: RankContext) -> None:
    pg = _group(ctx, "deregistered")
    n, r = ctx.world_size, ctx.rank
    assert pg.can_register("cpu")
    buffer = pyddp.empty(4000)
    expected = reference_reduce([make_input(k, 4000, torch.float32) for k in range(n)],
                                pyddp.ReduceOp.SUM)
    pg.register_buffer(buffer)
    for registered in (True, False):
        launches = Launches(pg)
        buffer.copy_(make_input(r, 4000, torch.float32))
        pg.all_reduce(buffer)
        check_equal(buffer, expected, f"registered={registered}")
        assert launches.made == int(registered)
        if registered:
            pg.deregister_buffer(buffer)
    raises(ValueError, "not registered with this group", pg.deregister_buffer, buffer)
    pg.shutdown()


def test_a_buffer_deregistered_is_staged_again():
    pool = Ranks(3)
    try:
        pool.run(_deregistered)
    finally:
        pool.close()


def _aborted_in_place(ctx: RankContext) -> str:
    pg = _group(ctx, "aborted")
    buffer = pyddp.empty(100_000)
    pg.register_buffer(buffer)
    if ctx.rank == 1:
        pg.abort()
        return ""
    with pytest.raises(dist.DistBackendError) as error:
        pg.all_reduce(buffer)
    pg.shutdown()
    return str(error.value)


def test_an_abort_ends_a_peer_s_registered_collective():
    pool = Ranks(2)
    try:
        message, _ = pool.run(_aborted_in_place)
        assert "rank 1 gave up while rank 0 waited for it" in message, message
        assert "aborted" in message, message
    finally:
        pool.close()
