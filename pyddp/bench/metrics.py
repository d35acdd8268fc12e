"""Bandwidth arithmetic and the rows a run produces, as nccl-tests defines them."""

from dataclasses import dataclass
from typing import Optional


def busbw_factor(op: str, world_size: int) -> float:
    """busbw / algbw for collective ``op`` on ``world_size`` ranks (nccl-tests' convention).

    algbw is the message size over the time; busbw scales it to the bytes each
    rank's link carries in an optimal ring, so it is comparable across world
    sizes and against the hardware's bandwidth:

    - all_reduce: 2(n-1)/n (a reduce-scatter then an all-gather)
    - all_gather, reduce_scatter: (n-1)/n, with the size being the gathered
      (full, n-block) buffer
    - broadcast: 1
    - all_to_all: (n-1)/n, with the size being each rank's whole (n-block)
      send buffer: the block a rank keeps for itself moves no bytes
    - sendrecv: 1 (every rank sends its buffer to the next, once)
    - barrier: 0 (it moves no bytes)
    """
    n = world_size
    if n < 1:
        raise ValueError(f"world_size must be positive, got {n}")
    factors = {
        "all_reduce": 2 * (n - 1) / n,
        "all_gather": (n - 1) / n,
        "reduce_scatter": (n - 1) / n,
        "broadcast": 1.0,
        "all_to_all": (n - 1) / n,
        "sendrecv": 1.0,
        "barrier": 0.0,  # no bytes: its algbw and busbw are 0, only its time counts
    }
    if op not in factors:
        raise ValueError(f"no busbw factor for op {op!r}; known: {sorted(factors)}")
    return factors[op]


@dataclass(frozen=True)
class Result:
    """One measured (op, peer, size) point; a row of a table and of the JSON/CSV output.

    ``size`` is the message size in bytes as nccl-tests counts it (the
    gathered buffer for all_gather and reduce_scatter, the whole send buffer
    for all_to_all) and ``count`` its
    elements. ``detail`` names the library and its variant, ``device`` is
    "cpu" or "cuda". ``redop`` is "none" and ``root`` -1 where they do not apply.
    ``wrong`` is the number of wrong elements summed over ranks, None when
    the run did not check.
    """

    op: str
    peer: str
    detail: str
    device: str
    world_size: int
    size: int
    count: int
    dtype: str
    redop: str
    root: int
    iters: int
    time_us: float
    algbw_gbps: float
    busbw_gbps: float
    wrong: Optional[int]

    @classmethod
    def from_timing(cls, op: str, peer: str, detail: str, device: str, world_size: int,
                    size: int, count: int, dtype: str, redop: str, root: int, iters: int,
                    seconds: float, wrong: Optional[int]) -> "Result":
        """Derives time per call and bandwidths from ``iters`` calls taking ``seconds``."""
        per_call = seconds / iters
        algbw = size / per_call / 1e9 if per_call > 0 else 0.0
        return cls(op=op, peer=peer, detail=detail, device=device, world_size=world_size,
                   size=size, count=count, dtype=dtype, redop=redop, root=root, iters=iters,
                   time_us=per_call * 1e6, algbw_gbps=algbw,
                   busbw_gbps=algbw * busbw_factor(op, world_size), wrong=wrong)


@dataclass(frozen=True)
class Skipped:
    """A peer (``op`` None) or one of its collectives that the run could not measure."""

    peer: str
    op: Optional[str]
    reason: str
