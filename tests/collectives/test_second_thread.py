"""One thread at a time inside a group's synchronous collective: a second thread that
calls one meanwhile is refused at once, and the refused call consumes nothing, so the
group still pairs its ranks' calls.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from harness import RankContext, raises
from shm_groups import group_on

pytestmark = pytest.mark.multiprocess


def _two_threads(ctx: RankContext) -> list:
    pg = group_on(ctx, dist.FileStore(ctx.store_path("threads"), 2), name="threads")
    if ctx.rank == 1:
        time.sleep(1.5)
        t = torch.full((4,), 2.0)
        pg.all_reduce(t)
        u = torch.ones(3)
        pg.all_reduce(u)
        return [t.tolist(), u.tolist()]
    results = {}

    def first():
        t = torch.full((4,), 1.0)
        pg.all_reduce(t)  # waits about 1.5 s for rank 1
        results["first"] = t.tolist()

    thread = threading.Thread(target=first)
    thread.start()
    time.sleep(0.5)
    message = raises(RuntimeError, "another thread is inside a synchronous collective on "
                      "this process group", pg.all_reduce, torch.full((4,), 5.0))
    thread.join(30)
    u = torch.ones(3)
    pg.all_reduce(u)  # the refused call consumed nothing: the group still pairs up
    return [results["first"], u.tolist(), message]


def test_a_second_thread_inside_a_collective_is_refused(two):
    (first, after, message), (theirs, theirs_after) = two.run(_two_threads, timeout=60)
    assert first == theirs == [3.0] * 4
    assert after == theirs_after == [2.0] * 3
    assert "one thread at a time" in message
