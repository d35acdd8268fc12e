"""Faults: ranks that die, are interrupted or are lied to, and callers that misuse a group.

Each test reproduces a defect found by adversarial testing deterministically
(a store that kills its own process at one bootstrap step, forges a value or
stalls; a signal sent at a known point) and checks what every rank sees
afterwards, with bounded waits, and that nothing is left in /dev/shm.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

import pyddp
from fault_stores import Recording, Sabotage, forge_shm_blob, shm_blob_field
from harness import Died, RankContext, Ranks, process_exited, pyddp_segments, raises
from hosts import HostRanks
from pyddp import _launch

MINUTE = datetime.timedelta(seconds=60)
SHM = "/dev/shm"


def _exists(segment: str) -> bool:
    return os.path.exists(SHM + segment)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _group(ctx: RankContext, store: dist.Store, timeout=MINUTE, options=None,
           name: str = "g") -> pyddp.ProcessGroup:
    pg = pyddp.new_group("shm", store=store, rank=ctx.rank, world_size=ctx.world_size,
                         timeout=timeout, options=options)
    ctx.groups[name] = pg
    return pg


# --- 1 and 5: a rank that dies during init --------------------------------------


def _survivor(ctx: RankContext, path: str) -> tuple:
    store = Recording(dist.FileStore(path, ctx.world_size))
    start = time.monotonic()
    try:
        pg = _group(ctx, store)
    except dist.DistBackendError as error:
        outcome = str(error)
    else:
        outcome = "connected: " + raises(dist.DistBackendError, "exited", pg.all_reduce,
                                          torch.ones(10))
    elapsed = time.monotonic() - start
    return outcome, elapsed, store.reservation(0), store.reservation(1)


def _victim(ctx: RankContext, path: str, kill_before: str, kill_after: str) -> None:
    store = Sabotage(dist.FileStore(path, ctx.world_size), kill_before=kill_before,
                     kill_after=kill_after)
    _group(ctx, store)


def _victim_after_connected(ctx, path):
    _victim(ctx, path, "", "/connected/1")


def _victim_before_blob(ctx, path):
    _victim(ctx, path, "/blob/1", "")


def _init_death_pool(victim) -> tuple:
    pool = Ranks(2)
    try:
        path = os.path.join(pool.tmpdir, "store")
        survivor, died = pool.run_each([_survivor, victim], path, allow_dead=True, timeout=60)
    finally:
        pool.close()
    assert isinstance(died, Died) and died.exitcode == -signal.SIGKILL, died
    return survivor


def test_rank_killed_after_publishing_connected_leaves_no_segment():
    # Rank 1 dies after its "connected" key and before unlinking its own
    # segment: the survivor, which has mapped it, removes its name.
    outcome, elapsed, own, dead = _init_death_pool(_victim_after_connected)
    assert outcome.startswith("connected: ") and "rank 1 (pid" in outcome, outcome
    assert not _exists(dead), f"rank 1's segment {dead} was left in {SHM}"
    assert not _exists(own)
    assert elapsed < 20, elapsed


def test_rank_killed_before_publishing_its_blob_is_named_at_once_and_leaves_no_segment():
    # Rank 1 dies between creating its segment and publishing its blob: only
    # its hello (pid, reserved name) is known. The survivor notices the death
    # long before its 60 s timeout and removes the reserved name.
    outcome, elapsed, own, dead = _init_death_pool(_victim_before_blob)
    assert "rank 1 (pid" in outcome and "exited before the process group was connected" in (
        outcome), outcome
    assert "rank 1 to publish its transport's blob" in outcome, outcome
    assert elapsed < 20, elapsed
    assert not _exists(dead), f"rank 1's segment {dead} was left in {SHM}"
    assert not _exists(own)


def _channel_survivor(ctx: RankContext, port: int, victim_pid: int) -> tuple:
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=MINUTE)
    pg = _group(ctx, store, name="channel")
    note = ctx.store_path("victim's channel")
    deadline = time.monotonic() + 30
    while not os.path.exists(note) or not process_exited(victim_pid):
        assert time.monotonic() < deadline, "rank 1 did not make its channel and die"
        time.sleep(0.01)
    with open(note) as f:
        segment = f.read()
    left = _exists(segment)  # rank 1 made it and died before rank 0 mapped it
    # The store went with rank 1, and the group is still referenced: its
    # shutdown alone removes the channel.
    pg.shutdown()
    return left, _exists(segment)


def _channel_victim(ctx: RankContext, port: int, victim_pid: int) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False,
                          timeout=MINUTE)
    pg = _group(ctx, store, name="channel")
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
        reclaimed, died = pool.run_each([_channel_survivor, _channel_victim], _free_port(),
                                        pool.pid(1), allow_dead=True, timeout=60)
    finally:
        pool.close()
    assert isinstance(died, Died) and died.exitcode == -signal.SIGKILL, died
    assert reclaimed == (True, False), reclaimed


def _receiver_of_a_dead_store_host(ctx: RankContext, port: int, victim_pid: int) -> tuple:
    """Rank 0 takes what rank 1 sent before it died with the store, then waits for more;
    rank 2 waits for a message rank 1 never sent it. Their messages."""
    store = dist.TCPStore("127.0.0.1", port, 3, is_master=False, timeout=MINUTE)
    pg = _group(ctx, store, name="dead store host")
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
    pg = _group(ctx, store, name="dead store host")
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
                                 _receiver_of_a_dead_store_host], _free_port(), pool.pid(1),
                                allow_dead=True, timeout=60)
        pid = pool.pid(1)
    finally:
        pool.close()
    assert isinstance(results[1], Died), results
    assert (f"rank 0: recv from rank 1 (tag 6, 4 bytes of float32) cannot complete: rank 1 "
            f"(pid {pid}) exited") in results[0], results
    assert (f"rank 2: receives from rank 1 cannot complete: rank 1 (pid {pid}) exited before it "
            "made its channel to this rank") in results[2], results


def _destroyed_with_a_pending_send(ctx: RankContext) -> tuple:
    pg = _group(ctx, dist.FileStore(ctx.store_path("pending"), 2), name="pending")
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


def test_ranks_that_never_reach_the_store_are_named():
    # tcp:// and env:// with rank 0 hosting the store: torch's store would
    # fail with "1/3 clients joined"; pyddp names the missing ranks.
    start = time.monotonic()
    url = f"tcp://127.0.0.1:{_free_port()}"
    raises(dist.DistBackendError, r"ranks 1, 2 did not join the process group within 2000 ms",
            pyddp.new_group, "shm", init_method=url, rank=0, world_size=3,
            timeout=datetime.timedelta(seconds=2))
    assert time.monotonic() - start < 15


def test_env_rendezvous_names_the_missing_rank(monkeypatch):
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
                       "RANK": "0", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    raises(dist.DistBackendError, r"^pyddp: rank 1 did not join the process group within",
            pyddp.new_group, "shm", timeout=datetime.timedelta(seconds=2))


# --- a channel that cannot be announced ----------------------------------------------


class _NoChannelAnnouncement(Recording):
    """Refuses to set the key that announces rank 0's channel to rank 1."""

    def set(self, key: str, value) -> None:
        if key.endswith("p2p/0-1"):
            raise RuntimeError("this store refuses the key")
        super().set(key, value)


