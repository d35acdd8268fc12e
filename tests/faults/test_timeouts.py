"""Ranks that do not come: a rank that never arrives at a collective is named at the
group's timeout, Work.wait's own timeout names the call, and a rank that gives up tells
its peers, which fail at once naming its reason instead of waiting out their own timeout.
"""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist

from harness import RankContext, raises
from shm_groups import SHORT, named_group, ring_group

pytestmark = pytest.mark.multiprocess


def _absent_rank(ctx: RankContext) -> tuple:
    pg = named_group(ctx, "absent", timeout=SHORT)
    if ctx.rank == ctx.world_size - 1:
        return None, 0.0  # never calls the collective
    start = time.monotonic()
    work = pg.all_reduce(torch.ones(10), async_op=True)
    message = raises(dist.DistBackendError, "did not arrive", work.wait)
    elapsed = time.monotonic() - start
    assert isinstance(work.exception(), dist.DistBackendError)
    assert work.is_completed()
    return message, elapsed


def test_absent_rank_is_named_within_the_timeout(three):
    results = three.run(_absent_rank)
    for message, elapsed in results[:2]:
        assert "rank 2 did not arrive at all_reduce #1 within the timeout of 2000 ms" in message
        assert SHORT.total_seconds() <= elapsed < SHORT.total_seconds() + 10, elapsed


def _wait_with_timeout(ctx: RankContext) -> None:
    pg = named_group(ctx, "wait-timeout")
    if ctx.rank == 1:
        time.sleep(1.5)
    work = pg.all_reduce(torch.ones(4), async_op=True)
    if ctx.rank == 0:
        raises(dist.DistBackendError, "rank 0: all_reduce #1 did not complete within the 100 ms "
                "given to Work.wait", work.wait, datetime.timedelta(milliseconds=100))
    assert work.wait(datetime.timedelta(seconds=30))
    assert work.get_future().value()[0].tolist() == [2.0] * 4


def test_work_wait_timeout_names_the_call(two):
    two.run(_wait_with_timeout)


def _give_up_travels(ctx: RankContext, count: int) -> tuple:
    # Rank 1 waits 2 s for rank 0, gives up, and says so; rank 0 arrives
    # later with a 60 s timeout and must fail at once, naming rank 1's reason.
    # 100_000 elements take the ring; 4 the direct algorithm in one round,
    # whose arrival carries the staged data: rank 0 finds rank 1's share
    # there and must still fail.
    timeout = datetime.timedelta(seconds=60 if ctx.rank == 0 else 2)
    pg = ring_group(ctx, f"give-up-{count}", timeout) if count > 4 else named_group(
        ctx, f"give-up-{count}", timeout)
    if ctx.rank == 0:
        time.sleep(4.0)
    start = time.monotonic()
    message = raises(dist.DistBackendError, ".", pg.all_reduce, torch.ones(count))
    return message, time.monotonic() - start


@pytest.mark.parametrize("count", [100_000, 4], ids=["ring", "direct-one-round"])
def test_a_rank_that_gives_up_fails_its_peers_at_once(two, count):
    (message0, elapsed0), (message1, _) = two.run(_give_up_travels, count)
    assert "rank 0 did not arrive at all_reduce #1" in message1, message1
    assert "rank 1 gave up on collective #1" in message0, message0
    assert "rank 0 did not arrive" in message0, message0
    assert elapsed0 < 10, elapsed0
