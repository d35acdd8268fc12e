"""Ctrl-C: a rank waiting in a collective, a receive, an all-to-all or for its peers to
join gets KeyboardInterrupt within a few milliseconds, and its peers learn at once that it
was interrupted; SIGINT to every rank of a running job ends each with one traceback and
leaves nothing in /dev/shm.
"""

from __future__ import annotations

import os
import signal
import textwrap
import threading
import time

import pytest
import torch
import torch.distributed as dist

import pyddp
from harness import RankContext, Ranks, raises
from script_ranks import next_line, script_ranks
from shm_groups import MINUTE, group_on, segment_exists

pytestmark = pytest.mark.multiprocess


def _make_group(ctx: RankContext, name: str) -> None:
    group_on(ctx, dist.FileStore(ctx.store_path(name), ctx.world_size), name=name)


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


def test_ctrl_c_of_the_whole_job():
    world = 3
    with script_ranks(JOB_SCRIPT, world, str(world)) as procs:
        segments = []
        for p in procs:
            line = next_line(p, 60)
            assert line.startswith("segment "), (line, p.poll())
            segments.append(line.split()[1])
            assert next_line(p, 60) == "running\n"
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
        assert not segment_exists(segment), segment