def _unannounced_channel(ctx: RankContext) -> tuple:
    store = _NoChannelAnnouncement(dist.FileStore(ctx.store_path("announce"), 2))
    pg = _group(ctx, store, timeout=datetime.timedelta(seconds=1), name="announce")
    try:
        if ctx.rank == 1:
            store.wait(["go"], MINUTE)
            pg.send(torch.full((4,), 7.0), 0, 3)
            return ()
        before = pyddp_segments()
        message = raises(Exception, "this store refuses the key", pg.send, torch.ones(4), 1)
        after = pyddp_segments()
        # Past the failed send's timeout, the group still moves messages: nothing of
        # the failed send is left for the wait below to time out on.
        time.sleep(1.5)
        store.set("go", b"1")
        got = torch.zeros(4)
        pg.recv(got, 1, 3)
        return message, before, after, got.tolist()
    finally:
        pg.shutdown()


def test_a_send_whose_channel_cannot_be_announced_fails_and_leaves_nothing(two):
    message, before, after, got = two.run(_unannounced_channel)[0]
    assert "this store refuses the key" in message, message
    assert after == before, (before, after)
    assert got == [7.0] * 4


# --- 3: forged store values ----------------------------------------------------------


def _forged(ctx: RankContext, case: str, fake: str) -> str:
    """Rank 1 reads rank 0's blob through a forger; returns what each rank raised."""
    inner = dist.FileStore(ctx.store_path(f"forge-{case}"), ctx.world_size)
    if ctx.rank == 0:
        store = inner
    else:
        def forger(outcome: bytes) -> bytes:
            size = int(shm_blob_field(outcome, "bytes"))
            if case == "small":
                return forge_shm_blob(outcome, bytes=str(size - 4096))
            if case == "large":
                return forge_shm_blob(outcome, bytes=str(size + 4096))
            if case == "layout":
                return forge_shm_blob(outcome, layout="4")
            if case in ("mode", "size", "header"):
                length = {"size": size + 64}.get(case, size)
                fd = os.open(SHM + fake, os.O_CREAT | os.O_EXCL | os.O_RDWR,
                             0o644 if case == "mode" else 0o600)
                os.fchmod(fd, 0o644 if case == "mode" else 0o600)  # whatever the umask
                os.ftruncate(fd, length)
                os.close(fd)
                return forge_shm_blob(outcome, segment=fake)
            # "own": rank 0's blob names rank 1's own segment
            return forge_shm_blob(outcome, segment=store.reservation(1))
        store = Sabotage(inner, forge="/blob/0", forger=forger)
    try:
        return raises(Exception, ".", _group, ctx, store, name=f"forge-{case}")
    finally:
        if ctx.rank == 1 and _exists(fake):
            os.remove(SHM + fake)


