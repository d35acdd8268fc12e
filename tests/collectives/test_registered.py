"""Registered memory (pyddp.empty): tensors the peers read where they lie.

Results are checked against single-process references (collective_cases);
which path a collective took is seen through the number of peer tensors
this process has mapped (``_testing.registered_maps_made``): the registered
path maps each peer tensor it reads the first time, the others map none.
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import os

import pytest
import torch
import torch.distributed as dist

import pyddp
from collective_cases import ReduceOp, check_equal, make_input, reference_reduce
from harness import RankContext, Ranks
from pyddp._C import _testing

# Inside the sizes that read registered tensors (common/config.h: 64 KiB to
# 8 MiB per rank, all_reduce from 512 KiB, reduce_scatter from 4 KiB per
# block), uneven over 3 ranks.
COUNT = 40_001                # all_gather, broadcast, reduce_scatter: 160 KB of float32
ALL_REDUCE_BYTES = 600_000    # all_reduce, in every dtype
MAPS_PER_PEER = 64


def all_reduce_count(dtype: torch.dtype) -> int:
    return ALL_REDUCE_BYTES // dtype.itemsize + 1


def maps_made() -> int:
    return _testing.registered_maps_made()


def _group(ctx: RankContext, name: str, timeout_s: float = 60, **opts) -> pyddp.ProcessGroup:
    options = pyddp.GroupOptions()
    for key, value in opts.items():
        setattr(options, key, value)
    store = dist.FileStore(ctx.store_path(name), ctx.world_size)
    return pyddp.new_group("shm", store=store, rank=ctx.rank, world_size=ctx.world_size,
                           timeout=datetime.timedelta(seconds=timeout_s), options=options)


def _setup(ctx: RankContext) -> None:
    # Plain tensors are read through the slots here, never through the
    # kernel: where the chooser took the kernel, a collective with some
    # tensors registered would map those and read the others through it
    # (test_cma.py), and the counts below would follow its choice.
    ctx.groups["auto"] = _group(ctx, "auto", cma=pyddp.CmaReads.NEVER)
    # Forced algorithms run as forced, and a group without staging buffers
    # has no room to say where its tensors lie: neither reads in place.
    ctx.groups["ring"] = _group(ctx, "ring", algo=pyddp.Algo.RING)
    ctx.groups["no_staging"] = _group(ctx, "no_staging", direct_max_bytes=0,
                                      two_shot_max_bytes=0)


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"world{n}")
def ranks(request):
    pool = Ranks(request.param, setup=_setup)
    yield pool
    pool.close()


def registered_copy(t: torch.Tensor) -> torch.Tensor:
    out = pyddp.empty(t.shape, dtype=t.dtype)
    out.copy_(t)
    return out


def test_empty_makes_zeroed_registered_tensors():
    t = pyddp.empty(3, 5, dtype=torch.float64)
    assert t.shape == (3, 5) and t.dtype == torch.float64 and t.device.type == "cpu"
    assert torch.equal(t, torch.zeros(3, 5, dtype=torch.float64))
    assert pyddp.is_registered(t)
    assert pyddp.is_registered(t[1:])                # contiguous view inside it
    assert not pyddp.is_registered(t[:, 1])          # not contiguous
    assert not pyddp.is_registered(torch.empty(3, 5))
    assert pyddp.empty((2, 2)).dtype == torch.get_default_dtype()
    assert pyddp.empty(0).numel() == 0
    with pytest.raises(ValueError, match="negative size"):
        pyddp.empty(2, -1)
    with pytest.raises(TypeError, match="size must be ints"):
        pyddp.empty(2.0)
    # Memory freed with its tensor is reusable: many allocations do not pile up.
    for i in range(200):
        u = pyddp.empty(1 << 16, dtype=torch.uint8)
        u.fill_(i % 256)
        assert int(u[-1]) == i % 256


def _all_reduce(ctx, dtype, op, registered_on, count=None, group_name="auto"):
    n, group = ctx.world_size, ctx.groups[group_name]
    count = count or all_reduce_count(dtype)
    inputs = [make_input(r, count, dtype, op) for r in range(n)]
    mine = inputs[ctx.rank].clone()
    if ctx.rank in registered_on:
        mine = registered_copy(mine)
    before = maps_made()
    pyddp.all_reduce(mine, op, group=group)
    check_equal(mine, reference_reduce(inputs, op), f"all_reduce {dtype} {op}")
    first = maps_made() - before
    # The same tensors again: the peers' stay mapped.
    mine.copy_(inputs[ctx.rank])
    pyddp.all_reduce(mine, op, group=group)
    check_equal(mine, reference_reduce(inputs, op), f"all_reduce {dtype} {op} again")
    return first, maps_made() - before - first


@pytest.mark.multiprocess
@pytest.mark.parametrize("dtype,op", [(torch.float32, ReduceOp.SUM),
                                      (torch.float64, ReduceOp.AVG),
                                      (torch.bfloat16, ReduceOp.SUM),
                                      (torch.float16, ReduceOp.MAX),
                                      (torch.int32, ReduceOp.PRODUCT),
                                      (torch.int64, ReduceOp.MIN),
                                      (torch.int8, ReduceOp.BXOR),
                                      (torch.int64, ReduceOp.BOR)])
def test_all_reduce_reads_registered_tensors_in_place(ranks, dtype, op):
    everyone = range(ranks.world_size)
    results = ranks.run(_all_reduce, dtype, op, everyone)
    # each rank mapped every peer's tensor once, and kept it
    assert results == [(ranks.world_size - 1, 0)] * ranks.world_size


@pytest.mark.multiprocess
def test_all_reduce_with_some_tensors_not_registered_takes_the_staged_path(ranks):
    results = ranks.run(_all_reduce, torch.float32, ReduceOp.SUM, [0])
    assert results == [(0, 0)] * ranks.world_size


@pytest.mark.multiprocess
def test_sizes_outside_the_window_take_the_staged_path(ranks):
    n, everyone = ranks.world_size, range(ranks.world_size)
    # 400 KB: below all_reduce's 512 KiB, above the others' 64 KiB
    assert ranks.run(_all_reduce, torch.float32, ReduceOp.SUM, everyone, 100_000) == [(0, 0)] * n
    # 9 MiB: above 8 MiB
    assert ranks.run(_broadcast, 0, everyone, 9 * 1024 * 1024 // 8) == [0] * n
    # reduce_scatter: 4,000-byte blocks, below its 4 KiB
    assert ranks.run(_reduce_scatter, everyone, None, 1000) == [0] * n


def _all_gather(ctx, registered_on, form):
    n, group = ctx.world_size, ctx.groups["auto"]
    inputs = [make_input(r, COUNT, torch.float32, salt=7) for r in range(n)]
    expected = torch.cat(inputs)
    registered = ctx.rank in registered_on
    before = maps_made()
    if form == "in_place":
        out = pyddp.empty(n * COUNT, dtype=torch.float32) if registered else torch.zeros(n * COUNT)
        block = out[ctx.rank * COUNT:(ctx.rank + 1) * COUNT]
        block.copy_(inputs[ctx.rank])
        pyddp.all_gather_into_tensor(out, block, group=group)
    else:
        mine = registered_copy(inputs[ctx.rank]) if registered else inputs[ctx.rank].clone()
        if form == "single":
            out = torch.full((n * COUNT,), -1.0)
            pyddp.all_gather_single(out, mine, group=group)
        else:
            outs = [torch.full((COUNT,), -1.0) for _ in range(n)]
            pyddp.all_gather(outs, mine, group=group)
            out = torch.cat(outs)
        check_equal(mine, inputs[ctx.rank], "all_gather's input, unchanged")
    check_equal(out, expected, f"all_gather ({form})")
    return maps_made() - before


@pytest.mark.multiprocess
@pytest.mark.parametrize("form", ["single", "list", "in_place"])
def test_all_gather_reads_registered_inputs(ranks, form):
    n = ranks.world_size
    assert ranks.run(_all_gather, range(n), form) == [n - 1] * n
    # one rank's input not registered: every rank takes the staged path
    assert ranks.run(_all_gather, [1], form) == [0] * n


def _reduce_scatter(ctx, registered_on, out_at=None, count=COUNT):
    # out_at: the output is block `out_at` of the rank's own input.
    n, r, group = ctx.world_size, ctx.rank, ctx.groups["auto"]
    inputs = [make_input(k, n * count, torch.float32, salt=5) for k in range(n)]
    expected = reference_reduce(inputs, ReduceOp.SUM)[r * count:(r + 1) * count]
    mine = registered_copy(inputs[r]) if r in registered_on else inputs[r].clone()
    if out_at is None:
        out = torch.full((count,), -1.0)
    else:
        out = mine[out_at * count:(out_at + 1) * count]
    before = maps_made()
    pyddp.reduce_scatter_single(out, mine, group=group)
    check_equal(out, expected, f"reduce_scatter (output at {out_at})")
    if out_at is None:
        check_equal(mine, inputs[r], "reduce_scatter's input, unchanged")
    return maps_made() - before


@pytest.mark.multiprocess
def test_reduce_scatter_reads_registered_inputs(ranks):
    n = ranks.world_size
    assert ranks.run(_reduce_scatter, range(n)) == [n - 1] * n
    # one rank's input not registered: every rank takes the staged path
    assert ranks.run(_reduce_scatter, [n - 1]) == [0] * n
    # in place: each rank's output is its own block of its input, which no peer reads
    assert ranks.run(_reduce_scatter_into_own_block) == [n - 1] * n


def _reduce_scatter_into_own_block(ctx):
    return _reduce_scatter(ctx, range(ctx.world_size), ctx.rank)


def _reduce_scatter_into_block_zero(ctx):
    return _reduce_scatter(ctx, range(ctx.world_size), 0)


@pytest.mark.multiprocess
def test_an_output_that_overlaps_a_peers_input_block_is_not_written_in_place(ranks):
    # Block 0 of each rank's input is what rank 0 reads from it.
    assert ranks.run(_reduce_scatter_into_block_zero) == [0] * ranks.world_size


def _broadcast(ctx, root, registered_on, count=COUNT, group_name="auto"):
    group = ctx.groups[group_name]
    data = make_input(root, count, torch.float64, salt=3)
    t = torch.zeros(count, dtype=torch.float64)
    if ctx.rank in registered_on:
        t = pyddp.empty(count, dtype=torch.float64)
    if ctx.rank == root:
        t.copy_(data)
    before = maps_made()
    pyddp.broadcast(t, root, group=group)
    check_equal(t, data, f"broadcast from {root}")
    return maps_made() - before


@pytest.mark.multiprocess
def test_broadcast_reads_the_registered_root(ranks):
    n = ranks.world_size
    for root in range(n):
        # only the root's tensor is read: the others' need not be registered
        maps = ranks.run(_broadcast, root, [root])
        assert maps == [0 if r == root else 1 for r in range(n)]
        assert ranks.run(_broadcast, root, [r for r in range(n) if r != root]) == [0] * n
        assert ranks.run(_broadcast, root, range(n)) == [0 if r == root else 1 for r in range(n)]


@pytest.mark.multiprocess
@pytest.mark.parametrize("group_name", ["ring", "no_staging"])
def test_groups_that_cannot_or_must_not_read_in_place_run_as_before(ranks, group_name):
    n, everyone = ranks.world_size, range(ranks.world_size)
    assert ranks.run(_all_reduce, torch.float32, ReduceOp.SUM, everyone, None,
                     group_name) == [(0, 0)] * n
    assert ranks.run(_broadcast, 0, everyone, COUNT, group_name) == [0] * n


def _all_gather_from_block_zero(ctx):
    # Every rank's input is block 0 of its output, a peer's block but on rank 0.
    n = ctx.world_size
    out = pyddp.empty(n * COUNT, dtype=torch.float32)
    out.copy_(torch.cat([make_input(ctx.rank, COUNT, torch.float32, salt=b) for b in range(n)]))
    before = maps_made()
    pyddp.all_gather_into_tensor(out, out[:COUNT], group=ctx.groups["auto"])
    expected = torch.cat([make_input(r, COUNT, torch.float32, salt=0) for r in range(n)])
    check_equal(out, expected, "all_gather of an input that is a peer's block")
    return maps_made() - before


@pytest.mark.multiprocess
def test_an_input_that_overlaps_a_peers_output_block_is_not_read_in_place(ranks):
    assert ranks.run(_all_gather_from_block_zero) == [0] * ranks.world_size


def _disagree(ctx):
    # Rank 0 would read in place, the others run the ring: the descriptors differ.
    algo = pyddp.Algo.AUTO if ctx.rank == 0 else pyddp.Algo.RING
    group = _group(ctx, f"disagree{ctx.world_size}", algo=algo)
    t = registered_copy(make_input(ctx.rank, all_reduce_count(torch.float32), torch.float32))
    try:
        with pytest.raises(dist.DistBackendError, match="registered"):
            pyddp.all_reduce(t, group=group)
    finally:
        pyddp.destroy_process_group(group)


@pytest.mark.multiprocess
def test_ranks_that_would_choose_differently_fail_naming_it(ranks):
    ranks.run(_disagree)


def _fresh_tensors(ctx, rounds):
    group = ctx.groups["auto"]
    before = maps_made()
    for i in range(rounds):
        count = all_reduce_count(torch.float32)
        mine = registered_copy(make_input(ctx.rank, count, torch.float32, salt=i))
        pyddp.all_reduce(mine, group=group)
        expected = reference_reduce([make_input(r, count, torch.float32, salt=i)
                                     for r in range(ctx.world_size)], ReduceOp.SUM)
        check_equal(mine, expected, f"all_reduce of fresh tensors, round {i}")
    return maps_made() - before


@pytest.mark.multiprocess
def test_fresh_tensors_every_call_are_each_mapped_and_the_oldest_unmapped(ranks):
    # More tensors than a peer keeps mapped: each is new to the peers, and
    # pushing out the oldest mapping never touches one still read.
    rounds = MAPS_PER_PEER + 6
    n = ranks.world_size
    assert ranks.run(_fresh_tensors, rounds) == [rounds * (n - 1)] * n


NOBODY = 65534
PR_SET_DUMPABLE = 4


def _as_nobody_rank_1_closed(ctx: RankContext) -> None:
    # A process whose user changes is made non-dumpable (prctl(2)), which
    # closes its /proc/<pid>/fd to the other processes of that user. Rank 0
    # opens itself again; rank 1 stays closed: rank 1 can map rank 0's
    # memory, rank 0 cannot map rank 1's.
    os.chmod(ctx.tmpdir, 0o777)  # the stores' files
    os.setgroups([])
    os.setresgid(NOBODY, NOBODY, NOBODY)
    os.setresuid(NOBODY, NOBODY, NOBODY)
    if ctx.rank == 0:
        assert ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 1, 0, 0, 0) == 0


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _one_rank_closed(ctx):
    logger = logging.getLogger("pyddp")
    records, level = _Records(), logger.level
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    try:
        ctx.groups["auto"] = _group(ctx, "auto")
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
    said = [m for m in records.messages if "registered tensors" in m]
    n, everyone = ctx.world_size, range(ctx.world_size)
    # Both ranks read through staging, with right results, mapping nothing.
    maps = [_all_reduce(ctx, torch.float32, ReduceOp.SUM, everyone),
            _all_gather(ctx, everyone, "single"), _broadcast(ctx, 1, everyone)]
    return said, maps


@pytest.mark.multiprocess
@pytest.mark.skipif(os.geteuid() != 0, reason="making ranks of another user needs root")
def test_a_rank_that_cannot_map_a_peers_memory_makes_the_group_read_through_staging():
    pool = Ranks(2, setup=_as_nobody_rank_1_closed)
    try:
        (said0, maps0), (said1, maps1) = pool.run(_one_rank_closed)
    finally:
        pool.close()
    assert maps0 == maps1 == [(0, 0), 0, 0]
    assert len(said0) == len(said1) == 1
    assert "read through staging: cannot open rank 1's registered memory" in said0[0]
    assert "Permission denied" in said0[0]
    assert "read through staging: rank 0 cannot map every peer's registered memory" in said1[0]


def _says(ctx):
    return ctx.groups["auto"]._cpu_engine.registered_refusal, \
        ctx.groups["ring"]._cpu_engine.registered_refusal, \
        ctx.groups["no_staging"]._cpu_engine.registered_refusal


@pytest.mark.multiprocess
def test_the_groups_say_why_they_do_not_read_in_place(ranks):
    for auto, ring, no_staging in ranks.run(_says):
        assert auto == ""
        assert ring == "algo is ring, not auto"
        assert "no staging buffers" in no_staging
