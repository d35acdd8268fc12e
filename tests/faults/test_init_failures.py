"""A rank that dies, never comes or is refused while the group is made: the others fail
naming it (not torch's "1/2 clients joined"), at once once its pid is known, else at the
timeout; every rank gets a refusal even when the store's host leaves first; nothing is
left in /dev/shm. Each death happens at a known bootstrap step: a store kills its own
process there (fault_stores.Sabotage).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import re
import signal
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

import pyddp
from fault_stores import Recording, Sabotage
from harness import Died, RankContext, Ranks, pyddp_segments, raises
from shm_groups import MINUTE, SHM, SHORT, free_port, group_on, segment_exists


def test_rank_that_never_joins_is_named_and_nothing_is_left():
    path = tempfile.mktemp(prefix="pyddp-join-")
    before = set(pyddp_segments())
    start = time.monotonic()
    try:
        with pytest.raises(dist.DistBackendError, match="rank 1 did not join the process group"):
            pyddp.new_group("shm", store=dist.FileStore(path, 2), rank=0, world_size=2,
                            timeout=SHORT)
    finally:
        if os.path.exists(path):
            os.remove(path)
    assert time.monotonic() - start < 15
    assert set(pyddp_segments()) == before


def _join_alone_then_get_killed(path: str) -> None:
    pyddp.new_group("shm", store=dist.FileStore(path, 2), rank=0, world_size=2,
                    timeout=datetime.timedelta(seconds=60))


@pytest.mark.multiprocess
def test_rank_killed_while_waiting_for_peers_leaves_no_segment():
    path = tempfile.mktemp(prefix="pyddp-kill-")
    before = set(pyddp_segments())
    proc = mp.get_context("spawn").Process(target=_join_alone_then_get_killed, args=(path,))
    proc.start()
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # inside new_group, waiting for rank 1
        proc.kill()
        proc.join(30)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)
        if os.path.exists(path):
            os.remove(path)
    assert set(pyddp_segments()) == before


def _survivor(ctx: RankContext, path: str) -> tuple:
    store = Recording(dist.FileStore(path, ctx.world_size))
    start = time.monotonic()
    try:
        pg = group_on(ctx, store)
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
    group_on(ctx, store)


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


@pytest.mark.multiprocess
def test_rank_killed_after_publishing_connected_leaves_no_segment():
    # Rank 1 dies after its "connected" key and before unlinking its own
    # segment: the survivor, which has mapped it, removes its name.
    outcome, elapsed, own, dead = _init_death_pool(_victim_after_connected)
    assert outcome.startswith("connected: ") and "rank 1 (pid" in outcome, outcome
    assert not segment_exists(dead), f"rank 1's segment {dead} was left in {SHM}"
    assert not segment_exists(own)
    assert elapsed < 20, elapsed


@pytest.mark.multiprocess
def test_rank_killed_before_publishing_its_blob_is_named_at_once_and_leaves_no_segment():
    # Rank 1 dies between creating its segment and publishing its blob: only
    # its hello (pid, reserved name) is known. The survivor notices the death
    # long before its 60 s timeout and removes the reserved name.
    outcome, elapsed, own, dead = _init_death_pool(_victim_before_blob)
    assert "rank 1 (pid" in outcome and "exited before the process group was connected" in (
        outcome), outcome
    assert "rank 1 to publish its transport's blob" in outcome, outcome
    assert elapsed < 20, elapsed
    assert not segment_exists(dead), f"rank 1's segment {dead} was left in {SHM}"
    assert not segment_exists(own)


def test_ranks_that_never_reach_the_store_are_named():
    # tcp:// and env:// with rank 0 hosting the store: torch's store would
    # fail with "1/3 clients joined"; pyddp names the missing ranks.
    start = time.monotonic()
    url = f"tcp://127.0.0.1:{free_port()}"
    raises(dist.DistBackendError, r"ranks 1, 2 did not join the process group within 2000 ms",
            pyddp.new_group, "shm", init_method=url, rank=0, world_size=3,
            timeout=datetime.timedelta(seconds=2))
    assert time.monotonic() - start < 15


def test_env_rendezvous_names_the_missing_rank(monkeypatch):
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                       "RANK": "0", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    raises(dist.DistBackendError, r"^pyddp: rank 1 did not join the process group within",
            pyddp.new_group, "shm", timeout=datetime.timedelta(seconds=2))


def _geometry_with_store_host(ctx: RankContext, port: int) -> str:
    options = pyddp.GroupOptions()
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


@pytest.mark.multiprocess
def test_every_rank_gets_the_refusal_when_the_store_host_leaves_first(two):
    for message in two.run(_geometry_with_store_host, free_port()):
        assert re.search(r"slot_bytes (128 vs 256|256 vs 128)", message), message