@pytest.mark.parametrize("case, refusal", [
    ("small", r"rank 0's shm blob says its segment has \d+ bytes, but its geometry makes"),
    ("large", r"rank 0's shm blob says its segment has \d+ bytes, but its geometry makes"),
    ("mode", r"refusing rank 0's shm segment /pyddp-\w+: its mode is 0644, not 0600"),
    ("size", r"refusing rank 0's shm segment /pyddp-\w+: it has \d+ bytes, and this geometry"),
    ("header", r"rank 0's shm segment has an unexpected layout"),
    ("layout", r"rank 0's shm bootstrap blob has layout 4, this rank's \d+ \(different pyddp "
               r"versions"),
    ("own", r"named by rank 0's blob is rank 1's .*not rank 0's"),
])
def test_forged_blobs_are_refused_on_every_rank(two, case, refusal):
    fake = f"/pyddp-{os.getpid():x}{case.encode().hex()}"
    message0, message1 = two.run(_forged, case, fake)
    assert re_search(refusal, message1), message1
    assert "forged store value" in message1, message1
    assert "rank 1 refused" in message0 and re_search(refusal, message0), message0
    assert not _exists(fake)


def re_search(pattern: str, text: str) -> bool:
    import re
    return re.search(pattern, text) is not None


def test_segment_checks():
    problem = pyddp._C._testing.shm_segment_problem
    me = os.geteuid()
    assert problem(me, stat.S_IFREG | 0o600, 4096, 4096, me) == ""
    assert problem(me + 1, stat.S_IFREG | 0o600, 4096, 4096, me) == (
        f"it belongs to uid {me + 1}, not to this process's uid {me}")
    assert problem(me, stat.S_IFREG | 0o640, 4096, 4096, me) == "its mode is 0640, not 0600"
    assert problem(me, stat.S_IFREG | 0o4600, 4096, 4096, me) == "its mode is 04600, not 0600"
    assert problem(me, stat.S_IFREG | 0o600, 4095, 4096, me) == (
        "it has 4095 bytes, and this geometry makes 4096")
    name = pyddp._C._testing.is_segment_name
    assert name("/pyddp-0123abcdef") and not name("/pyddp-") and not name("/pyddp-x1")
    assert not name("/other-01") and not name("/pyddp-01/../x")


