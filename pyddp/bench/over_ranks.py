"""The benchmarks' bookkeeping across ranks: one number from every rank, reduced.

Both go through torch.distributed's default group (gloo, which both
benchmarks create), always outside the timed loops.
"""

import torch
import torch.distributed as dist


def max_over_ranks(value: float) -> float:
    """The largest ``value`` over all ranks."""
    buf = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(buf, op=dist.ReduceOp.MAX)
    return float(buf.item())


def sum_over_ranks(value: int) -> int:
    """The sum of ``value`` over all ranks."""
    buf = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(buf)
    return int(buf.item())
