"""A blocking collective releases the GIL while it waits, and a small synchronous one,
which keeps it while it spins, does not deadlock with the worker dropping the work
queued ahead of it.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

import pyddp
from harness import RankContext
from shm_groups import named_group

pytestmark = pytest.mark.multiprocess


def _gil_released_while_waiting(ctx: RankContext) -> int:
    pg = named_group(ctx, "gil")
    if ctx.rank == 1:
        time.sleep(1.0)
        pg.all_reduce(torch.ones(4))
        return 0
    ticks = [0]
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            ticks[0] += 1

    thread = threading.Thread(target=spin)
    thread.start()
    pg.all_reduce(torch.ones(4))  # blocks about a second for rank 1
    stop.set()
    thread.join()
    return ticks[0]


def _small_calls_after_dropped_works(ctx: RankContext) -> None:
    # A small synchronous call keeps the GIL while it spins; the worker may
    # be dropping the previous job, whose tensor then takes the GIL, with
    # the queue locked. Each round: an async all_reduce whose Work nobody
    # keeps, then a synchronous one right behind it.
    pg = named_group(ctx, "dropped")
    queued = torch.full((4096,), float(ctx.rank))
    for i in range(300):
        pg.all_reduce(queued, op=pyddp.ReduceOp.MAX, async_op=True)
        small = torch.ones(4)
        pg.all_reduce(small)
        assert torch.equal(small, torch.full((4,), 2.0)), (i, small)
    pg.barrier()
    assert torch.equal(queued, torch.full((4096,), 1.0))


def test_blocking_collective_releases_the_gil(two):
    ticks, _ = two.run(_gil_released_while_waiting)
    assert ticks > 1000, ticks


def test_small_synchronous_calls_behind_dropped_works_do_not_deadlock(two):
    two.run(_small_calls_after_dropped_works)
