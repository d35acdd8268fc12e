"""The benchmarked collectives, behind one small protocol.

A collective (all_gather, broadcast, reduce_scatter, ...) is added by writing
a Case class with a ``prepare`` factory, listing it in ``OPS`` and adding its
call to the Backend protocol; its busbw factor is in metrics.busbw_factor.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from pyddp.bench.backends import Backend


class Case(Protocol):
    """One collective on buffers of one size, with inputs that make its answer exact."""

    @property
    def count(self) -> int:
        """Elements per rank that the collective's size is counted in."""

    @property
    def nbytes(self) -> int:
        """The message size in bytes (``count`` whole elements)."""

    def reset(self) -> None:
        """Refills the inputs (collectives may work in place and overwrite them)."""

    def run(self, backend: Backend) -> None:
        """Runs the collective once on ``backend``."""

    def count_wrong(self) -> int:
        """Elements of this rank's output that differ from the expected answer.

        Valid right after ``reset`` followed by one ``run``.
        """


@dataclass
class AllReduceCase:
    """In-place SUM all-reduce of a tensor filled with ``rank + 1`` on every rank.

    Every element of the result is 1 + 2 + ... + n = n(n+1)/2, exact in every
    dtype for small n. Repeated runs re-reduce the previous result (the timed
    loop does not reset), so values grow and float types may reach inf there;
    ``count_wrong`` is only meaningful after ``reset`` and a single ``run``.
    """

    tensor: torch.Tensor
    rank: int
    world_size: int

    @classmethod
    def prepare(cls, nbytes: int, dtype: torch.dtype, rank: int, world_size: int
                ) -> "AllReduceCase":
        count = nbytes // dtype.itemsize
        case = cls(torch.empty(count, dtype=dtype), rank, world_size)
        case.reset()
        return case

    @property
    def count(self) -> int:
        return self.tensor.numel()

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def reset(self) -> None:
        self.tensor.fill_(self.rank + 1)

    def run(self, backend: Backend) -> None:
        backend.all_reduce(self.tensor)

    def count_wrong(self) -> int:
        expected = self.world_size * (self.world_size + 1) // 2
        return int(torch.count_nonzero(self.tensor != expected))


CaseFactory = Callable[[int, torch.dtype, int, int], Case]
"""``prepare(nbytes, dtype, rank, world_size)``: buffers for a message of about ``nbytes``."""

OPS: dict[str, CaseFactory] = {
    "all_reduce": AllReduceCase.prepare,
}