# --- /dev/shm too small --------------------------------------------------------------


def test_a_dev_shm_too_small_for_the_segments_is_said_with_the_fix(tmp_path):
    from pyddp import _launch
    why_not = _launch.simulated_hosts_unavailable()
    if why_not is not None:
        pytest.skip(f"a private /dev/shm: {why_not}")
    script = textwrap.dedent(f"""
        import datetime
        import torch.distributed as dist
        import pyddp
        pyddp.create_group("shm", store=dist.FileStore({str(tmp_path / "store")!r}, 1), rank=0,
                           world_size=1, timeout=datetime.timedelta(seconds=30))
    """)
    # A tmpfs of 64 KiB on /dev/shm, seen by this process alone.
    run = subprocess.run(
        [*_launch.UNSHARE, "sh", "-c",
         'mount -t tmpfs -o size=64k tmpfs /dev/shm && exec "$0" -c "$1"', sys.executable,
         script], capture_output=True, text=True, timeout=120,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(
            [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
             os.environ.get("PYTHONPATH", "")])))
    assert run.returncode == 1, run.stderr
    assert re_search(r"rank 0: allocating a \d+-byte shm segment failed: No space left on "
                     r"device \(is /dev/shm large enough\? lower PYDDP_SLOT_BYTES or "
                     r"PYDDP_NUM_SLOTS\)", run.stderr), run.stderr


# --- 6: a refusal while the store's host leaves -----------------------------------


def _geometry_with_store_host(ctx: RankContext, port: int) -> str:
    options = pyddp.RingOptions()
    options.slot_bytes = 128 * (ctx.rank + 1)
    if ctx.rank == 0:
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False,
                              timeout=MINUTE)
    else:
        # Rank 1 reads rank 0's outcome late: rank 0 must still be serving it.
        store = Sabotage(dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=MINUTE),
                         slow="/connected/0", delay=1.0)
    message = raises(ValueError, "use different shm geometry", pyddp.new_group, "shm",
                      store=store, rank=ctx.rank, world_size=2, timeout=MINUTE, options=options)
    del store  # rank 0 stops serving the store at once
    return message


def test_every_rank_gets_the_refusal_when_the_store_host_leaves_first(two):
    for message in two.run(_geometry_with_store_host, _free_port()):
        assert re_search(r"slot_bytes (128 vs 256|256 vs 128)", message), message


# --- 4: Ctrl-C -------------------------------------------------------------------------


def _make_group(ctx: RankContext, name: str) -> None:
    _group(ctx, dist.FileStore(ctx.store_path(name), ctx.world_size), name=name)


def _interrupted(ctx: RankContext, how: str) -> tuple:
    pg = ctx.groups[f"int-{how}"]
    if ctx.rank == 1:
        time.sleep(3.0)  # rank 0 is interrupted at 1 s
        if how == "queued":
            pg.barrier()  # the calls rank 0 makes: rank 0 arrived at it, then gave up
        start = time.monotonic()
        message = raises(dist.DistBackendError, "rank 0 gave up", pg.all_reduce, torch.ones(10))
        return message, time.monotonic() - start
    start = time.monotonic()
    try:
        if how == "inline":
            pg.all_reduce(torch.ones(10))
        elif how == "work":
            pg.all_reduce(torch.ones(10), async_op=True).wait()
        else:  # a synchronous call queued behind an asynchronous one
            pg.barrier(async_op=True)
            pg.all_reduce(torch.ones(10))
    except KeyboardInterrupt:
        elapsed = time.monotonic() - start
    else:
        raise AssertionError("rank 0 was not interrupted")
    later = raises(dist.DistBackendError, "interrupted", pg.all_reduce, torch.ones(10))
    return later, elapsed


