"""What each rank runs: join the groups, then one timing loop for every point.

A rank is either started by the launcher (``python -m pyddp.bench.worker
RUN_DIR``, with RANK/WORLD_SIZE in its environment, or under mpirun) and
reports through a file of JSON lines in RUN_DIR, or is the tool itself under
torchrun and calls ``sweep`` directly.
"""

import dataclasses
import datetime
import json
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from pyddp.bench.peers import PEERS, Peer, RankContext, Run, Unavailable
from pyddp.bench.metrics import Result, Skipped
from pyddp.bench.ops import OPS, REDUCING_OPS, SIZELESS_OPS, Case
from pyddp.bench.over_ranks import max_over_ranks, sum_over_ranks

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

MIN_ITERS = 2
"""Iterations per timed block at least, however slow a call is."""
MAX_ITERS = 1_000_000
PROBE_ITERS = 3

PLAN_FILE = "plan.json"
STORE_FILE = "store"

Event = Union[Result, Skipped]
"""What a sweep yields: a measured point, or a peer (or one of its ops) it could not run."""


@dataclass(frozen=True)
class Plan:
    """Everything a rank needs to run the sweep; the same on every rank."""

    world_size: int
    sizes: list[int]
    ops: list[str]
    peers: list[str]
    dtype: str
    redop: str
    root: int
    iters: Optional[int]
    warmup: int
    target_seconds: float
    timeout_seconds: float
    check: bool
    threads: int
    trials: int
    hosts: int
    """Simulated hosts the ranks are spread over, evenly (--hosts); 1: this machine as it is."""

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(dataclasses.asdict(self), f)

    @classmethod
    def load(cls, path: str) -> "Plan":
        with open(path, encoding="utf-8") as f:
            return cls(**json.load(f))


@dataclass(frozen=True)
class Launch:
    """Where a process stands in a run that something else started (launcher, torchrun, mpirun)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    by_mpirun: bool


def launched_rank(environ: Optional[dict[str, str]] = None) -> Optional[Launch]:
    """This process's place from RANK/WORLD_SIZE (torchrun, the launcher) or Open MPI's
    OMPI_COMM_WORLD_* variables (mpirun); None when neither is set."""
    env = os.environ if environ is None else environ
    for prefix, by_mpirun in (("", False), ("OMPI_COMM_WORLD_", True)):
        names = ("RANK", "SIZE" if by_mpirun else "WORLD_SIZE", "LOCAL_RANK",
                 "LOCAL_SIZE" if by_mpirun else "LOCAL_WORLD_SIZE")
        rank, world, local_rank, local_world = (env.get(prefix + name) for name in names)
        if rank is not None and world is not None:
            world_size = int(world)
            return Launch(int(rank), world_size, int(local_rank or rank),
                          int(local_world or world_size), by_mpirun)
    return None


def sweep(plan: Plan, launch: Launch, store: dist.Store) -> Iterator[Event]:
    """Measures every (size, op, peer) point on this rank, sizes outermost.

    Every rank yields the same events. The default torch.distributed group
    (gloo) is created first: it carries the bookkeeping collectives and is the
    "gloo" peer.
    """
    timeout = datetime.timedelta(seconds=plan.timeout_seconds)
    ctx = RankContext(launch.rank, launch.world_size, launch.local_rank,
                      launch.local_world_size, store, timeout, launch.by_mpirun, plan.hosts)
    dist.init_process_group("gloo", store=ctx.store("gloo"), rank=launch.rank,
                            world_size=launch.world_size, timeout=timeout)
    dtype = DTYPES[plan.dtype]
    try:
        with ExitStack() as stack:
            active: dict[str, list[Peer]] = {op: [] for op in plan.ops}
            for name in plan.peers:
                reason = _agree(PEERS[name].probe(ctx))
                if reason is not None:
                    yield Skipped(name, None, reason)
                    continue
                peer, reason = _open(name, ctx)
                reason = _agree(reason)
                if reason is not None:
                    if peer is not None:
                        peer.close()
                    yield Skipped(name, None, reason)
                    continue
                stack.callback(peer.close)
                for op in plan.ops:
                    reason = peer.unsupported(op, plan.redop, dtype)
                    if reason is None:
                        active[op].append(peer)
                    else:
                        yield Skipped(name, op, reason)
            for size in plan.sizes:
                for op in plan.ops:
                    if op in SIZELESS_OPS and size != plan.sizes[0]:
                        continue
                    # Peers share the buffers of their device and kind of memory.
                    cases: dict[tuple[torch.device, str], Case] = {}
                    for peer in active[op]:
                        where = (peer.device, peer.memory)
                        if where not in cases:
                            cases[where] = OPS[op](
                                size, dtype, peer.device, launch.rank, launch.world_size,
                                plan.redop, plan.root, memory=peer.memory)
                    points = [_Point(op, cases[(b.device, b.memory)], b) for b in active[op]]
                    yield from _measure(op, points, plan)
    finally:
        dist.destroy_process_group()


def _open(name: str, ctx: RankContext) -> tuple[Optional[Peer], Optional[str]]:
    """Peer ``name`` joined on this rank, or None and why it turned out unable to run here."""
    try:
        return PEERS[name].open(ctx), None
    except Unavailable as error:
        return None, str(error)


def _agree(reason: Optional[str]) -> Optional[str]:
    """One answer for every rank: None if no rank has a reason, else the reasons given."""
    reasons: list[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(reasons, reason)
    given = {r: text for r, text in enumerate(reasons) if text is not None}
    if not given:
        return None
    if len(set(given.values())) == 1 and len(given) == len(reasons):
        return next(iter(given.values()))
    return "; ".join(f"rank {r}: {text}" for r, text in given.items())


class _Point:
    """One (op, size, peer) being measured: its bound call, iterations and trial times."""

    def __init__(self, op: str, case: Case, peer: Peer) -> None:
        self.op = op
        self.case = case
        self.peer = peer
        self.iters = 0
        self.trial_seconds: list[float] = []
        try:
            self.run = case.bind(peer)
        except Exception as error:
            raise self.error(error) from error

    def error(self, error: Exception) -> RuntimeError:
        """``error`` with the rank and the point it happened at."""
        return RuntimeError(f"rank {dist.get_rank()}: {self.peer.name} {self.op} of "
                            f"{self.case.nbytes} bytes failed: {error}")


def _measure(op: str, points: list[_Point], plan: Plan) -> Iterator[Result]:
    """The timing loop for one (op, size) over every peer that runs it.

    Each peer warms up and calibrates its iteration count; then the
    peers take turns, ``plan.trials`` timed blocks each, so a burst of load
    on a shared machine hits them alike; the time reported is the median
    block (each block's time is the slowest rank's). Last, with --check,
    each runs once more from fresh inputs and its output is compared with the
    local reference.
    """
    target = plan.target_seconds / plan.trials
    for point in points:
        try:
            point.case.reset()
            for _ in range(plan.warmup):
                point.run()
            point.peer.sync()
            point.iters = plan.iters or _calibrate(point.run, point.peer, target)
        except Exception as error:
            raise point.error(error) from error
    for _ in range(plan.trials):
        for point in points:
            try:
                point.peer.barrier()
                point.trial_seconds.append(
                    max_over_ranks(_time(point.run, point.peer, point.iters)))
            except Exception as error:
                raise point.error(error) from error
    redop = plan.redop if op in REDUCING_OPS else "none"
    root = plan.root if op == "broadcast" else -1
    for point in points:
        wrong = None
        if plan.check and point.peer.checked and op not in SIZELESS_OPS:
            try:
                point.case.reset()
                point.run()
                point.peer.sync()
                wrong = sum_over_ranks(point.case.count_wrong())
            except Exception as error:
                raise point.error(error) from error
        peer = point.peer
        yield Result.from_timing(op, peer.name, peer.detail, peer.device.type,
                                 plan.world_size, point.case.nbytes, point.case.count,
                                 plan.dtype, redop, root, point.iters,
                                 statistics.median(point.trial_seconds), wrong)


def _calibrate(run: Run, peer: Peer, target_seconds: float) -> int:
    """Iterations that take about ``target_seconds``, from a short probe; equal on all ranks."""
    peer.barrier()
    per_call = max_over_ranks(_time(run, peer, PROBE_ITERS)) / PROBE_ITERS
    if per_call <= 0:
        return MAX_ITERS
    return max(MIN_ITERS, min(MAX_ITERS, math.ceil(target_seconds / per_call)))


def _time(run: Run, peer: Peer, iters: int) -> float:
    """Seconds that ``iters`` back-to-back runs take on this rank, until its device is done."""
    start = time.perf_counter()
    for _ in range(iters):
        run()
    peer.sync()
    return time.perf_counter() - start


def encode(kind: str, rank: int, payload: Optional[Union[Event, str]] = None) -> str:
    """One line of a rank's event file: ``{"kind", "rank", ...}`` as JSON."""
    record: dict[str, Any] = {"kind": kind, "rank": rank}
    if isinstance(payload, (Result, Skipped)):
        record["data"] = dataclasses.asdict(payload)
    elif payload is not None:
        record["text"] = payload
    return json.dumps(record) + "\n"


