"""What each spawned rank runs: join the groups, then one timing loop for every point."""

import datetime
import math
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from multiprocessing.queues import Queue
from typing import Literal, Optional, Union

import torch
import torch.distributed as dist

from pyddp.bench.backends import BACKENDS, Backend, RankContext
from pyddp.bench.metrics import Result
from pyddp.bench.ops import OPS, Case

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int32": torch.int32,
    "int64": torch.int64,
}

MIN_ITERS = 5
MAX_ITERS = 1_000_000
PROBE_ITERS = 3

Message = tuple[Literal["result", "done", "error"], int, Union[Result, str, None]]
"""``(kind, rank, payload)`` sent to the launcher: a Result, a traceback or nothing."""


@dataclass(frozen=True)
class Plan:
    """Everything a rank needs to run the sweep; the same on every rank."""

    world_size: int
    sizes: list[int]
    ops: list[str]
    backends: list[str]
    dtype: str
    iters: Optional[int]
    warmup: int
    target_seconds: float
    timeout_seconds: float


def run_rank(rank: int, plan: Plan, store_dir: str, queue: "Queue[Message]") -> None:
    """Entry point of a spawned rank; the ranks rendezvous through FileStores in ``store_dir``.

    Rank 0 sends every Result; each rank ends with a "done" message, or an
    "error" message with its traceback and exit code 1.
    """
    try:
        torch.set_num_threads(1)
        for result in _sweep(rank, plan, store_dir):
            if rank == 0:
                queue.put(("result", rank, result))
        queue.put(("done", rank, None))
    except Exception:
        queue.put(("error", rank, traceback.format_exc()))
        sys.exit(1)


def _sweep(rank: int, plan: Plan, store_dir: str) -> Iterator[Result]:
    """Measures every (size, op, backend) point, sizes outermost.

    Backends alternate within a size, so slow drifts of a shared machine hit
    them alike. The default torch.distributed group (gloo) is created first:
    it carries the bookkeeping collectives and is the "gloo" backend.
    """
    ctx = RankContext(rank, plan.world_size, store_dir,
                      datetime.timedelta(seconds=plan.timeout_seconds))
    dist.init_process_group("gloo", store=ctx.store("gloo"), rank=rank,
                            world_size=plan.world_size, timeout=ctx.timeout)
    try:
        with ExitStack() as stack:
            backends = []
            for name in plan.backends:
                backend = BACKENDS[name](ctx)
                stack.callback(backend.close)
                backends.append(backend)
            for size in plan.sizes:
                for op in plan.ops:
                    case = OPS[op](size, DTYPES[plan.dtype], rank, plan.world_size)
                    for backend in backends:
                        yield _measure(op, case, backend, plan)
    finally:
        dist.destroy_process_group()


def _measure(op: str, case: Case, backend: Backend, plan: Plan) -> Result:
    """The timing loop: warm up, agree on iterations, time them, then check one fresh run."""
    case.reset()
    for _ in range(plan.warmup):
        case.run(backend)
    iters = plan.iters if plan.iters is not None else _calibrate(case, backend,
                                                                  plan.target_seconds)
    backend.barrier()
    seconds = _max_over_ranks(_time(case, backend, iters))
    case.reset()
    case.run(backend)
    wrong = _sum_over_ranks(case.count_wrong())
    return Result.from_timing(op, backend.name, plan.world_size, case.nbytes, case.count,
                              plan.dtype, iters, seconds, wrong)


def _calibrate(case: Case, backend: Backend, target_seconds: float) -> int:
    """Iterations that take about ``target_seconds``, from a short probe; equal on all ranks."""
    backend.barrier()
    per_call = _max_over_ranks(_time(case, backend, PROBE_ITERS)) / PROBE_ITERS
    if per_call <= 0:
        return MAX_ITERS
    return max(MIN_ITERS, min(MAX_ITERS, math.ceil(target_seconds / per_call)))


def _time(case: Case, backend: Backend, iters: int) -> float:
    """Seconds that ``iters`` back-to-back runs take on this rank."""
    start = time.perf_counter()
    for _ in range(iters):
        case.run(backend)
    return time.perf_counter() - start


def _max_over_ranks(value: float) -> float:
    """The largest ``value`` over all ranks (through the default gloo group)."""
    buf = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(buf, op=dist.ReduceOp.MAX)
    return float(buf.item())


def _sum_over_ranks(value: int) -> int:
    """The sum of ``value`` over all ranks (through the default gloo group)."""
    buf = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(buf)
    return int(buf.item())
