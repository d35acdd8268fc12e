"""Cross-memory attach: all_gather and broadcast read a peer's plain tensor
through the kernel (process_vm_readv), one copy instead of two.

Results are checked against single-process references (collective_cases)
here, and on every dtype, size and world size by the ``cma`` group of
test_collectives. Which path a collective took is seen through the number of
such reads this process has made (``_testing.process_reads``).
"""

from __future__ import annotations

import datetime
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

import pyddp
from collective_cases import ReduceOp, check_equal, make_input, reference_reduce
from harness import Died, RankContext, Ranks, pyddp_segments, raises
from pyddp._C import _testing
from test_registered import _as_nobody_rank_1_closed, registered_copy

MIN_BYTES = 64 * 1024
COUNT = MIN_BYTES // 4  # float32 elements per rank: exactly cma_min_bytes


def _group(ctx: RankContext, name: str, **opts) -> pyddp.ProcessGroup:
    options = pyddp.RingOptions()
    for key, value in opts.items():
        setattr(options, key, value)
    store = dist.FileStore(ctx.store_path(name), ctx.world_size)
    return pyddp.new_group("shm", store=store, rank=ctx.rank, world_size=ctx.world_size,
                           timeout=datetime.timedelta(seconds=60), options=options)


def _setup(ctx: RankContext) -> None:
    ctx.groups["cma"] = _group(ctx, "cma", cma_min_bytes=MIN_BYTES)
    ctx.groups["default"] = _group(ctx, "default")
    ctx.groups["ring"] = _group(ctx, "ring", algo=pyddp.Algo.RING, cma_min_bytes=MIN_BYTES)


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"world{n}")
def ranks(request):
    pool = Ranks(request.param, setup=_setup)
    yield pool
    pool.close()


def _reads(ctx: RankContext, count: int, registered: bool = False, group: str = "cma") -> tuple:
    """Kernel reads made by an all_gather, a broadcast from rank 1 and an
    all_reduce of `count` float32 per rank, each checked."""
    pg, n = ctx.groups[group], ctx.world_size
    own = registered_copy if registered else torch.Tensor.clone
    made = []
    inputs = [make_input(r, count, torch.float32) for r in range(n)]
    before = _testing.process_reads()
    out = torch.full((n * count,), 5.0)
    pg.all_gather_single(out, own(inputs[ctx.rank]))
    check_equal(out, torch.cat(inputs), f"all_gather count={count}")
    made.append(_testing.process_reads() - before)
    before = _testing.process_reads()
    t = own(make_input(ctx.rank, count, torch.float32, salt=1))
    pg.broadcast(t, 1)
    check_equal(t, make_input(1, count, torch.float32, salt=1), f"broadcast count={count}")
    made.append(_testing.process_reads() - before)
    before = _testing.process_reads()
    t = own(inputs[ctx.rank])
    pg.all_reduce(t)
    check_equal(t, reference_reduce(inputs, ReduceOp.SUM), f"all_reduce count={count}")
    made.append(_testing.process_reads() - before)
    return tuple(made)


def test_all_gather_and_broadcast_from_cma_min_bytes_read_each_peer_through_the_kernel(ranks):
    results = ranks.run(_reads, COUNT)
    n = len(results)
    # all_gather: one read per peer; broadcast: one per rank but the root;
    # all_reduce: none (a reduction reads mapped tensors only).
    assert results == [(n - 1, 0 if r == 1 else 1, 0) for r in range(n)]


def test_smaller_messages_take_the_staged_path(ranks):
    assert set(ranks.run(_reads, COUNT - 1)) == {(0, 0, 0)}


def test_registered_tensors_are_mapped_not_read_through_the_kernel(ranks):
    assert set(ranks.run(_reads, COUNT, True)) == {(0, 0, 0)}


@pytest.mark.parametrize("group", ["default", "ring"])
def test_groups_that_do_not_read_through_the_kernel_run_as_before(ranks, group):
    assert set(ranks.run(_reads, COUNT, False, group)) == {(0, 0, 0)}


def _refusals(ctx: RankContext) -> tuple:
    return tuple(ctx.groups[g]._cpu_engine.process_refusal for g in ("cma", "default", "ring"))


def test_the_groups_say_why_they_do_not_read_through_the_kernel(ranks):
    # The kernel allows it between processes of one user that may trace
    # each other (no Yama ptrace_scope above 0 on this machine and CI's).
    for cma, default, ring in ranks.run(_refusals):
        assert cma == ""
        assert default == "cma_min_bytes (PYDDP_CMA_MIN_BYTES) is 0"
        assert ring == "algo is ring, not auto"


def _uneven_minimum(ctx: RankContext) -> str:
    return raises(ValueError, "cma_min_bytes", _group, ctx, "uneven",
                  cma_min_bytes=MIN_BYTES * (ctx.rank + 1))


def test_ranks_with_different_cma_min_bytes_fail_naming_it(ranks):
    for said in ranks.run(_uneven_minimum):
        assert "PYDDP_CMA_MIN_BYTES alike on all ranks" in said


def _one_rank_closed(ctx: RankContext) -> tuple:
    ctx.groups["cma"] = _group(ctx, "cma", cma_min_bytes=1)
    return ctx.groups["cma"]._cpu_engine.process_refusal, _reads(ctx, COUNT)


@pytest.mark.skipif(os.geteuid() != 0, reason="making ranks of another user needs root")
def test_a_rank_whose_peer_cannot_be_read_makes_the_group_read_through_slots():
    # Rank 1 is not dumpable: the kernel refuses rank 0's reads of it (as it
    # refuses ptrace), and both ranks learn it while connecting.
    pool = Ranks(2, setup=_as_nobody_rank_1_closed)
    try:
        (said0, reads0), (said1, reads1) = pool.run(_one_rank_closed)
    finally:
        pool.close()
    assert reads0 == reads1 == (0, 0, 0)
    assert said0.startswith("process_vm_readv of rank 1 (pid ") and \
        "Operation not permitted" in said0, said0
    assert said1 == "rank 0 cannot read every peer's memory through the kernel", said1


# --- a peer killed before its reader read its tensor -----------------------------


def _dead(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def _reader(ctx: RankContext, root_pid: int) -> tuple:
    pg = _group(ctx, "killed", cma_min_bytes=1)
    deadline = time.monotonic() + 30
    while not _dead(root_pid):
        assert time.monotonic() < deadline, "rank 1 did not die"
        time.sleep(0.01)
    before = _testing.process_reads()
    said = raises(dist.DistBackendError, "exited", pg.broadcast, torch.zeros(COUNT), 1)
    return said, _testing.process_reads() - before


def _root_killed_in_its_broadcast(ctx: RankContext, root_pid: int) -> None:
    pg = _group(ctx, "killed", cma_min_bytes=1)
    pg.broadcast(torch.ones(COUNT), 1, async_op=True)
    # The broadcast arrives (stages where its tensor lies) within
    # milliseconds, then waits for rank 0, which arrives only once this rank
    # is dead: a second leaves ample room.
    time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_root_killed_before_its_tensor_is_read_is_named_and_nothing_is_left():
    pool = Ranks(2)
    try:
        pid = pool.pid(1)
        (said, reads), died = pool.run_each([_reader, _root_killed_in_its_broadcast], pid,
                                            allow_dead=True, timeout=60)
    finally:
        pool.close()
    assert isinstance(died, Died) and died.exitcode == -signal.SIGKILL, died
    assert f"rank 1 (pid {pid}) exited while rank 0 read its tensor in broadcast #" in said, said
    assert reads == 0
    assert pyddp_segments() == []
