"""The benchmarked collectives: buffers, exact inputs and an independent reference.

Every rank's input is a closed-form function of (rank, element index) made of
small integers, so each rank can compute the expected output of any
collective by itself, in float64, without communicating; ``count_wrong``
compares against that. A collective is added by writing a Case class with a
``prepare`` factory, listing it in ``OPS``, giving peers a method for it and
its busbw factor in metrics.busbw_factor. A barrier moves no bytes: it is
timed once per run and checked by nothing (``SIZELESS_OPS``).
"""

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional, Protocol

import torch

import pyddp
from pyddp.bench.peers import Peer

REDOPS = ("sum", "prod", "min", "max", "avg")
"""Reduction operators, by their nccl-tests names."""

REDUCE_PERIOD = 5
"""Inputs of sum/min/max/avg are 1..REDUCE_PERIOD, so a sum over n ranks is at most 5n."""

PROD_PERIOD = 3
"""prod inputs are 2 on every PROD_PERIOD-th (index + rank) and 1 elsewhere: products stay small."""

DATA_PERIOD = 101
"""Inputs of the collectives that move data without reducing it are 1..DATA_PERIOD, distinct
between ranks for n < 101."""

SENTINEL = 0
"""Outputs are filled with this before a checked run; no expected value is 0."""

MEMORIES = ("torch", "registered", "symmetric")
"""Where a case's buffers come from, as a peer asks (``Peer.memory``): torch.empty, pyddp's
registered memory (pyddp.empty; CPU only) or torch's symmetric memory
(torch.distributed._symmetric_memory.empty; CUDA only), which a symm_mem peer needs."""


def exact_limit(dtype: torch.dtype) -> int:
    """The largest integer that ``dtype`` and every integer below it represent exactly."""
    if dtype.is_floating_point:
        # eps = 2**-mantissa_bits, and integers are exact up to 2**(mantissa_bits + 1).
        return round(2 / torch.finfo(dtype).eps)
    return torch.iinfo(dtype).max


def largest_value(op: str, redop: str, world_size: int) -> int:
    """The largest value any input, partial or expected output of ``op`` takes."""
    if op not in REDUCING_OPS:
        return DATA_PERIOD
    if redop == "prod":
        return 2 ** math.ceil(world_size / PROD_PERIOD)
    if redop in ("sum", "avg"):
        return REDUCE_PERIOD * world_size
    return REDUCE_PERIOD


def reduce_input(rank: int, count: int, redop: str) -> torch.Tensor:
    """Rank ``rank``'s input for a reduction, as float64: element i of a global buffer."""
    index = torch.arange(count, dtype=torch.int64)
    if redop == "prod":
        values = torch.where((index + rank) % PROD_PERIOD == 0, 2, 1)
    else:
        values = (index + 3 * rank) % REDUCE_PERIOD + 1
    return values.to(torch.float64)


def data_input(rank: int, count: int) -> torch.Tensor:
    """Rank ``rank``'s input for the collectives that do not reduce, as float64."""
    return ((torch.arange(count, dtype=torch.int64) + 7 * rank) % DATA_PERIOD + 1).to(
        torch.float64)


def reduce_reference(world_size: int, count: int, redop: str) -> torch.Tensor:
    """The reduction of every rank's ``reduce_input``, in float64 (computed locally)."""
    acc = reduce_input(0, count, redop)
    for rank in range(1, world_size):
        x = reduce_input(rank, count, redop)
        if redop in ("sum", "avg"):
            acc += x
        elif redop == "prod":
            acc *= x
        elif redop == "min":
            torch.minimum(acc, x, out=acc)
        elif redop == "max":
            torch.maximum(acc, x, out=acc)
        else:
            raise ValueError(f"unknown reduction {redop!r}; known: {', '.join(REDOPS)}")
    if redop == "avg":
        acc /= world_size
    return acc


