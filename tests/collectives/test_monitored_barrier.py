"""monitored_barrier: c10d's barrier that names the ranks that did not come.

On one host pyddp runs gloo's protocol over its own messages
(csrc/backend/monitored_barrier.h); across hosts it hands the call to gloo
(test_multihost.py). Reference: the same calls on a gloo group of the
same ranks in the same run, and the messages torch's own tests expect of gloo
(test_monitored_barrier_gloo*). torch's Python refuses
``torch.distributed.monitored_barrier`` for every backend but gloo; the group's
own method (``ProcessGroup.monitored_barrier``) and pyddp's
``pyddp.monitored_barrier`` reach pyddp.
"""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist

import pyddp
from collective_cases import check_equal
from harness import Died, RankContext, Ranks, raises

pytestmark = pytest.mark.multiprocess

TIMEOUT = datetime.timedelta(seconds=60)
SHORT = datetime.timedelta(seconds=1)
WORLD = 3


def _setup(ctx: RankContext) -> None:
    n = ctx.world_size
    dist.init_process_group("gloo", store=dist.FileStore(ctx.store_path("torch"), n),
                            rank=ctx.rank, world_size=n, timeout=TIMEOUT)
    ctx.state["own"] = 0  # pyddp groups made so far, for their store's name


@pytest.fixture(scope="module")
def ranks():
    pool = Ranks(WORLD, setup=_setup)
    yield pool
    pool.close()


def _barrier_of(ctx: RankContext, backend: str):
    """A fresh group of every rank and its monitored_barrier(timeout, wait_all_ranks):
    torch's group.monitored_barrier on "pyddp" or gloo, or pyddp.monitored_barrier on a
    group of pyddp's own ("own"). Fresh, because a failed monitored barrier leaves gloo's
    group unusable."""
    if backend == "own":
        ctx.state["own"] += 1
        group = pyddp.new_group("shm", store=dist.FileStore(
            ctx.store_path(f"own{ctx.state['own']}"), ctx.world_size), rank=ctx.rank,
            world_size=ctx.world_size, timeout=TIMEOUT)
        ctx.groups[f"own{ctx.state['own']}"] = group

        def barrier(timeout=None, wait_all_ranks=False):
            pyddp.monitored_barrier(group, timeout=timeout, wait_all_ranks=wait_all_ranks)

        def all_reduce(t):
            pyddp.all_reduce(t, group=group)
        return barrier, all_reduce
    group = dist.new_group(backend=backend)

    def barrier(timeout=None, wait_all_ranks=False):
        if timeout is None:
            group.monitored_barrier(wait_all_ranks=wait_all_ranks)
        else:
            group.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)

    def all_reduce(t):
        dist.all_reduce(t, group=group)
    return barrier, all_reduce


def _every_rank_passes(ctx: RankContext, backend: str) -> None:
    barrier, all_reduce = _barrier_of(ctx, backend)
    for _ in range(3):
        barrier(datetime.timedelta(seconds=30))
        barrier(datetime.timedelta(seconds=30), wait_all_ranks=True)
        barrier()
        t = torch.ones(5)
        all_reduce(t)
        check_equal(t, torch.full((5,), float(ctx.world_size)), "all_reduce between barriers")


def _some_ranks_absent(ctx: RankContext, backend: str, absent: list,
                       wait_all_ranks: bool) -> object:
    """Every rank but ``absent`` calls; what each present rank raised."""
    barrier, _ = _barrier_of(ctx, backend)
    if ctx.rank in absent:
        return None
    with pytest.raises(RuntimeError) as error:
        barrier(SHORT, wait_all_ranks=wait_all_ranks)
    return str(error.value)


def _rank_0_alone(ctx: RankContext, backend: str) -> object:
    barrier, _ = _barrier_of(ctx, backend)
    if ctx.rank != 0:
        return None
    with pytest.raises(RuntimeError) as error:
        barrier(datetime.timedelta(0))
    return str(error.value)


BACKENDS = ["pyddp", "gloo", "own"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_rank_passes_and_the_group_goes_on(ranks, backend):
    ranks.run(_every_rank_passes, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rank_0_names_the_first_absent_rank_and_the_others_fail(ranks, backend):
    messages = ranks.run(_some_ranks_absent, backend, [1], False)
    assert messages[1] is None
    # What torch's test_monitored_barrier_gloo expects of each rank.
    assert "Rank 1 failed to pass monitoredBarrier in 1000 ms" in messages[0], messages
    assert ("Rank 2 successfully reached monitoredBarrier, but received errors while waiting "
            "for send/recv from rank 0") in messages[2], messages
    if backend != "gloo":
        # gloo's rank 2 hears only that rank 0 failed; pyddp's, which rank 0 blamed.
        assert "rank 0 found that rank 1 failed to pass monitoredBarrier" in messages[2]
        assert "rank 1 has not sent it" in messages[0], messages


@pytest.mark.parametrize("backend", BACKENDS)
def test_wait_all_ranks_names_every_absent_rank(ranks, backend):
    messages = ranks.run(_some_ranks_absent, backend, [1, 2], True)
    assert messages[1:] == [None, None]
    assert "Ranks 1, 2 failed to pass monitoredBarrier in 1000 ms" in messages[0], messages


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_zero_timeout_times_rank_0_out(ranks, backend):
    messages = ranks.run(_rank_0_alone, backend)
    # torch's test_monitored_barrier_gloo_rank_0_timeout
    assert "Rank 0 timed out in monitoredBarrier after 0 ms" in messages[0], messages


def _survivor(ctx: RankContext) -> str:
    barrier, _ = _barrier_of(ctx, "pyddp")
    # A timeout far beyond the test's: rank 2's exit must be what ends it.
    return raises(RuntimeError, "monitoredBarrier", barrier, datetime.timedelta(minutes=5))


def _victim(ctx: RankContext) -> None:
    _barrier_of(ctx, "pyddp")
    os._exit(3)


def test_a_killed_rank_is_named_at_once():
    pool = Ranks(WORLD, setup=_setup)
    try:
        pid = pool.pid(2)
        results = pool.run_each([_survivor, _survivor, _victim], allow_dead=True, timeout=60)
    finally:
        pool.close()
    assert isinstance(results[2], Died)
    assert "Rank 2 failed to pass monitoredBarrier in 300000 ms" in results[0], results
    assert f"rank 2 (pid {pid}) exited" in results[0], results
    # Rank 1 arrived: rank 0 tells it whom it blamed.
    assert "rank 0 found that rank 2 failed to pass monitoredBarrier" in results[1], results


def test_arguments_are_checked(ranks):
    ranks.run(_bad_arguments)


def _bad_arguments(ctx: RankContext) -> None:
    barrier, _ = _barrier_of(ctx, "own")
    with pytest.raises(ValueError, match="timeout must be a datetime.timedelta of at least 0"):
        barrier(datetime.timedelta(seconds=-1))
    with pytest.raises(ValueError, match="timeout must be a datetime.timedelta"):
        barrier(5)
    barrier()
