"""shm groups that the error and fault tests make on every rank, and what they look at.

Each group is kept in ``ctx.groups`` under its name, so that the rank shuts it down
when the pool closes.
"""

from __future__ import annotations

import datetime
import os
import socket

import torch.distributed as dist

import pyddp
from harness import RankContext

SHORT = datetime.timedelta(seconds=2)
MINUTE = datetime.timedelta(seconds=60)
SHM = "/dev/shm"


def named_group(ctx: RankContext, name: str, timeout=datetime.timedelta(seconds=30)
                ) -> pyddp.ProcessGroup:
    """A group on a file store named after it."""
    store = dist.FileStore(ctx.store_path(name), ctx.world_size)
    pg = pyddp.new_group("shm", store=store, rank=ctx.rank, world_size=ctx.world_size,
                         timeout=timeout)
    ctx.groups[name] = pg
    return pg


def ring_group(ctx: RankContext, name: str, timeout: datetime.timedelta) -> pyddp.ProcessGroup:
    """A group that always uses the ring; each rank may pass its own timeout."""
    options = pyddp.GroupOptions()
    options.algo = pyddp.Algo.RING
    pg = pyddp.new_group("shm", store=dist.FileStore(ctx.store_path(name), ctx.world_size),
                         rank=ctx.rank, world_size=ctx.world_size, timeout=timeout,
                         options=options)
    ctx.groups[name] = pg
    return pg


def group_on(ctx: RankContext, store: dist.Store, timeout=MINUTE, options=None,
             name: str = "g") -> pyddp.ProcessGroup:
    """A group on the store given (one that records, forges or dies)."""
    pg = pyddp.new_group("shm", store=store, rank=ctx.rank, world_size=ctx.world_size,
                         timeout=timeout, options=options)
    ctx.groups[name] = pg
    return pg


def segment_exists(segment: str) -> bool:
    return os.path.exists(SHM + segment)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