def count_mismatches(output: torch.Tensor, expected: torch.Tensor, redop: str) -> int:
    """Elements of ``output`` that differ from ``expected`` (float64, same shape).

    Every value is an exact small integer, so the comparison is exact, except
    for avg: there the sum is exact but the division by the world size rounds,
    and a peer may divide in another precision, so one unit in the last
    place of ``output``'s dtype is allowed.
    """
    actual = output.to(torch.float64)
    if redop == "avg":
        tolerance = torch.finfo(output.dtype).eps * expected.abs()
        return int(torch.count_nonzero((actual - expected).abs() > tolerance))
    return int(torch.count_nonzero(actual != expected))


class Case(Protocol):
    """One collective on buffers of one size, with inputs that make its answer exact."""

    @property
    def count(self) -> int:
        """Elements in the message size (nccl-tests' count column)."""

    @property
    def nbytes(self) -> int:
        """The message size in bytes (``count`` whole elements)."""

    def reset(self) -> None:
        """Restores the inputs and blanks the outputs (collectives may work in place)."""

    def bind(self, peer: Peer) -> Callable[[], None]:
        """A function that runs the collective once on ``peer`` with these buffers."""

    def count_wrong(self) -> int:
        """Elements of this rank's output that differ from the expected answer.

        Valid right after ``reset`` followed by one run.
        """


