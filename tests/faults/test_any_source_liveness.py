"""A receive from any source notices a dead sender as fast as a named receive does: it
takes what the dead rank posted before it died, then fails naming the dead rank(s)
instead of waiting out the group's timeout; with no live rank left to send, it says so.
"""

from __future__ import annotations

import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist

import pyddp
from collective_cases import check_equal
from harness import Died, RankContext, Ranks

pytestmark = pytest.mark.multiprocess

TIMEOUT = datetime.timedelta(seconds=60)
# Far below TIMEOUT: a receive that failed within it did not wait for the timeout.
NOTICED_WITHIN_S = 15.0
DIES = 3


def _group(ctx: RankContext, store: dist.Store):
    return pyddp.create_group("shm", store=store, rank=ctx.rank, world_size=ctx.world_size,
                              timeout=TIMEOUT)


def _last_rank_dies(ctx: RankContext, posts_first: bool):
    """The last rank dies (after sending rank 0 a message with tag 7 when `posts_first`);
    rank 0 receives from any source twice; the ranks between stay alive and silent."""
    store = dist.FileStore(ctx.store_path(f"any-{posts_first}"), ctx.world_size)
    pg = _group(ctx, store)
    last = ctx.world_size - 1
    if ctx.rank == last:
        if posts_first:
            pg.isend(torch.full((5,), 7.0), 0, 7)
            # The message's one piece is posted long before the rank exits.
            time.sleep(1.0)
        os._exit(DIES)
    if ctx.rank != 0:
        # Alive and silent until rank 0 is done.
        store.wait(["done"], TIMEOUT)
        return None
    if posts_first:
        got = torch.zeros(5)
        work = pg.irecv(got, None, 7)
        work.wait()
        check_equal(got, torch.full((5,), 7.0), "the dead rank's message")
        assert work._source_rank() == last
    start = time.monotonic()
    with pytest.raises(dist.DistBackendError) as error:
        pg.recv(torch.zeros(5), None, 7)
    took = time.monotonic() - start
    store.set("done", "1")
    return str(error.value), took


@pytest.mark.parametrize("world_size", [2, 3], ids=lambda n: f"world{n}")
@pytest.mark.parametrize("posts_first", [False, True], ids=["silent", "posted"])
def test_any_source_receive_fails_naming_a_dead_sender(world_size, posts_first):
    pool = Ranks(world_size)
    try:
        results = pool.run_each(
            [_last_rank_dies] * world_size, posts_first, allow_dead=True)
        assert isinstance(results[-1], Died) and results[-1].exitcode == DIES
        message, took = results[0]
        last = world_size - 1
        assert "recv from any rank (tag 7" in message, message
        assert f"rank {last} (pid {pool.pid(last)}) exited" in message, message
        assert "the message may have been that rank's" in message, message
        alone = world_size == 2
        assert ("no live rank is left to send it" in message) == alone, message
        assert took < NOTICED_WITHIN_S, f"noticed after {took:.1f} s: {message}"
    finally:
        pool.close()
