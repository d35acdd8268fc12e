"""Surviving lost ranks (pyddp/survival.py): the survivors agree on who is alive, shrink to
a group of themselves that computes what a single process computes over their inputs,
and admit a new process; a rank that dies during the agreement or the shrink is left
out too, and a rank that is only stopped for less than the timeout is not.
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
from pyddp import _launch
from pyddp.bench.soak import read_resources
from harness import Died, RankContext, Ranks
from hosts import HostRanks
from pyddp import survival
from shm_groups import named_group

pytestmark = pytest.mark.multiprocess

TIMEOUT = datetime.timedelta(seconds=30)
# Bound on the survivors' wait for a kill to be noticed and acted on: far below TIMEOUT,
# so a survivor that learnt of the loss only at the timeout fails it.
BOUND_S = 10.0


def _total(group: pyddp.ProcessGroup, value: float) -> float:
    t = torch.full((1000,), value)
    group.all_reduce(t)
    assert torch.equal(t, torch.full_like(t, t[0].item())), t
    return t[0].item()


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _fails(pg: pyddp.ProcessGroup) -> str:
    """The message of the all_reduce that fails for the ranks that died."""
    try:
        pg.all_reduce(torch.ones(10))
    except dist.DistBackendError as error:
        return str(error)
    raise AssertionError("the collective did not fail")


def _survivors(fn, world: int, dead: tuple, *args) -> list:
    """What ``fn`` returned on each rank but ``dead``, which must have died."""
    pool = Ranks(world)
    try:
        results = pool.run_each([fn] * world, *args, allow_dead=True, timeout=120)
        assert all(isinstance(results[r], Died) for r in dead), results
        return [result for r, result in enumerate(results) if r not in dead]
    finally:
        pool.close()


# Large enough that a rank killed just after it started its part dies inside it.
BIG = 1 << 22


def _victim(ctx: RankContext, name: str, during: str) -> None:
    pg = named_group(ctx, name, timeout=TIMEOUT)
    _total(pg, 1.0)
    if during == "barrier":
        pg.barrier()
        _kill_self()  # its peers wait in the next barrier
    pg.all_reduce(torch.ones(BIG))
    pg.all_reduce(torch.ones(BIG), async_op=True)
    _kill_self()  # inside its second all_reduce, or before it began its part


def _survivor(ctx: RankContext, name: str, during: str) -> tuple:
    before = read_resources()
    pg = named_group(ctx, name, timeout=TIMEOUT)
    _total(pg, 1.0)
    start = time.monotonic()
    try:
        for _ in range(3):
            pg.barrier() if during == "barrier" else pg.all_reduce(torch.ones(BIG))
        raise AssertionError("the collectives did not fail")
    except dist.DistBackendError as e:
        failed = str(e)
    detected = time.monotonic() - start
    new = pg.shrink()
    recovered = time.monotonic() - start
    result = (failed, detected, recovered, new.rank(), new.size(), _total(new, ctx.rank + 1.0))
    # Nothing of either group is left once both are gone.
    new.shutdown()
    del ctx.groups[name], pg, new
    after = read_resources()
    assert (after.shm_mapped_bytes, after.fds, after.threads) == (
        before.shm_mapped_bytes, before.fds, before.threads), (before, after)
    return result


@pytest.mark.parametrize("during", ["all_reduce", "barrier"])
def test_survivors_of_a_kill_shrink_and_go_on(during):
    pool = Ranks(3)
    try:
        results = pool.run_each([_survivor, _survivor, _victim], f"kill-{during}", during,
                                allow_dead=True, timeout=120)
        assert isinstance(results[2], Died) and results[2].exitcode == -signal.SIGKILL
        for rank, (failed, detected, recovered, new_rank, size, total) in enumerate(results[:2]):
            assert "rank 2" in failed and "exited" in failed, failed
            assert detected < BOUND_S and recovered < BOUND_S, (detected, recovered)
            assert (new_rank, size) == (rank, 2)
            assert total == 1.0 + 2.0  # the survivors' rank + 1, summed
    finally:
        pool.close()


def _agree_with_deaths(ctx: RankContext, dying: tuple, voted_then_died: int) -> tuple:
    pg = named_group(ctx, "agree", timeout=TIMEOUT)
    pg.barrier()
    if ctx.rank in dying:
        _kill_self()
    if ctx.rank == voted_then_died:
        pg._store.set(f"{pg._prefix}/round/0/vote/{ctx.rank}", "1")  # agree's first step
        _kill_self()
    start = time.monotonic()
    agreement = survival.agree(pg, flag=ctx.rank != 0)
    return agreement, time.monotonic() - start


def test_agreement_is_the_same_on_every_survivor_when_ranks_die_during_it():
    (first, t0), (second, t1) = _survivors(_agree_with_deaths, 4, (2, 3), (2,), 3)
    assert first == second, (first, second)
    assert first.flag is False  # rank 0 voted False
    # Rank 2 never voted; rank 3 voted and then died: it may be counted either way, alike
    # on both survivors.
    assert 2 in first.dead and set(first.alive) >= {0, 1}, first
    assert max(t0, t1) < BOUND_S, (t0, t1)


def _two_die_at_once(ctx: RankContext) -> tuple:
    pg = named_group(ctx, "two-die", timeout=TIMEOUT)
    pg.barrier()
    if ctx.rank >= 2:
        _kill_self()
    _fails(pg)
    new = pg.shrink()
    return new.rank(), new.size(), _total(new, float(ctx.rank + 1))


def test_two_ranks_killed_at_once():
    assert _survivors(_two_die_at_once, 4, (2, 3)) == [(0, 2, 3.0), (1, 2, 3.0)]


def _one_survives(ctx: RankContext) -> tuple:
    pg = named_group(ctx, "alone", timeout=TIMEOUT)
    pg.barrier()
    if ctx.rank == 1:
        _kill_self()
    _fails(pg)
    new = pg.shrink()
    return new.rank(), new.size(), _total(new, 5.0)


def test_the_last_survivor_goes_on_alone():
    assert _survivors(_one_survives, 2, (1,)) == [(0, 1, 5.0)]


def _dies_while_shrinking(ctx: RankContext) -> tuple:
    pg = named_group(ctx, "shrink-death", timeout=datetime.timedelta(seconds=15))
    pg.barrier()
    if ctx.rank == 3:
        _kill_self()
    _fails(pg)
    if ctx.rank == 2:
        # Agrees with the others, then dies while the survivors' group is made.
        def die(*args, **kwargs):
            _kill_self()
        pyddp.ProcessGroup.__init__ = die
    new = pg.shrink()
    return new.rank(), new.size(), _total(new, float(ctx.rank + 1))


def test_a_rank_that_dies_during_shrink_is_left_out():
    assert _survivors(_dies_while_shrinking, 4, (2, 3)) == [(0, 2, 3.0), (1, 2, 3.0)]


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0] == "T"


def _a_stopped_rank_is_waited_for(ctx: RankContext, pids: list) -> tuple:
    pg = named_group(ctx, "stopped", timeout=TIMEOUT)
    pg.barrier()
    if ctx.rank == 2:
        os.kill(os.getpid(), signal.SIGSTOP)  # before it votes; rank 0 wakes it
    if ctx.rank == 0:
        deadline = time.monotonic() + BOUND_S
        while not _stopped(pids[2]):
            assert time.monotonic() < deadline, "rank 2 did not stop"
            time.sleep(0.01)
        time.sleep(1.5)
        os.kill(pids[2], signal.SIGCONT)
    agreement = survival.agree(pg)
    return agreement, _total(pg, 1.0)


def test_a_rank_stopped_for_less_than_the_timeout_is_not_dropped(three):
    pids = [three.pid(r) for r in range(3)]
    results = three.run(_a_stopped_rank_is_waited_for, pids, timeout=120)
    for agreement, total in results:
        assert agreement == survival.Agreement(flag=True, dead=(), alive=(0, 1, 2)), agreement
        assert total == 3.0


def _member_then_admit(ctx: RankContext) -> tuple:
    store = dist.FileStore(ctx.store_path("grow"), 4)
    pg = pyddp.new_group("shm", store=store, rank=ctx.rank, world_size=3, timeout=TIMEOUT)
    pg.barrier()
    if ctx.rank == 2:
        _kill_self()
    _fails(pg)
    small = pg.shrink()
    if small.rank() == 0:
        store.set("test/lineage", small._lineage)
    deadline = time.monotonic() + BOUND_S
    while survival.pending_joins(small) == 0:
        assert time.monotonic() < deadline, "no process asked to join"
        time.sleep(0.01)
    grown = small.admit()
    return grown.rank(), grown.size(), _total(grown, ctx.rank + 1.0)


def _joiner(ctx: RankContext) -> tuple:
    store = dist.FileStore(ctx.store_path("grow"), 4)
    store.wait(["test/lineage"], TIMEOUT)
    group = survival.join(store=store, timeout=TIMEOUT, lineage=store.get("test/lineage").decode())
    try:
        return group.rank(), group.size(), _total(group, 10.0)
    finally:
        pyddp.destroy_process_group()


def test_a_new_process_joins_the_survivors():
    pool = Ranks(4)
    try:
        results = pool.run_each([_member_then_admit, _member_then_admit, _member_then_admit,
                                 _joiner], allow_dead=True, timeout=120)
        assert isinstance(results[2], Died), results[2]
        total = 1.0 + 2.0 + 10.0
        assert results[0] == (0, 3, total) and results[1] == (1, 3, total), results
        assert results[3] == (2, 3, total), results[3]
    finally:
        pool.close()


# --- across simulated hosts (tests/support/hosts.py) -----------------------------------

HOSTS_SKIP = _launch.simulated_hosts_unavailable()
# A host lost whole is found only at the timeout (no rank is left to look at its pids).
HOST_TIMEOUT = datetime.timedelta(seconds=8)


def _across_hosts(ctx: RankContext, victims: tuple) -> tuple:
    store = dist.FileStore(ctx.store_path(f"hosts-{len(victims)}"), ctx.world_size)
    pg = pyddp.new_group("auto", store=store, rank=ctx.rank, world_size=ctx.world_size,
                         timeout=HOST_TIMEOUT)
    _total(pg, 1.0)
    if ctx.rank in victims:
        _kill_self()
    try:
        pg.all_reduce(torch.ones(1000))
        raise AssertionError("the collective did not fail")
    except dist.DistBackendError:
        pass
    new = pg.shrink()
    return new.rank(), new.size(), new.transports()["cpu"], _total(new, ctx.rank + 1.0)


@pytest.mark.skipif(HOSTS_SKIP is not None, reason=f"simulated hosts: {HOSTS_SKIP}")
@pytest.mark.parametrize("victims", [(3,), (2, 3)], ids=["one-rank", "a-whole-host"])
def test_survivors_across_hosts_shrink(victims):
    pool = HostRanks(["a", "a", "b", "b"])
    try:
        results = pool.run_each([_across_hosts] * 4, victims, allow_dead=True, timeout=120)
        assert all(isinstance(results[r], Died) for r in victims), results
        survivors = [r for r in range(4) if r not in victims]
        total = float(sum(r + 1 for r in survivors))
        for new_rank, rank in enumerate(survivors):
            got_rank, size, transport, got_total = results[rank]
            assert (got_rank, size, got_total) == (new_rank, len(survivors), total), (
                results[rank])
            # Two hosts left: shm inside each and gloo between; one host: shm alone.
            assert ("gloo" in transport) == (len(victims) == 1), transport
    finally:
        pool.close()
