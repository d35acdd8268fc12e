"""ProcessGroup.abort(): every pending and later call on the group fails at once on the
rank that aborts, its peers waiting on it fail within a fraction of the group's timeout
saying it aborted, it is safe from another thread and from a signal handler while a
collective runs, and the group leaves nothing in /dev/shm. torch's ``ProcessGroup.abort``
on a "pyddp" group does the same.
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

import pyddp
from harness import RankContext, raises
from pyddp.bench.soak import read_resources
from shm_groups import named_group

pytestmark = pytest.mark.multiprocess

# Far beyond what any wait below may take: a peer that learnt of the abort only at
# the timeout would fail the elapsed-time bounds below.
TIMEOUT = datetime.timedelta(seconds=60)
BOUND_S = 10.0
BOUND_S_DELTA = datetime.timedelta(seconds=BOUND_S)


def _all_left(ctx: RankContext, name: str) -> None:
    """Returns once every rank has called it: every rank has left the collectives it
    made before (an abort fails a peer still inside the collective the aborting rank
    entered last, even one this rank has done its part of)."""
    store = dist.FileStore(ctx.store_path(f"left-{name}"), ctx.world_size)
    store.set(str(ctx.rank), b"")
    store.wait([str(r) for r in range(ctx.world_size)], BOUND_S_DELTA)


def _abort_from_another_thread(ctx: RankContext) -> tuple:
    pg = named_group(ctx, f"abort-thread-{ctx.world_size}", timeout=TIMEOUT)
    order = dist.FileStore(ctx.store_path("abort-thread-order"), ctx.world_size)
    pg.barrier()
    if ctx.rank == 2:
        # Joins the all_reduce only once rank 1 has failed in it: rank 1 can only have
        # learnt of the abort from rank 0.
        order.wait(["rank 1 failed"], BOUND_S_DELTA)
        message = raises(dist.DistBackendError, "aborted", pg.all_reduce, torch.ones(1 << 16))
        pg.shutdown()
        return message, 0.0
    work = pg.all_reduce(torch.ones(1 << 16), async_op=True)
    if ctx.rank == 0:
        time.sleep(0.5)
        aborter = threading.Thread(target=pg.abort)
        aborter.start()
        aborter.join(timeout=BOUND_S)
        assert not aborter.is_alive(), "abort() did not return"
    start = time.monotonic()
    message = raises(dist.DistBackendError, "abort", work.wait)
    elapsed = time.monotonic() - start
    if ctx.rank == 0:
        later = raises(dist.DistBackendError, "aborted", pg.all_reduce, torch.ones(1))
        assert pg.aborted
        return message + " | " + later, elapsed
    order.set("rank 1 failed", "")
    pg.shutdown()
    return message, elapsed


def test_abort_from_another_thread_fails_this_rank_and_its_peers_at_once(three):
    (mine, _), (peer, elapsed), (late, _) = three.run(_abort_from_another_thread, timeout=90)
    assert "aborted" in mine and "ProcessGroup.shrink()" in mine, mine
    assert "rank 0 aborted its process group" in peer, peer
    assert elapsed < BOUND_S, elapsed
    assert "aborted" in late, late


def _abort_from_a_signal_handler(ctx: RankContext) -> tuple:
    pg = named_group(ctx, "abort-signal", timeout=TIMEOUT)
    pg.barrier()
    if ctx.rank == 1:
        time.sleep(1.5)  # joins after rank 0 aborted, while rank 0 is still in its wait
        start = time.monotonic()
        message = raises(dist.DistBackendError, ".", pg.all_reduce, torch.ones(10))
        pg.shutdown()
        return message, time.monotonic() - start
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: pg.abort())
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGUSR1))
    timer.start()
    try:
        start = time.monotonic()
        message = raises(dist.DistBackendError, "abort", pg.all_reduce, torch.ones(10))
        return message, time.monotonic() - start
    finally:
        timer.join(BOUND_S)
        signal.signal(signal.SIGUSR1, previous)


def test_abort_from_a_signal_handler_inside_a_wait(two):
    (mine, waited), (peer, elapsed) = two.run(_abort_from_a_signal_handler, timeout=90)
    assert "aborted" in mine, mine
    assert waited < BOUND_S, waited
    assert "rank 0 aborted its process group" in peer, peer
    assert elapsed < BOUND_S, elapsed


def _abort_leaves_nothing(ctx: RankContext) -> tuple:
    before = read_resources()
    pg = named_group(ctx, "abort-leaks", timeout=TIMEOUT)
    t = torch.full((1000,), float(ctx.rank + 1))
    pg.all_reduce(t)
    during = read_resources()
    _all_left(ctx, "leaks")
    pg.abort()
    pg.abort()  # idempotent
    pg.shutdown()  # does nothing more
    del ctx.groups["abort-leaks"], pg
    return t[0].item(), before, during, read_resources()


def test_abort_releases_the_group_and_is_idempotent(two):
    for total, before, during, after in two.run(_abort_leaves_nothing):
        assert total == 3.0
        assert during.shm_mapped_bytes > before.shm_mapped_bytes, (before, during)
        assert (after.shm_mapped_bytes, after.shm_entries, after.fds, after.threads) == (
            before.shm_mapped_bytes, before.shm_entries, before.fds, before.threads), (
            before, after)


def _torch_abort(ctx: RankContext) -> tuple:
    store = dist.FileStore(ctx.store_path("torch-abort"), ctx.world_size)
    dist.init_process_group("pyddp", store=store, rank=ctx.rank, world_size=ctx.world_size,
                            timeout=TIMEOUT)
    try:
        t = torch.ones(10)
        dist.all_reduce(t)
        _all_left(ctx, "torch-abort")
        if ctx.rank == 1:
            time.sleep(1.0)
            start = time.monotonic()
            message = raises(dist.DistBackendError, ".", dist.all_reduce, torch.ones(10))
            return t[0].item(), message, time.monotonic() - start
        dist.group.WORLD.abort()
        message = raises(dist.DistBackendError, "aborted", dist.all_reduce, torch.ones(1))
        return t[0].item(), message, 0.0
    finally:
        dist.destroy_process_group()


def test_torch_abort_on_a_pyddp_group(two):
    (total, mine, _), (_, peer, elapsed) = two.run(_torch_abort, timeout=90)
    assert total == 2.0
    assert "aborted" in mine, mine
    assert "rank 0 aborted its process group" in peer, peer
    assert elapsed < BOUND_S, elapsed


def _torch_shrink_group(ctx: RankContext) -> tuple:
    store = dist.FileStore(ctx.store_path("torch-shrink"), ctx.world_size)
    dist.init_process_group("pyddp", store=store, rank=ctx.rank, world_size=ctx.world_size,
                            timeout=TIMEOUT)
    try:
        assert dist.group.WORLD._get_backend(torch.device("cpu")).supports_shrinking
        if ctx.rank == 1:
            return None  # the rank the others exclude: it takes no part
        t = torch.full((10,), float(ctx.rank + 1))
        new = dist.shrink_group([1], shrink_flags=1)  # torch's SHRINK_ABORT
        dist.all_reduce(t)
        return new.rank(), new.size(), dist.get_world_size(), t[0].item()
    finally:
        dist.destroy_process_group()


def test_torch_shrink_group_on_a_pyddp_group(three):
    results = three.run(_torch_shrink_group, timeout=90)
    assert results == [(0, 2, 2, 4.0), None, (1, 2, 2, 4.0)], results


def _abort_while_a_peer_waits(ctx: RankContext, backend: str) -> tuple:
    # The emulated backend runs the GPU's fused collectives on CPU threads
    # (csrc/device/): its abort is the fused engine's.
    pg = pyddp.create_group(backend, store=dist.FileStore(ctx.store_path(f"wait-{backend}"), 2),
                            rank=ctx.rank, world_size=2, timeout=TIMEOUT)
    pg.barrier()
    _all_left(ctx, f"wait-{backend}")
    if ctx.rank == 0:
        time.sleep(0.5)  # rank 1 waits in its all_reduce meanwhile (or comes after)
        pg.abort()
        return raises(dist.DistBackendError, "aborted", pg.all_reduce, torch.ones(10)), 0.0
    start = time.monotonic()
    message = raises(dist.DistBackendError, ".", pg.all_reduce, torch.ones(1000))
    elapsed = time.monotonic() - start
    pg.shutdown()
    return message, elapsed


@pytest.mark.parametrize("backend", ["shm", "emulated"])
def test_a_peer_waiting_on_an_aborted_rank_fails_at_once(two, backend):
    (mine, _), (peer, elapsed) = two.run(_abort_while_a_peer_waits, backend, timeout=90)
    assert "aborted" in mine, mine
    assert "rank 0 aborted its process group" in peer, peer
    assert elapsed < BOUND_S, elapsed
