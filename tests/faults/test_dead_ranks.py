"""A rank that dies (it exits or is killed) in a collective or point-to-point: its peers
fail within about the liveness period, naming it and its pid, also when it hosted the
store; a rank that exited after finishing its part is not blamed; a receiver reclaims
the channel of a sender that died with the store. Nothing is left in /dev/shm.
"""

from __future__ import annotations

import datetime
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from harness import Died, RankContext, Ranks, process_exited, pyddp_segments, raises
from shm_groups import MINUTE, free_port, group_on, named_group, segment_exists

pytestmark = pytest.mark.multiprocess


def _wait_for_dead_peer(ctx: RankContext) -> tuple:
    pg = named_group(ctx, "dead", timeout=datetime.timedelta(seconds=60))
    start = time.monotonic()
    message = raises(dist.DistBackendError, "exited", pg.all_reduce, torch.ones(100_000))
    return message, time.monotonic() - start


def _die(ctx: RankContext) -> None:
    named_group(ctx, "dead", timeout=datetime.timedelta(seconds=60))
    time.sleep(0.5)
    os._exit(3)


def test_dead_rank_is_named_quickly():
    pool = Ranks(2)
    try:
        (message, elapsed), died = pool.run_each([_wait_for_dead_peer, _die], allow_dead=True)
        assert isinstance(died, Died) and died.exitcode == 3
        assert f"rank 1 (pid {pool.pid(1)}) exited" in message, message
        assert elapsed < 20, elapsed
    finally:
        pool.close()


def _broadcast_then_exit(ctx: RankContext) -> None:
    pg = named_group(ctx, "leave-early")
    pg.broadcast(torch.arange(4_000_000, dtype=torch.float32), 0)
    os._exit(0)  # done with its part; the others may still be copying


def _receive_broadcast(ctx: RankContext) -> bool:
    pg = named_group(ctx, "leave-early")
    t = torch.zeros(4_000_000)
    pg.broadcast(t, 0)
    return bool(torch.equal(t, torch.arange(4_000_000, dtype=torch.float32)))


def test_a_rank_that_finished_and_exited_is_not_blamed():
    pool = Ranks(3)
    try:
        died, ok1, ok2 = pool.run_each([_broadcast_then_exit, _receive_broadcast,
                                        _receive_broadcast], allow_dead=True)
        assert isinstance(died, Died) and died.exitcode == 0
        assert ok1 and ok2
    finally:
        pool.close()


def _flag(ctx: RankContext, name: str) -> str:
    return ctx.store_path(f"flag-{name}")


def _wait_for_flag(ctx: RankContext, name: str) -> None:
    deadline = time.monotonic() + 60
    while not os.path.exists(_flag(ctx, name)):
        assert time.monotonic() < deadline, f"rank {ctx.rank}: no flag {name} within 60 s"
        time.sleep(0.01)


_CALLS = {
    "barrier": lambda pg: pg.barrier(),
    "all_reduce": lambda pg: pg.all_reduce(torch.ones(1000)),
    "broadcast": lambda pg: pg.broadcast(torch.ones(1000), 0),
}


def _a_dead_rank_and_a_late_one(ctx: RankContext) -> dict:
    groups = {call: named_group(ctx, f"late-{call}") for call in _CALLS}
    teardown = named_group(ctx, "teardown")
    if ctx.rank == 2:
        os._exit(3)
    seen = {}
    for call, pg in groups.items():
        if ctx.rank == 1:
            # Rank 0 comes only once rank 1 gave up: rank 1 must not wait for it.
            seen[call] = raises(dist.DistBackendError, ".", _CALLS[call], pg)
            open(_flag(ctx, call), "w").close()
        else:
            _wait_for_flag(ctx, call)
            seen[call] = raises(dist.DistBackendError, ".", _CALLS[call], pg)
    # Rank 0 learns that rank 2 died (its send fails) and destroys its group
    # while rank 1 waits for a message from it: rank 1 is told of rank 2.
    if ctx.rank == 0:
        teardown.send(torch.ones(2), 1, 7)
        raises(dist.DistBackendError, "exited", teardown.send, torch.ones(2), 2, 7)
        teardown.shutdown()
    else:
        teardown.recv(torch.zeros(2), 0, 7)
        seen["teardown"] = raises(dist.DistBackendError, ".", teardown.recv, torch.zeros(2), 0, 7)
    return seen


def test_a_dead_rank_is_named_while_a_live_one_is_late_and_wins_over_teardowns():
    pool = Ranks(3)
    try:
        seen0, seen1, died = pool.run_each([_a_dead_rank_and_a_late_one] * 3, allow_dead=True)
        assert isinstance(died, Died) and died.exitcode == 3
        dead = f"rank 2 (pid {pool.pid(2)}) exited"
        for call in _CALLS:
            assert f"{dead} before it arrived at {call} #1; rank 1 was waiting for rank 0" in \
                seen1[call], seen1[call]
            # Rank 0 came late and hears why rank 1 gave up, or sees rank 2 itself.
            assert dead in seen0[call], seen0[call]
        assert f"{dead}; then rank 0 destroyed its process group" in seen1["teardown"], seen1
    finally:
        pool.close()


