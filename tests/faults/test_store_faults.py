"""Stores that lie or refuse: a forged bootstrap blob (a segment's size, mode or layout,
another rank's segment) is refused on every rank, naming the forgery; a store that
refuses the key announcing a channel fails that send, leaves nothing, and the group
still moves messages.
"""

from __future__ import annotations

import datetime
import os
import re
import time

import pytest
import torch
import torch.distributed as dist

from fault_stores import Recording, Sabotage, forge_shm_blob, shm_blob_field
from harness import RankContext, pyddp_segments, raises
from shm_groups import MINUTE, SHM, group_on, segment_exists

pytestmark = pytest.mark.multiprocess


class _NoChannelAnnouncement(Recording):
    """Refuses to set the key that announces rank 0's channel to rank 1."""

    def set(self, key: str, value) -> None:
        if key.endswith("p2p/0-1"):
            raise RuntimeError("this store refuses the key")
        super().set(key, value)


def _unannounced_channel(ctx: RankContext) -> tuple:
    store = _NoChannelAnnouncement(dist.FileStore(ctx.store_path("announce"), 2))
    pg = group_on(ctx, store, timeout=datetime.timedelta(seconds=1), name="announce")
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
        return raises(Exception, ".", group_on, ctx, store, name=f"forge-{case}")
    finally:
        if ctx.rank == 1 and segment_exists(fake):
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
    assert re.search(refusal, message1), message1
    assert "forged store value" in message1, message1
    assert "rank 1 refused" in message0 and re.search(refusal, message0), message0
    assert not segment_exists(fake)
