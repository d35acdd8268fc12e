"""Registered memory: CPU tensors that the other ranks of this host read where they lie.

A collective on CPU tensors normally copies each rank's data into shared memory (a staging
buffer or ring slot) for the peers to read. A tensor made by :func:`empty` already lies in
memory the peers can map (an anonymous memfd per tensor, reached through
``/proc/<pid>/fd``), so ``all_gather`` and ``broadcast`` of 64 KiB to 8 MiB per rank, and
``all_reduce`` of 512 KiB to 8 MiB, read it in place when every tensor they read is registered,
as NCCL's user-buffer registration does for GPUs: one copy fewer, at the price of one meeting
more (two for ``all_reduce``), which is why the other sizes keep the staged path. A collective whose tensors are not all registered runs
as it would without them, with the same result.

Allocate registered tensors once and reuse them (DDP's buckets are such tensors): each one
costs a few system calls to make and holds a file descriptor while it lives, and a peer keeps
up to 64 of a rank's registered allocations mapped per group after their last use, so memory freed on one rank is returned once its peers have
mapped newer ones or left the group.
"""

from typing import Optional, Sequence, Union

import torch

from . import _C

__all__ = ["empty", "is_registered"]


def empty(*size: Union[int, Sequence[int]], dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """A contiguous CPU tensor of ``size`` in registered memory, zero-filled, as
    ``torch.empty(*size, dtype=dtype)`` otherwise (``dtype`` defaults to torch's default)."""
    if len(size) == 1 and isinstance(size[0], (list, tuple, torch.Size)):
        size = tuple(size[0])
    if not all(isinstance(d, int) for d in size):
        raise TypeError(f"pyddp.empty: size must be ints or one sequence of ints, got {size!r}")
    return _C.empty_registered(list(size), dtype or torch.get_default_dtype())


def is_registered(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a contiguous CPU tensor wholly in registered memory (made by
    :func:`empty`, or a contiguous view of one)."""
    return bool(_C.is_registered(tensor))