@pytest.mark.parametrize("how", ["inline", "work", "queued"])
def test_ctrl_c_interrupts_a_waiting_rank_and_its_peers_learn_at_once(two, how):
    two.run(_make_group, f"int-{how}")
    timer = threading.Timer(1.0, os.kill, args=(two.pid(0), signal.SIGINT))
    timer.start()
    try:
        (later0, elapsed0), (message1, elapsed1) = two.run(_interrupted, how, timeout=60)
    finally:
        timer.cancel()
    assert elapsed0 < 2.0, elapsed0  # sent at about 1 s
    assert "interrupted" in message1 and elapsed1 < 1.0, (message1, elapsed1)
    assert "refused: an earlier collective failed" in later0, later0


def _interrupted_in_messages(ctx: RankContext, how: str) -> tuple:
    """Rank 0 is interrupted in a recv that rank 1 has not sent yet, or inside an
    all-to-all (a collective of messages) that rank 1 has not entered yet."""
    pg = ctx.groups[f"int-{how}"]
    if ctx.rank == 1:
        time.sleep(3.0)  # rank 0 is interrupted at 1 s
        start = time.monotonic()
        if how == "recv":
            pg.send(torch.full((4,), 7.0), 0)
            return "sent", time.monotonic() - start
        message = raises(dist.DistBackendError, "rank 0 gave up", pg.all_to_all_single,
                          torch.zeros(2), torch.ones(2))
        return message, time.monotonic() - start
    start = time.monotonic()
    try:
        if how == "recv":
            pg.recv(torch.zeros(4), 1)
        else:
            pg.all_to_all_single(torch.zeros(2), torch.ones(2))
    except KeyboardInterrupt:
        elapsed = time.monotonic() - start
    else:
        raise AssertionError("rank 0 was not interrupted")
    if how == "recv":
        # Nothing of the interrupted recv had moved: the pair's channel still works.
        t = torch.zeros(4)
        pg.recv(t, 1)
        return t.tolist(), elapsed
    return raises(dist.DistBackendError, "interrupted", pg.all_reduce, torch.ones(10)), elapsed


@pytest.mark.parametrize("how", ["recv", "all_to_all"])
def test_ctrl_c_interrupts_a_rank_waiting_for_messages(two, how):
    two.run(_make_group, f"int-{how}")
    timer = threading.Timer(1.0, os.kill, args=(two.pid(0), signal.SIGINT))
    timer.start()
    try:
        (result0, elapsed0), (result1, elapsed1) = two.run(_interrupted_in_messages, how,
                                                           timeout=60)
    finally:
        timer.cancel()
    assert elapsed0 < 2.0, elapsed0  # sent at about 1 s
    assert elapsed1 < 1.0, (result1, elapsed1)
    if how == "recv":
        assert result0 == [7.0] * 4 and result1 == "sent", (result0, result1)
    else:
        assert "interrupted" in result1, result1
        assert "refused: an earlier collective failed" in result0, result0


def _interrupted_in_bootstrap(ctx: RankContext, path: str) -> float:
    start = time.monotonic()
    try:
        pyddp.new_group("shm", store=dist.FileStore(path, 2), rank=0, world_size=2,
                        timeout=MINUTE)
    except KeyboardInterrupt:
        return time.monotonic() - start
    raise AssertionError("rank 0 was not interrupted")


