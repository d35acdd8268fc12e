"""A rank stopped (SIGSTOP) inside a collective: a peer that times out names it, saying
that every rank had entered the collective; and a peer that finished that collective and
destroyed its group meanwhile fails the stopped rank only at the next one.
"""

from __future__ import annotations

import datetime
import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

from harness import RankContext, Ranks, raises
from shm_groups import named_group, ring_group

pytestmark = pytest.mark.multiprocess


def _finish_then_leave(ctx: RankContext) -> str:
    # Rank 1 arrives first at a one-round all_reduce (its share staged with
    # its arrival) and is stopped there; rank 0 arrives, finishes and
    # destroys its group; rank 1, resumed, finds rank 0's share and that rank
    # 0 left: the collective rank 0 finished is no reason to fail, the next is.
    pg = named_group(ctx, "finish-leave")
    t = torch.full((4,), float(ctx.rank + 1))
    if ctx.rank == 0:
        time.sleep(1.0)
        pg.all_reduce(t)
        pg.shutdown()
        assert torch.equal(t, torch.full((4,), 3.0)), t
        return ""
    work = pg.all_reduce(t, async_op=True)
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGSTOP)  # the test's timer sends SIGCONT
    work.wait()
    assert torch.equal(t, torch.full((4,), 3.0)), t
    return raises(dist.DistBackendError, ".", pg.all_reduce, t)


def _with_rank_1_resumed(after: float, fn) -> list:
    """fn's results on 2 fresh ranks; rank 1 may stop itself (SIGSTOP) and is
    resumed `after` seconds from the start."""
    pool = Ranks(2)
    resume = threading.Timer(after, os.kill, args=(pool.pid(1), signal.SIGCONT))
    resume.start()
    try:
        return pool.run(fn)
    finally:
        resume.cancel()
        os.kill(pool.pid(1), signal.SIGCONT)
        pool.close()


def test_a_rank_that_finished_and_left_fails_its_peers_only_after():
    _, message1 = _with_rank_1_resumed(3.0, _finish_then_leave)
    assert ("rank 0 gave up on collective #2 while rank 1 waited for it in all_reduce #2: "
            "rank 0 destroyed its process group") in message1, message1


def _stall_inside(ctx: RankContext) -> str:
    # Rank 0 arrives late; rank 1 has arrived (it waits in the arrival
    # barrier) when it stops itself, so rank 0 finds every rank inside the
    # collective and then waits for rank 1's first piece until its deadline.
    pg = ring_group(ctx, "stall", datetime.timedelta(seconds=2 if ctx.rank == 0 else 60))
    if ctx.rank == 0:
        time.sleep(1.5)
        return raises(dist.DistBackendError, ".", pg.all_reduce, torch.ones(100_000))
    work = pg.all_reduce(torch.ones(100_000), async_op=True)
    time.sleep(0.75)
    os.kill(os.getpid(), signal.SIGSTOP)  # the test's timer sends SIGCONT
    return raises(dist.DistBackendError, ".", work.wait)


def test_a_peer_stalled_inside_the_collective_is_named():
    message0, message1 = _with_rank_1_resumed(6.0, _stall_inside)
    assert ("all_reduce #1 timed out after 2000 ms on rank 0 waiting for rank 1 "
            "(every rank entered the collective)") in message0, message0
    assert "rank 0 gave up on collective #1" in message1, message1
