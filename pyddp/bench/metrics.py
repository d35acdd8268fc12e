"""Bandwidth arithmetic and the result row, as nccl-tests defines them."""

from dataclasses import dataclass


def busbw_factor(op: str, world_size: int) -> float:
    """busbw / algbw for collective ``op`` on ``world_size`` ranks (nccl-tests' convention).

    algbw is the message size over the time; busbw scales it to the bytes each
    rank's link carries in an optimal ring, so it is comparable across world
    sizes and against the hardware's bandwidth:

    - all_reduce: 2(n-1)/n (a reduce-scatter then an all-gather)
    - all_gather, reduce_scatter: (n-1)/n, with the size being the gathered
      (full, n-block) buffer
    - broadcast: 1
    """
    n = world_size
    if n < 1:
        raise ValueError(f"world_size must be positive, got {n}")
    factors = {
        "all_reduce": 2 * (n - 1) / n,
        "all_gather": (n - 1) / n,
        "reduce_scatter": (n - 1) / n,
        "broadcast": 1.0,
    }
    if op not in factors:
        raise ValueError(f"no busbw factor for op {op!r}; known: {sorted(factors)}")
    return factors[op]


@dataclass(frozen=True)
class Result:
    """One measured (op, backend, size) point; a row of a table and of the JSON output."""

    op: str
    backend: str
    world_size: int
    size: int
    count: int
    dtype: str
    iters: int
    time_us: float
    algbw_gbps: float
    busbw_gbps: float
    wrong: int

    @classmethod
    def from_timing(cls, op: str, backend: str, world_size: int, size: int, count: int,
                    dtype: str, iters: int, seconds: float, wrong: int) -> "Result":
        """Derives time per call and bandwidths from ``iters`` calls taking ``seconds``."""
        per_call = seconds / iters
        algbw = size / per_call / 1e9 if per_call > 0 else 0.0
        return cls(op=op, backend=backend, world_size=world_size, size=size, count=count,
                   dtype=dtype, iters=iters, time_us=per_call * 1e6, algbw_gbps=algbw,
                   busbw_gbps=algbw * busbw_factor(op, world_size), wrong=wrong)