def decode(line: str) -> tuple[str, int, Optional[Union[Event, str]]]:
    """The inverse of ``encode``: ``(kind, rank, Result | Skipped | text | None)``."""
    record = json.loads(line)
    kind, rank = record["kind"], record["rank"]
    if kind == "result":
        return kind, rank, Result(**record["data"])
    if kind == "skip":
        return kind, rank, Skipped(**record["data"])
    return kind, rank, record.get("text")


def events_path(run_dir: str, rank: int) -> str:
    """The file rank ``rank`` reports to."""
    return os.path.join(run_dir, f"rank{rank}.events")


def main(argv: list[str]) -> int:
    """A rank started by the launcher: runs the plan in ``argv[0]`` and reports there.

    Writes "start" (with the pid, so the launcher can reap it), then rank 0
    writes every result and skip, then each rank "done" or "error" with its
    traceback (exit status 1).
    """
    run_dir = argv[0]
    launch = launched_rank()
    if launch is None:
        print("pyddp.bench.worker: started without RANK/WORLD_SIZE or mpirun", file=sys.stderr)
        return 2
    rank = launch.rank

    with open(events_path(run_dir, rank), "a", encoding="utf-8") as out:
        def emit(kind: str, payload: Optional[Union[Event, str]] = None) -> None:
            out.write(encode(kind, rank, payload))
            out.flush()

        emit("start", str(os.getpid()))
        try:
            plan = Plan.load(os.path.join(run_dir, PLAN_FILE))
            torch.set_num_threads(plan.threads)
            store = dist.FileStore(os.path.join(run_dir, STORE_FILE), launch.world_size)
            store.set_timeout(datetime.timedelta(seconds=plan.timeout_seconds))
            for event in sweep(plan, launch, store):
                if rank == 0:
                    emit("result" if isinstance(event, Result) else "skip", event)
            emit("done")
            return 0
        except Exception:
            emit("error", traceback.format_exc())
            return 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
