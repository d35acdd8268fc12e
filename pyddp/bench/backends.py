"""The libraries under test, behind one small protocol.

A peer (MPI, DeepSpeed, NCCL, ...) is added by writing a class with the
Backend methods and an ``open`` factory, and listing it in ``BACKENDS``.
"""

import datetime
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

import pyddp


@dataclass(frozen=True)
class RankContext:
    """What a backend needs to join its group in one spawned rank."""

    rank: int
    world_size: int
    store_dir: str
    timeout: datetime.timedelta

    def store(self, name: str) -> dist.FileStore:
        """A FileStore named ``name`` in the run's temporary directory, shared by all ranks."""
        return dist.FileStore(os.path.join(self.store_dir, f"{name}.store"), self.world_size)


class Backend(Protocol):
    """A collective library as the timing loop sees it; every call blocks until done."""

    name: str

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sums ``tensor`` across ranks, in place."""

    def barrier(self) -> None:
        """Returns once every rank has entered the barrier."""

    def close(self) -> None:
        """Leaves the group and frees its resources."""


class PyddpBackend:
    """pyddp's shared-memory ProcessGroup."""

    name = "pyddp"

    def __init__(self, group: pyddp.ProcessGroup) -> None:
        self._group = group

    @classmethod
    def open(cls, ctx: RankContext) -> "PyddpBackend":
        group = pyddp.new_group("shm", store=ctx.store("pyddp"), rank=ctx.rank,
                                world_size=ctx.world_size, timeout=ctx.timeout)
        return cls(group)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        self._group.all_reduce(tensor)

    def barrier(self) -> None:
        self._group.barrier()

    def close(self) -> None:
        pyddp.destroy_process_group(self._group)


class GlooBackend:
    """torch.distributed's default group, which the worker creates with gloo.

    The same group carries the benchmark's bookkeeping (max of timings, sum of
    wrong counts), always outside the timed loops; the worker destroys it.
    """

    name = "gloo"

    @classmethod
    def open(cls, ctx: RankContext) -> "GlooBackend":
        if dist.get_backend() != "gloo":
            raise RuntimeError("the gloo backend needs the default group to be a gloo group")
        return cls()

    def all_reduce(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor)

    def barrier(self) -> None:
        dist.barrier()

    def close(self) -> None:
        """Nothing to do: the default group outlives the backends."""


BACKENDS: dict[str, Callable[[RankContext], Backend]] = {
    PyddpBackend.name: PyddpBackend.open,
    GlooBackend.name: GlooBackend.open,
}
