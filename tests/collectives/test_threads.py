"""The CPU executor's threads: the caller, the worker, future callbacks, shutdown.

One process, groups of one rank (nothing to wait for, so the threads meet
as often as possible) and of two ranks. CI runs this module under
ThreadSanitizer (.ci/run).
"""

from __future__ import annotations

import datetime
import threading

import pytest
import torch
import torch.distributed as dist

import pyddp
from harness import RankContext, Ranks


def _solo() -> pyddp.ProcessGroup:
    return pyddp.new_group("shm", store=dist.HashStore(), rank=0, world_size=1,
                           timeout=datetime.timedelta(seconds=60))


def test_callbacks_issue_collectives_while_the_caller_does():
    pg = _solo()
    try:
        seen = []

        def callback(fut):
            t = torch.ones(3)
            pg.all_reduce(t)  # runs at once, on the worker
            seen.append(t.sum().item())
            return fut.value()

        futures = []
        for i in range(200):
            work = pg.all_reduce(torch.full((8,), float(i)), async_op=True)
            futures.append(work.get_future().then(callback))
            if i % 3 == 0:
                t = torch.ones(5)
                pg.all_reduce(t)  # queued behind the asynchronous ones
                assert t.tolist() == [1.0] * 5
        for i, fut in enumerate(futures):
            assert fut.wait()[0].tolist() == [float(i)] * 8
        assert seen == [3.0] * 200
    finally:
        pg.shutdown()


def test_threads_take_turns_on_one_group():
    pg = _solo()
    errors = []

    def worker(n: int) -> None:
        try:
            for _ in range(100):
                work = pg.all_reduce(torch.full((4,), float(n)), async_op=True)
                work.wait(datetime.timedelta(seconds=30))
                assert work.is_completed()
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(3)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
    finally:
        pg.shutdown()


def test_shutdown_from_another_thread_with_work_queued():
    for _ in range(20):
        pg = _solo()
        works = [pg.all_reduce(torch.ones(1000), async_op=True) for _ in range(20)]
        stopper = threading.Thread(target=pg.shutdown)
        stopper.start()
        stopper.join(30)
        for work in works:
            try:
                work.wait(datetime.timedelta(seconds=30))
            except dist.DistBackendError as error:
                assert "destroyed" in str(error), error


def test_destroy_from_a_callback_then_join():
    for _ in range(20):
        pg = _solo()
        done = threading.Event()

        def destroy(fut, pg=pg):
            pg.shutdown()
            done.set()
            return fut.value()

        fut = pg.all_reduce(torch.ones(4), async_op=True).get_future().then(destroy)
        assert fut.wait()[0].tolist() == [1.0] * 4
        assert done.wait(30)
        with pytest.raises(RuntimeError, match="destroyed"):
            pg.all_reduce(torch.ones(1))
        del pg
    pyddp._C.join_stopped_workers()


def _wait_and_abort(ctx: RankContext) -> str:
    pg = pyddp.new_group("shm", store=dist.FileStore(ctx.store_path("abort"), 2), rank=ctx.rank,
                         world_size=2, timeout=datetime.timedelta(seconds=60))
    if ctx.rank == 1:
        works = [pg.all_reduce(torch.ones(100), async_op=True) for _ in range(50)]
        for work in works:
            work.wait(datetime.timedelta(seconds=30))
        pg.shutdown()
        return ""
    work = pg.all_reduce(torch.ones(100), async_op=True)
    for _ in range(49):
        pg.all_reduce(torch.ones(100), async_op=True)
    work.wait(datetime.timedelta(seconds=30))
    # A collective rank 1 never joins: shutting down from another thread
    # ends the worker's wait for it.
    pending = pg.all_reduce(torch.ones(100), async_op=True)
    stopper = threading.Timer(0.2, pg.shutdown)
    stopper.start()
    try:
        pending.wait(datetime.timedelta(seconds=30))
    except dist.DistBackendError as error:
        return str(error)
    finally:
        stopper.join(30)
    return "completed"


def _drop_a_running_work(ctx: RankContext) -> list:
    store = dist.FileStore(ctx.store_path("drop"), 2)
    pg = pyddp.new_group("shm", store=store, rank=ctx.rank, world_size=2,
                         timeout=datetime.timedelta(seconds=60))
    t = torch.full((4,), float(ctx.rank + 1))
    if ctx.rank == 1:
        store.wait(["dropped"], datetime.timedelta(seconds=30))
        pg.all_reduce(t)
        store.set("done", "1")
    else:
        # Rank 1 joins only once this rank dropped its Work: the worker's
        # reference is then the last, and the Work is deleted on the worker,
        # most likely before this thread touches the future again (the
        # store's waits are nothing ThreadSanitizer sees as ordering).
        work = pg.all_reduce(t, async_op=True)
        assert not work.is_completed()
        future = work.get_future()  # the last access to the Work
        del work
        store.set("dropped", "1")
        store.wait(["done"], datetime.timedelta(seconds=30))
        t = future.wait()[0]
    pg.shutdown()
    return t.tolist()


@pytest.mark.multiprocess
def test_a_work_its_caller_dropped_goes_on_the_worker():
    """The caller asks for a Work's future and drops the Work while the collective
    runs: the Work is deleted on the worker, after the caller's accesses (which
    ThreadSanitizer must see ordered before the delete)."""
    pool = Ranks(2)
    try:
        results = pool.run(_drop_a_running_work, timeout=60)
    finally:
        pool.close()
    assert results == [[3.0] * 4] * 2


@pytest.mark.multiprocess
def test_shutdown_ends_a_wait_on_the_worker():
    pool = Ranks(2)
    try:
        message, _ = pool.run(_wait_and_abort, timeout=60)
    finally:
        pool.close()
    assert "destroyed" in message or "gave up" in message, message