def test_ctrl_c_interrupts_a_rank_waiting_for_its_peers_to_join():
    pool = Ranks(1)
    timer = threading.Timer(1.0, os.kill, args=(pool.pid(0), signal.SIGINT))
    timer.start()
    try:
        elapsed, = pool.run(_interrupted_in_bootstrap, os.path.join(pool.tmpdir, "s"),
                            timeout=60)
    finally:
        timer.cancel()
        pool.close()
    assert elapsed < 2.0, elapsed


# --- 7: destroying a group tells the peers --------------------------------------------


def _destroy_while_peer_waits(ctx: RankContext) -> tuple:
    pg = _group(ctx, dist.FileStore(ctx.store_path("destroy"), 2), name="destroy")
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


# --- 8: argument checks -----------------------------------------------------------------


def test_arguments_are_checked_like_torch():
    pg = pyddp.new_group("shm", store=dist.HashStore(), rank=0, world_size=1)
    try:
        raises(ValueError, r"rank 0: broadcast: src=1099511627776 is not a rank of this group",
                pg.broadcast, torch.ones(2), 2**40)
        raises(ValueError, r"rank 0: broadcast: src=-1 is not a rank", pg.broadcast,
                torch.ones(2), -1)
        raises(TypeError, "broadcast: src must be an int", pg.broadcast, torch.ones(2), 0.0)
        raises(TypeError, "broadcast: src must be an int", pg.broadcast, torch.ones(2), True)
        for src in (np.int64(0), np.uint8(0), torch.tensor(0)):
            t = torch.arange(3.0)
            pg.broadcast(t, src)
            assert t.tolist() == [0.0, 1.0, 2.0]
        for op in (0, 4, "SUM", None):
            raises(TypeError, r"rank 0: all_reduce: op must be a ReduceOp", pg.all_reduce,
                    torch.ones(2), op)
        raises(TypeError, r"reduce_scatter_single: op must be a ReduceOp",
                pg.reduce_scatter_single, torch.ones(1), torch.ones(1), 0)
        work = pg.all_reduce(torch.ones(2), async_op=True)
        for bad in (datetime.timedelta(seconds=-1), datetime.timedelta(0)):
            raises(ValueError, "timeout must be positive", work.wait, bad)
        raises(TypeError, "timeout must be a datetime.timedelta", work.wait, 5)
        assert work.wait(datetime.timedelta(seconds=30))
        assert work.result()[0].tolist() == [1.0, 1.0]
    finally:
        pg.shutdown()


# --- 9: one thread at a time ---------------------------------------------------------------


def _two_threads(ctx: RankContext) -> list:
    pg = _group(ctx, dist.FileStore(ctx.store_path("threads"), 2), name="threads")
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


# --- 2: destroy inside a future callback, then exit -------------------------------------

CALLBACK_SCRIPT = textwrap.dedent("""
    import sys, time
    import torch, torch.distributed as dist
    import pyddp

    rank, path = int(sys.argv[1]), sys.argv[2]
    pyddp.init_process_group("shm", store=dist.FileStore(path, 2), rank=rank, world_size=2)

    class SlowToDrop:
        def __del__(self):
            time.sleep(0.5)  # GIL released: the main thread reaches exit meanwhile

    def make_callback():
        keep = SlowToDrop()

        def callback(fut):
            assert keep is not None
            pyddp.destroy_process_group()
            return fut.value()
        return callback

    # The worker drops the callback (and SlowToDrop) after completing the
    # future that the main thread waits for.
    fut = pyddp.all_reduce(torch.ones(4), async_op=True).get_future().then(make_callback())
    print("sum", fut.wait()[0][0].item(), flush=True)
""")


def _script_env() -> dict:
    """Scripts import pyddp from this tree and fault_stores from tests/."""
    here = os.path.dirname(os.path.abspath(__file__))
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(here), here] + [p for p in sys.path if p]))


