"""A group destroyed with work pending or a peer waiting: its running and queued works
fail at once, its peers are told at once that it was destroyed, and its pending sends'
channels leave /dev/shm at once.
"""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist

from harness import RankContext, pyddp_segments, raises
from shm_groups import group_on, named_group

pytestmark = pytest.mark.multiprocess


def _destroy_with_pending_work(ctx: RankContext) -> tuple:
    pg = named_group(ctx, "destroy", timeout=datetime.timedelta(seconds=60))
    if ctx.rank == 1:
        return None, 0.0  # never joins these collectives
    running = pg.all_reduce(torch.ones(100), async_op=True)
    queued = pg.all_reduce(torch.ones(100), async_op=True)
    time.sleep(0.3)
    start = time.monotonic()
    pg.shutdown()
    elapsed = time.monotonic() - start
    first = raises(dist.DistBackendError, "destroyed while all_reduce #1 waited", running.wait)
    raises(dist.DistBackendError, "destroyed before this all_reduce ran", queued.wait)
    raises(RuntimeError, "destroyed", pg.all_reduce, torch.ones(1))
    return first, elapsed


def test_destroy_fails_running_and_queued_work_quickly(two):
    (message, elapsed), _ = two.run(_destroy_with_pending_work)
    assert elapsed < 5, elapsed


def _destroyed_with_a_pending_send(ctx: RankContext) -> tuple:
    pg = group_on(ctx, dist.FileStore(ctx.store_path("pending"), 2), name="pending")
    if ctx.rank == 1:
        pg.barrier()
        pg.shutdown()
        return ()
    before = set(pyddp_segments())
    work = pg.isend(torch.ones(1000), 1)  # rank 1 never receives it
    made = sorted(set(pyddp_segments()) - before)
    pg.barrier()
    pg.shutdown()  # pg and its pending send are still referenced
    message = raises(dist.DistBackendError, "rank 0 destroyed its process group", work.wait)
    left = [name for name in made if name in pyddp_segments()]
    return made, left, message


def test_a_group_destroyed_with_a_pending_send_removes_its_channel_at_once(two):
    made, left, message = two.run(_destroyed_with_a_pending_send)[0]
    assert len(made) == 1 and left == [], (made, left)
    assert "rank 0 destroyed its process group" in message, message


def _destroy_while_peer_waits(ctx: RankContext) -> tuple:
    pg = group_on(ctx, dist.FileStore(ctx.store_path("destroy"), 2), name="destroy")
    if ctx.rank == 0:
        time.sleep(1.0)
        pg.shutdown()  # with nothing running: only the shutdown can tell rank 1
        return "", 0.0
    start = time.monotonic()
    message = raises(dist.DistBackendError, ".", pg.all_reduce, torch.ones(10))
    return message, time.monotonic() - start


def test_destroying_a_group_tells_peers_at_once(two):
    _, (message, elapsed) = two.run(_destroy_while_peer_waits, timeout=60)
    assert "rank 0 destroyed its process group" in message, message
    assert elapsed < 10, elapsed
