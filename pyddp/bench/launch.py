"""Spawning, supervising and reaping the ranks of one benchmark run."""

import multiprocessing as mp
import queue as queue_module
import tempfile
import time
from collections.abc import Sequence
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue

from pyddp.bench.metrics import Result
from pyddp.bench.worker import Message, Plan, run_rank

POLL_SECONDS = 0.5
JOIN_SECONDS = 30.0
ABORT_JOIN_SECONDS = 2.0
STARTUP_SECONDS = 120.0


class BenchError(RuntimeError):
    """A rank failed, died or stalled; the run was stopped."""


def run(plan: Plan) -> list[Result]:
    """Runs ``plan`` on ``plan.world_size`` spawned ranks and returns rank 0's results.

    The ranks rendezvous through FileStores in a temporary directory that is
    removed afterwards. Every rank is joined (with a timeout) and killed if it
    is still alive, whether the run succeeded or not (after a failure, ranks
    blocked on the failed one get only a short grace period).
    """
    ctx = mp.get_context("spawn")
    messages: "Queue[Message]" = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="pyddp-bench-") as store_dir:
        procs = [ctx.Process(target=run_rank, args=(rank, plan, store_dir, messages),
                             name=f"pyddp-bench-rank{rank}")
                 for rank in range(plan.world_size)]
        finished = False
        try:
            for proc in procs:
                proc.start()
            results = _collect(procs, messages, plan.timeout_seconds)
            finished = True
            return results
        finally:
            _reap(procs, JOIN_SECONDS if finished else ABORT_JOIN_SECONDS)
            messages.close()


def _collect(procs: Sequence[BaseProcess], messages: "Queue[Message]", stall_seconds: float
             ) -> list[Result]:
    """Gathers results until every rank is done.

    Raises BenchError when a rank reports an error, exits without finishing, or
    nothing arrives for ``stall_seconds`` (plus start-up time before the first
    message).
    """
    results: list[Result] = []
    done: set[int] = set()
    deadline = time.monotonic() + STARTUP_SECONDS + stall_seconds
    while len(done) < len(procs):
        try:
            kind, rank, payload = messages.get(timeout=POLL_SECONDS)
        except queue_module.Empty:
            _check_alive(procs, done)
            if time.monotonic() > deadline:
                raise BenchError(f"no progress for {stall_seconds:.0f} s; stopping the run")
            continue
        deadline = time.monotonic() + stall_seconds
        if kind == "error":
            raise BenchError(f"rank {rank} failed:\n{payload}")
        if kind == "done":
            done.add(rank)
        elif isinstance(payload, Result):
            results.append(payload)
    return results


def _check_alive(procs: Sequence[BaseProcess], done: set[int]) -> None:
    """Raises BenchError if a rank that has not finished is no longer running."""
    for rank, proc in enumerate(procs):
        if rank not in done and proc.exitcode is not None:
            raise BenchError(f"rank {rank} exited with code {proc.exitcode} before finishing")


def _reap(procs: Sequence[BaseProcess], timeout: float) -> None:
    """Joins the started ranks within ``timeout`` seconds in all; kills the ones still alive."""
    deadline = time.monotonic() + timeout
    for proc in procs:
        if proc.pid is not None:
            proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.pid is not None and proc.is_alive():
            proc.kill()
            proc.join()