@contextlib.contextmanager
def _script_ranks(script: str, world: int, *args: str):
    """``world`` interpreters running ``script`` with the arguments rank, a store
    path and ``args`` (stdin a pipe); every one killed and the store removed on the way
    out."""
    path = tempfile.mktemp(prefix="pyddp-faults-")
    # SIGINT as a foreground job has it (see harness._rank_main).
    procs = [subprocess.Popen([sys.executable, "-c", script, str(r), path, *args],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=_script_env(),
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
             for r in range(world)]
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        if os.path.exists(path):
            os.remove(path)


def _run_ranks(script: str, world: int, timeout: float) -> list:
    with _script_ranks(script, world) as procs:
        return [p.communicate(timeout=timeout) + (p.returncode,) for p in procs]


def test_destroy_inside_a_future_callback_then_exit_is_clean():
    for out, err, code in _run_ranks(CALLBACK_SCRIPT, 2, 120):
        assert code == 0 and "sum 2.0" in out, (code, out, err)
        assert "terminate called" not in err and "Fatal Python error" not in err, err


# --- 3: exit without destroying the groups ---------------------------------------------

# Rank 0 leaves a message rank 1 never receives on a torch.distributed "pyddp" group
# and on one of pyddp's own, then exits without destroying either; rank 1 waits for
# its word (stdin) to exit the same way. A reference nothing drops keeps both groups
# alive to the end of each process, as torch does with its groups under torch 2.14.
EXIT_SCRIPT = textwrap.dedent("""
    import ctypes, datetime, sys
    import torch, torch.distributed as dist
    import pyddp

    rank, path, own_path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("gloo", store=dist.FileStore(path, 2), rank=rank, world_size=2,
                            timeout=timeout)
    torchs = dist.new_group(backend="pyddp")
    own = pyddp.new_group("shm", store=dist.FileStore(own_path, 2), rank=rank,
                          world_size=2, timeout=timeout)
    for group in (torchs, own):
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))
    if rank == 0:
        torchs.send([torch.ones(3)], 1, 0)
        pyddp.isend(torch.ones(3), 1, group=own)
    print("sent" if rank == 0 else "waiting", flush=True)
    if rank == 1:
        sys.stdin.readline()
""")


def test_a_rank_that_exits_without_destroying_its_groups_leaves_no_segment(tmp_path):
    before = set(pyddp_segments())
    with _script_ranks(EXIT_SCRIPT, 2, str(tmp_path / "own")) as procs:
        assert _readline(procs[1], 60) == "waiting\n"
        out, err = procs[0].communicate(timeout=60)
        assert procs[0].returncode == 0 and "sent" in out, (procs[0].returncode, out, err)
        # Rank 1 is still alive, so it has reclaimed nothing: rank 0's exit took its
        # channels (its sends' messages unreceived) out of /dev/shm.
        assert set(pyddp_segments()) == before
        out, err = procs[1].communicate("exit\n", timeout=60)
        assert procs[1].returncode == 0, (out, err)
    assert set(pyddp_segments()) == before


# --- Ctrl-C of the whole job ----------------------------------------------------------

JOB_SCRIPT = textwrap.dedent("""
    import datetime, sys, time
    import torch, torch.distributed as dist
    import pyddp
    from fault_stores import Recording

    rank, path, world = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    store = Recording(dist.FileStore(path, world))
    pyddp.init_process_group("shm", store=store, rank=rank, world_size=world,
                             timeout=datetime.timedelta(seconds=60))
    print("segment", store.reservation(rank), flush=True)
    step = 0
    while True:
        pyddp.all_reduce(torch.ones(50_000))
        work = pyddp.all_reduce(torch.ones(1000), async_op=True)
        work.get_future().then(lambda fut: fut.value())
        work.wait()
        if rank == step % world:
            time.sleep(0.01)  # the others wait for this rank inside a collective
        step += 1
        if step == 20:
            print("running", flush=True)
""")


def _readline(p: subprocess.Popen, timeout: float) -> str:
    """p's next line of output, or a failure after `timeout` seconds (a rank that hangs
    is killed by the caller's cleanup, which ends the reading thread)."""
    lines = []
    reader = threading.Thread(target=lambda: lines.append(p.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    assert lines, f"no output from pid {p.pid} within {timeout} s (exit code {p.poll()})"
    return lines[0]


def test_ctrl_c_of_the_whole_job():
    world = 3
    with _script_ranks(JOB_SCRIPT, world, str(world)) as procs:
        segments = []
        for p in procs:
            line = _readline(p, 60)
            assert line.startswith("segment "), (line, p.poll())
            segments.append(line.split()[1])
            assert _readline(p, 60) == "running\n"
        for p in procs:
            p.send_signal(signal.SIGINT)
        start = time.monotonic()
        results = [p.communicate(timeout=30) + (p.returncode,) for p in procs]
        elapsed = time.monotonic() - start
    assert elapsed < 10, elapsed
    for rank, (out, err, code) in enumerate(results):
        # An uncaught KeyboardInterrupt ends Python by SIGINT.
        assert code == -signal.SIGINT, (rank, code, err)
        assert err.count("Traceback") == 1 and "KeyboardInterrupt" in err, (rank, err)
        for bad in ("Exception in thread", "terminate called", "Fatal Python error",
                    "Exception ignored"):
            assert bad not in err, (rank, err)
    for segment in segments:
        assert not _exists(segment), segment


def _full_shm_sender(ctx: RankContext) -> str:
    """Rank 0 sends to rank 1 with its own /dev/shm full: a small tmpfs, filled, over it in
    its mount namespace (rank 1's is the host's). Then with it uncovered, the same send."""
    pg = pyddp.new_group("shm", store=dist.FileStore(ctx.store_path("full"), 2), rank=ctx.rank,
                         world_size=2, timeout=MINUTE)
    pg.barrier()
    got = ""
    if ctx.rank == 0:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", SHM], check=True)
        try:
            fd = os.open(os.path.join(SHM, "filler"), os.O_WRONLY | os.O_CREAT)
            try:
                with contextlib.suppress(OSError):
                    while True:
                        os.write(fd, b"\0" * 4096)
            finally:
                os.close(fd)
            got = raises(RuntimeError, "No space left on device", pg.send, torch.ones(8), 1)
        finally:
            subprocess.run(["umount", SHM], check=True)
    else:
        got = raises(dist.DistBackendError, "could not make its channel", pg.recv,
                     torch.zeros(8), 0)
    pg.barrier()
    # The channel can be made now: the pair goes on.
    t = torch.full((8,), 7.0) if ctx.rank == 0 else torch.zeros(8)
    if ctx.rank == 0:
        pg.send(t, 1)
    else:
        pg.recv(t, 0)
    assert torch.equal(t, torch.full((8,), 7.0)), t
    pg.shutdown()
    return got


@pytest.mark.skipif(_launch.simulated_hosts_unavailable() is not None,
                    reason="needs mount namespaces (root)")
def test_a_sender_whose_dev_shm_is_full_tells_its_receiver_why():
    # Both ranks on one simulated host: each in a mount namespace of its own, sharing its
    # /dev/shm, so that rank 0 alone can cover its /dev/shm with a full one.
    pool = HostRanks(["a", "a"])
    try:
        sender, receiver = pool.run(_full_shm_sender)
    finally:
        pool.close()
    assert "rank 0: allocating a" in sender and "No space left on device" in sender, sender
    # Rank 1 hears the cause at once, not "rank 0 has not sent it" at its timeout.
    assert ("rank 1: recv from rank 0 (tag 0, 32 bytes of float32) cannot complete: rank 0 "
            "could not make its channel to this rank: rank 0: allocating a") in receiver, receiver
    assert "No space left on device" in receiver, receiver
