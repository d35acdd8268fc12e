"""Starting, supervising and reaping the ranks of one benchmark run.

The ranks are separate interpreters running ``python -m pyddp.bench.worker
RUN_DIR``: started one by one with RANK/WORLD_SIZE in their environment, or
all at once by Open MPI's mpirun when the MPI backend is wanted (an MPI world
of more than one rank exists only for processes that mpirun started). Either
way they rendezvous through a FileStore in RUN_DIR, a temporary directory, and
report through one file of JSON lines per rank there, which this module polls.
"""

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
from typing import IO

import pyddp
from pyddp.bench.backends import MpiBackend, mpi_launchable
from pyddp.bench.metrics import Result, Skipped
from pyddp.bench.worker import PLAN_FILE, Event, Plan, decode, events_path

POLL_SECONDS = 0.1
JOIN_SECONDS = 30.0
ABORT_JOIN_SECONDS = 3.0
STARTUP_SECONDS = 120.0
"""Extra time for the first event: interpreters start and DeepSpeed may JIT-build its op."""
LOG_TAIL_LINES = 40


class BenchError(RuntimeError):
    """A rank failed, died or stalled; the run was stopped."""


def run(plan: Plan, on_event: Callable[[Event], None] = lambda event: None) -> list[Event]:
    """Runs ``plan`` on ``plan.world_size`` new ranks and returns rank 0's events in order.

    ``on_event`` sees each event as it arrives (for a progress bar). Every
    started process is waited for (with a timeout) and killed by its pid if
    still alive, whether the run succeeded or not (after a failure, ranks
    blocked on the failed one get only a short grace period).
    """
    with tempfile.TemporaryDirectory(prefix="pyddp-bench-") as run_dir:
        plan.save(os.path.join(run_dir, PLAN_FILE))
        use_mpirun = MpiBackend.name in plan.backends and mpi_launchable() is None
        ranks = _Ranks(run_dir, plan.world_size, use_mpirun)
        finished = False
        try:
            events = _collect(ranks, plan.timeout_seconds, on_event)
            finished = True
            return events
        finally:
            ranks.reap(JOIN_SECONDS if finished else ABORT_JOIN_SECONDS)


def _child_environment() -> dict[str, str]:
    """This process's environment, with pyddp's parent directory first on PYTHONPATH."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(pyddp.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


class _Ranks:
    """The processes of one run: one per rank, or one mpirun that starts them all."""

    def __init__(self, run_dir: str, world_size: int, use_mpirun: bool) -> None:
        self.run_dir = run_dir
        self.world_size = world_size
        self.use_mpirun = use_mpirun
        self.rank_pids: dict[int, int] = {}
        self._procs: list[subprocess.Popen] = []
        self._logs: list[IO[bytes]] = []
        worker = [sys.executable, "-m", "pyddp.bench.worker", run_dir]
        env = _child_environment()
        if use_mpirun:
            command = ["mpirun", "-n", str(world_size), "--oversubscribe", "--bind-to", "none"]
            if os.geteuid() == 0:
                command.append("--allow-run-as-root")
            self._start(command + worker, env, "mpirun")
        else:
            for rank in range(world_size):
                rank_env = dict(env, RANK=str(rank), WORLD_SIZE=str(world_size),
                                LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
                self._start(worker, rank_env, f"rank{rank}")

    def _start(self, command: list[str], env: dict[str, str], name: str) -> None:
        log = open(os.path.join(self.run_dir, f"{name}.log"), "wb")
        self._logs.append(log)
        self._procs.append(subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL,
                                            stdout=log, stderr=subprocess.STDOUT))

    def log_tail(self, rank: int) -> str:
        """The last lines that rank ``rank`` (or mpirun, for every rank) wrote."""
        name = "mpirun" if self.use_mpirun else f"rank{rank}"
        with open(os.path.join(self.run_dir, f"{name}.log"), "rb") as f:
            lines = deque(f.read().decode(errors="replace").splitlines(), LOG_TAIL_LINES)
        return "\n".join(lines)

    def check_alive(self, done: set[int]) -> None:
        """Raises BenchError if a process exited before its ranks reported done."""
        if self.use_mpirun:
            code = self._procs[0].poll()
            missing = sorted(set(range(self.world_size)) - done)
            if code is not None and missing:
                raise BenchError(f"mpirun exited with code {code} before ranks {missing} "
                                 f"finished; its output ends:\n{self.log_tail(missing[0])}")
            return
        for rank, proc in enumerate(self._procs):
            code = proc.poll()
            if code is not None and rank not in done:
                raise BenchError(f"rank {rank} exited with code {code} before finishing; "
                                 f"its output ends:\n{self.log_tail(rank)}")

    def reap(self, timeout: float) -> None:
        """Waits ``timeout`` seconds in all for the processes, then kills the ones still alive.

        mpirun gets SIGTERM first (it then stops its ranks); ranks it started
        that outlive it are killed by the pids they reported.
        """
        deadline = time.monotonic() + timeout
        for proc in self._procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        if self.use_mpirun and self._procs[0].poll() is None:
            self._procs[0].terminate()
            try:
                self._procs[0].wait(ABORT_JOIN_SECONDS)
            except subprocess.TimeoutExpired:
                pass
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if self.use_mpirun:
            for pid in self.rank_pids.values():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for log in self._logs:
            log.close()


def _collect(ranks: _Ranks, stall_seconds: float, on_event: Callable[[Event], None]
             ) -> list[Event]:
    """Reads every rank's event file until all are done; returns rank 0's results and skips.

    Raises BenchError when a rank reports an error, exits without finishing, or
    nothing arrives for ``stall_seconds`` (plus start-up time before the first
    event).
    """
    events: list[Event] = []
    done: set[int] = set()
    offsets = [0] * ranks.world_size
    deadline = time.monotonic() + STARTUP_SECONDS + stall_seconds
    while len(done) < ranks.world_size:
        lines = _read_new_lines(ranks.run_dir, offsets)
        if not lines:
            ranks.check_alive(done)
            if time.monotonic() > deadline:
                raise BenchError(f"no progress for {stall_seconds:.0f} s; stopping the run")
            time.sleep(POLL_SECONDS)
            continue
        deadline = time.monotonic() + stall_seconds
        for line in lines:
            kind, rank, payload = decode(line)
            if kind == "error":
                raise BenchError(f"rank {rank} failed:\n{payload}")
            if kind == "start":
                ranks.rank_pids[rank] = int(str(payload))
            elif kind == "done":
                done.add(rank)
            elif isinstance(payload, (Result, Skipped)):
                events.append(payload)
                on_event(payload)
    return events


def _read_new_lines(run_dir: str, offsets: list[int]) -> list[str]:
    """Complete lines appended to each rank's event file since ``offsets`` (advanced)."""
    lines: list[str] = []
    for rank, offset in enumerate(offsets):
        try:
            with open(events_path(run_dir, rank), "rb") as f:
                f.seek(offset)
                data = f.read()
        except FileNotFoundError:
            continue
        complete = data[: data.rfind(b"\n") + 1]
        offsets[rank] = offset + len(complete)
        lines.extend(complete.decode().splitlines())
    return lines