@dataclass
class _Buffers:
    """What every Case keeps: where it lives and the expected output, computed on demand."""

    rank: int
    world_size: int
    dtype: torch.dtype
    device: torch.device
    memory: str = "torch"
    """Which allocator the buffers come from (one of ``MEMORIES``)."""
    _expected: Optional[torch.Tensor] = field(default=None, repr=False)

    def empty(self, count: int) -> torch.Tensor:
        """An uninitialised buffer of ``count`` elements of this case's dtype, where it lives."""
        if self.memory == "registered":
            return pyddp.empty(count, dtype=self.dtype)
        if self.memory == "symmetric":
            from torch.distributed import _symmetric_memory

            return _symmetric_memory.empty(count, dtype=self.dtype, device=self.device)
        if self.memory != "torch":
            raise ValueError(f"unknown memory {self.memory!r}; known: {', '.join(MEMORIES)}")
        return torch.empty(count, dtype=self.dtype, device=self.device)

    def place(self, values: torch.Tensor) -> torch.Tensor:
        """float64 ``values`` (one dimension) as this case's dtype, where it lives."""
        out = self.empty(values.numel())
        out.copy_(values)
        return out

    def expected(self, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The cached float64 reference on the case's device (``compute`` builds it once)."""
        if self._expected is None:
            self._expected = compute().to(self.device)
        return self._expected


class _Sized:
    """``count`` and ``nbytes`` of a case, from ``_message``: the buffer that nccl-tests
    sizes the collective by."""

    @property
    def _message(self) -> torch.Tensor:
        raise NotImplementedError

    @property
    def count(self) -> int:
        return self._message.numel()

    @property
    def nbytes(self) -> int:
        return self._message.numel() * self._message.element_size()


class _InPlaceCase(_Sized):
    """A case whose collective works in place on ``tensor``, restored from ``_input``."""

    tensor: torch.Tensor
    _input: torch.Tensor

    @property
    def _message(self) -> torch.Tensor:
        return self.tensor

    def reset(self) -> None:
        self.tensor.copy_(self._input)


class AllReduceCase(_InPlaceCase):
    """In-place all-reduce of ``reduce_input``; the result is ``reduce_reference``.

    The timed loop does not reset, so repeated runs re-reduce the previous
    result and values may grow to inf or wrap there; ``count_wrong`` is only
    meaningful after ``reset`` and a single run.
    """

    def __init__(self, buffers: _Buffers, count: int, redop: str) -> None:
        self._b = buffers
        self._redop = redop
        self._input = buffers.place(reduce_input(buffers.rank, count, redop))
        self.tensor = buffers.empty(self._input.numel())
        self.reset()

    @classmethod
    def prepare(cls, nbytes: int, dtype: torch.dtype, device: torch.device, rank: int,
                world_size: int, redop: str, root: int, memory: str = "torch"
                ) -> "AllReduceCase":
        return cls(_Buffers(rank, world_size, dtype, device, memory), nbytes // dtype.itemsize, redop)

    def bind(self, peer: Peer) -> Callable[[], None]:
        return peer.all_reduce(self.tensor, self._redop)

    def count_wrong(self) -> int:
        expected = self._b.expected(
            lambda: reduce_reference(self._b.world_size, self.count, self._redop))
        return count_mismatches(self.tensor, expected, self._redop)


class BroadcastCase(_InPlaceCase):
    """Broadcast from ``root`` of ``data_input``; every rank ends with root's input."""

    def __init__(self, buffers: _Buffers, count: int, root: int) -> None:
        self._b = buffers
        self._root = root
        self._input = buffers.place(data_input(buffers.rank, count))
        self.tensor = buffers.empty(self._input.numel())
        self.reset()

    @classmethod
    def prepare(cls, nbytes: int, dtype: torch.dtype, device: torch.device, rank: int,
                world_size: int, redop: str, root: int, memory: str = "torch"
                ) -> "BroadcastCase":
        return cls(_Buffers(rank, world_size, dtype, device, memory), nbytes // dtype.itemsize, root)

    def bind(self, peer: Peer) -> Callable[[], None]:
        return peer.broadcast(self.tensor, self._root)

    def count_wrong(self) -> int:
        expected = self._b.expected(lambda: data_input(self._root, self.count))
        return count_mismatches(self.tensor, expected, "none")


class _OutOfPlaceCase(_Sized):
    """A case that reads ``input`` and writes ``output``, which ``reset`` blanks; sized by
    ``input`` unless a subclass says otherwise (nccl-tests counts the larger buffer)."""

    input: torch.Tensor
    output: torch.Tensor

    @property
    def _message(self) -> torch.Tensor:
        return self.input

    def reset(self) -> None:
        self.output.fill_(SENTINEL)


def _block_count(nbytes: int, dtype: torch.dtype, world_size: int) -> int:
    """Elements per rank's block when ``nbytes`` is the whole n-block buffer (at least 1)."""
    return max(1, nbytes // (dtype.itemsize * world_size))


class AllGatherCase(_OutOfPlaceCase):
    """All-gather of ``data_input`` (one block per rank) into a sentinel-filled buffer."""

    def __init__(self, buffers: _Buffers, block: int) -> None:
        self._b = buffers
        self.input = buffers.place(data_input(buffers.rank, block))
        self.output = buffers.empty(block * buffers.world_size)
        self.reset()

    @classmethod
    def prepare(cls, nbytes: int, dtype: torch.dtype, device: torch.device, rank: int,
                world_size: int, redop: str, root: int, memory: str = "torch"
                ) -> "AllGatherCase":
        return cls(_Buffers(rank, world_size, dtype, device, memory),
                   _block_count(nbytes, dtype, world_size))

    @property
    def _message(self) -> torch.Tensor:
        return self.output

    def bind(self, peer: Peer) -> Callable[[], None]:
        return peer.all_gather(self.output, self.input)

    def count_wrong(self) -> int:
        block = self.input.numel()
        expected = self._b.expected(lambda: torch.cat(
            [data_input(r, block) for r in range(self._b.world_size)]))
        return count_mismatches(self.output, expected, "none")


class ReduceScatterCase(_OutOfPlaceCase):
    """Reduce-scatter of an n-block ``reduce_input``: rank r gets block r of the reduction."""

    def __init__(self, buffers: _Buffers, block: int, redop: str) -> None:
        self._b = buffers
        self._redop = redop
        self.input = buffers.place(reduce_input(buffers.rank, block * buffers.world_size, redop))
        self.output = buffers.empty(block)
        self.reset()

    @classmethod
    def prepare(cls, nbytes: int, dtype: torch.dtype, device: torch.device, rank: int,
                world_size: int, redop: str, root: int, memory: str = "torch"
                ) -> "ReduceScatterCase":
        return cls(_Buffers(rank, world_size, dtype, device, memory),
                   _block_count(nbytes, dtype, world_size), redop)

    def bind(self, peer: Peer) -> Callable[[], None]:
        return peer.reduce_scatter(self.output, self.input, self._redop)

    def count_wrong(self) -> int:
        block = self.output.numel()
        start = self._b.rank * block
        expected = self._b.expected(lambda: reduce_reference(
            self._b.world_size, block * self._b.world_size, self._redop)[start:start + block])
        return count_mismatches(self.output, expected, self._redop)


class AllToAllCase(_OutOfPlaceCase):
    """All-to-all (even splits) of an n-block ``data_input``: block k of rank r's input
    lands in block r of rank k's output."""

    def __init__(self, buffers: _Buffers, block: int) -> None:
        self._b = buffers
        self.input = buffers.place(data_input(buffers.rank, block * buffers.world_size))
        self.output = buffers.empty(self.input.numel())
        self.reset()

    @classmethod
    def prepare(cls, nbytes: int, dtype: torch.dtype, device: torch.device, rank: int,
                world_size: int, redop: str, root: int, memory: str = "torch"
                ) -> "AllToAllCase":
        return cls(_Buffers(rank, world_size, dtype, device, memory),
                   _block_count(nbytes, dtype, world_size))

    def bind(self, peer: Peer) -> Callable[[], None]:
        return peer.all_to_all(self.output, self.input)

    def count_wrong(self) -> int:
        n = self._b.world_size
        block = self.input.numel() // n
        start = self._b.rank * block
        expected = self._b.expected(lambda: torch.cat(
            [data_input(r, block * n)[start:start + block] for r in range(n)]))
        return count_mismatches(self.output, expected, "none")


class SendRecvCase(_OutOfPlaceCase):
    """A ring exchange, as nccl-tests' sendrecv: every rank sends its ``data_input`` to
    rank + 1 and receives rank - 1's, at once."""

    def __init__(self, buffers: _Buffers, count: int) -> None:
        self._b = buffers
        self.input = buffers.place(data_input(buffers.rank, count))
        self.output = buffers.empty(self.input.numel())
        self.reset()

    @classmethod
    def prepare(cls, nbytes: int, dtype: torch.dtype, device: torch.device, rank: int,
                world_size: int, redop: str, root: int, memory: str = "torch"
                ) -> "SendRecvCase":
        return cls(_Buffers(rank, world_size, dtype, device, memory), nbytes // dtype.itemsize)

    def _neighbour(self, step: int) -> int:
        return (self._b.rank + step) % self._b.world_size

    def bind(self, peer: Peer) -> Callable[[], None]:
        return peer.sendrecv(self.output, self.input, self._neighbour(1), self._neighbour(-1))

    def count_wrong(self) -> int:
        expected = self._b.expected(lambda: data_input(self._neighbour(-1), self.count))
        return count_mismatches(self.output, expected, "none")


class BarrierCase:
    """A barrier: no buffer (size 0), nothing to check; every rank returns once all have
    entered. It is timed once per run, at the sweep's first size (SIZELESS_OPS)."""

    count = 0
    nbytes = 0

    @classmethod
    def prepare(cls, nbytes: int, dtype: torch.dtype, device: torch.device, rank: int,
                world_size: int, redop: str, root: int, memory: str = "torch"
                ) -> "BarrierCase":
        return cls()

    def reset(self) -> None:
        """Nothing to restore."""

    def bind(self, peer: Peer) -> Callable[[], None]:
        return peer.barrier

    def count_wrong(self) -> int:
        raise NotImplementedError("a barrier has no output to check (SIZELESS_OPS)")


CaseFactory = Callable[..., Case]
"""``prepare(nbytes, dtype, device, rank, world_size, redop, root, memory="torch")``: buffers
of about ``nbytes`` from the allocator ``memory`` names (``MEMORIES``)."""

OPS: dict[str, CaseFactory] = {
    "all_reduce": AllReduceCase.prepare,
    "all_gather": AllGatherCase.prepare,
    "broadcast": BroadcastCase.prepare,
    "reduce_scatter": ReduceScatterCase.prepare,
    "all_to_all": AllToAllCase.prepare,
    "sendrecv": SendRecvCase.prepare,
    "barrier": BarrierCase.prepare,
}

SIZELESS_OPS = frozenset({"barrier"})
"""The operations without a buffer: timed once, at the sweep's first size, with size 0 and
nothing for --check to compare."""

REDUCING_OPS = frozenset({"all_reduce", "reduce_scatter"})
"""The collectives that take a reduction operator."""
