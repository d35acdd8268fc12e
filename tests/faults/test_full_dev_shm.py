"""A /dev/shm too small: making a group fails saying so and what to lower, and a sender
that cannot make its channel tells its receiver why, at once; the pair goes on once the
channel can be made. Each /dev/shm is a small tmpfs in a private mount namespace.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

import pyddp
from harness import RankContext, raises
from hosts import HostRanks
from paths import REPO
from pyddp import _launch
from shm_groups import MINUTE, SHM

pytestmark = pytest.mark.multiprocess


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
        env=dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])))
    assert run.returncode == 1, run.stderr
    assert re.search(r"rank 0: allocating a \d+-byte shm segment failed: No space left on "
                     r"device \(is /dev/shm large enough\? lower PYDDP_SLOT_BYTES or "
                     r"PYDDP_NUM_SLOTS\)", run.stderr), run.stderr


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