def _channel_survivor(ctx: RankContext, port: int, victim_pid: int) -> tuple:
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=MINUTE)
    pg = group_on(ctx, store, name="channel")
    note = ctx.store_path("victim's channel")
    deadline = time.monotonic() + 30
    while not os.path.exists(note) or not process_exited(victim_pid):
        assert time.monotonic() < deadline, "rank 1 did not make its channel and die"
        time.sleep(0.01)
    with open(note) as f:
        segment = f.read()
    left = segment_exists(segment)  # rank 1 made it and died before rank 0 mapped it
    # The store went with rank 1, and the group is still referenced: its
    # shutdown alone removes the channel.
    pg.shutdown()
    return left, segment_exists(segment)


def _channel_victim(ctx: RankContext, port: int, victim_pid: int) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False,
                          timeout=MINUTE)
    pg = group_on(ctx, store, name="channel")
    before = set(pyddp_segments())
    pg.isend(torch.ones(1000), 0)  # makes the channel to rank 0, which never receives
    made = sorted(set(pyddp_segments()) - before)
    assert len(made) == 1, made
    note = ctx.store_path("victim's channel")
    with open(note + ".tmp", "w") as f:
        f.write("/" + made[0])
    os.rename(note + ".tmp", note)
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_channel_whose_sender_died_with_the_store_is_reclaimed_by_its_receiver():
    pool = Ranks(2)
    try:
        reclaimed, died = pool.run_each([_channel_survivor, _channel_victim], free_port(),
                                        pool.pid(1), allow_dead=True, timeout=60)
    finally:
        pool.close()
    assert isinstance(died, Died) and died.exitcode == -signal.SIGKILL, died
    assert reclaimed == (True, False), reclaimed


def _receiver_of_a_dead_store_host(ctx: RankContext, port: int, victim_pid: int) -> tuple:
    """Rank 0 takes what rank 1 sent before it died with the store, then waits for more;
    rank 2 waits for a message rank 1 never sent it. Their messages."""
    store = dist.TCPStore("127.0.0.1", port, 3, is_master=False, timeout=MINUTE)
    pg = group_on(ctx, store, name="dead store host")
    deadline = time.monotonic() + 30
    while not os.path.exists(ctx.store_path("sent")) or not process_exited(victim_pid):
        assert time.monotonic() < deadline, "rank 1 did not send and die"
        time.sleep(0.01)
    if ctx.rank == 0:
        got = torch.zeros(1000)
        pg.recv(got, 1, tag=5)
        assert torch.equal(got, torch.full((1000,), 3.0)), got
        return raises(dist.DistBackendError, "exited", pg.recv, torch.zeros(1), 1, tag=6)
    return raises(dist.DistBackendError, "exited", pg.recv, torch.zeros(1), 1)


def _sender_that_hosts_the_store(ctx: RankContext, port: int, victim_pid: int) -> None:
    store = dist.TCPStore("127.0.0.1", port, 3, is_master=True, wait_for_workers=False,
                          timeout=MINUTE)
    pg = group_on(ctx, store, name="dead store host")
    pg.isend(torch.full((1000,), 3.0), 0, tag=5)  # makes the channel to rank 0 and fills it
    # The send completes only once rank 0 takes it: the progress thread posts the message
    # within milliseconds (even under a sanitizer); a second leaves it ample room.
    time.sleep(1.0)
    with open(ctx.store_path("sent"), "w"):
        pass
    os.kill(os.getpid(), signal.SIGKILL)


def test_receivers_of_a_rank_that_died_with_the_store_are_told_it_exited():
    # The receivers find rank 1's channels by name, not through the dead store: rank 0
    # still gets what rank 1 sent, and both hear that rank 1 exited, not the store's
    # "Failed to recv, got 0 bytes".
    pool = Ranks(3)
    try:
        results = pool.run_each([_receiver_of_a_dead_store_host, _sender_that_hosts_the_store,
                                 _receiver_of_a_dead_store_host], free_port(), pool.pid(1),
                                allow_dead=True, timeout=60)
        pid = pool.pid(1)
    finally:
        pool.close()
    assert isinstance(results[1], Died), results
    assert (f"rank 0: recv from rank 1 (tag 6, 4 bytes of float32) cannot complete: rank 1 "
            f"(pid {pid}) exited") in results[0], results
    assert (f"rank 2: receives from rank 1 cannot complete: rank 1 (pid {pid}) exited before it "
            "made its channel to this rank") in results[2], results
