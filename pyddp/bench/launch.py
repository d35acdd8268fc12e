"""The ranks of one benchmark run, and what they report.

The ranks are separate interpreters running ``python -m pyddp.bench.worker
RUN_DIR``, started by pyddp's launcher (``pyddp._launch``, which also
supervises and reaps them): one by one with RANK/WORLD_SIZE in their
environment, or all at once by Open MPI's mpirun when the MPI peer is
wanted (an MPI world of more than one rank exists only for processes that
mpirun started). Either way they rendezvous through a FileStore in RUN_DIR, a
temporary directory, and report through one file of JSON lines per rank
there, which this module polls. With ``--hosts``, each rank runs on a host
simulated by the launcher (``_launch.SimulatedHosts``), whose private /dev/shm
lives in RUN_DIR too.
"""

import os
import sys
import time
from collections.abc import Callable

from pyddp import _launch
from pyddp.bench.across_hosts import placement
from pyddp.bench.peers import MpiPeer, mpi_launchable
from pyddp.bench.metrics import Result, Skipped
from pyddp.bench.worker import PLAN_FILE, Event, Plan, decode, events_path


class BenchError(RuntimeError):
    """A rank failed, died or stalled; the run was stopped."""


def run(plan: Plan, on_event: Callable[[Event], None] = lambda event: None) -> list[Event]:
    """Runs ``plan`` on ``plan.world_size`` new ranks and returns rank 0's events in order.

    ``on_event`` sees each event as it arrives (for a progress bar). Every
    started process is reaped by the launcher, whether the run succeeded or not.
    """
    if plan.hosts > 1:
        reason = _launch.simulated_hosts_unavailable()
        if reason is not None:
            raise BenchError(f"--hosts {plan.hosts}: cannot simulate hosts here: {reason}")
    with _launch.Rendezvous(prefix="pyddp-bench-") as rendezvous:
        run_dir = rendezvous.directory
        plan.save(os.path.join(run_dir, PLAN_FILE))
        use_mpirun = MpiPeer.name in plan.peers and mpi_launchable() is None
        worker = [sys.executable, "-m", "pyddp.bench.worker", run_dir]
        if plan.hosts > 1:
            hosts = _launch.SimulatedHosts(placement(plan.world_size, plan.hosts), run_dir)
            job = hosts.start_commands(worker, log_dir=run_dir)
        elif use_mpirun:
            job = _launch.start_launcher(_mpirun(plan.world_size) + worker, plan.world_size,
                                         log_dir=run_dir)
        else:
            job = _launch.start_commands(worker, plan.world_size, log_dir=run_dir)
        with job:
            return _collect(job, run_dir, plan.timeout_seconds, on_event, use_mpirun)


def _mpirun(world_size: int) -> list[str]:
    """Open MPI's mpirun for ``world_size`` ranks on this machine, however many cores it has."""
    command = ["mpirun", "-n", str(world_size), "--oversubscribe", "--bind-to", "none"]
    if os.geteuid() == 0:
        command.append("--allow-run-as-root")
    return command


def _collect(job: _launch.Job, run_dir: str, stall_seconds: float,
             on_event: Callable[[Event], None], use_mpirun: bool) -> list[Event]:
    """Reads every rank's event file until all are done; returns rank 0's results and skips.

    Raises BenchError when a rank reports an error, exits without finishing, or
    nothing arrives for ``stall_seconds`` (plus start-up time before the first
    event). Under mpirun, the pids the ranks report are handed to the job, so
    that it reaps them too.
    """
    events: list[Event] = []
    done: set[int] = set()
    offsets = [0] * job.world_size
    deadline = time.monotonic() + _launch.STARTUP_SECONDS + stall_seconds
    while len(done) < job.world_size:
        lines = _read_new_lines(run_dir, offsets)
        if not lines:
            try:
                job.poll(done)
            except _launch.RankFailed as failure:
                raise BenchError(str(failure)) from None
            if time.monotonic() > deadline:
                raise BenchError(f"no progress for {stall_seconds:.0f} s; stopping the run")
            time.sleep(_launch.POLL_SECONDS)
            continue
        deadline = time.monotonic() + stall_seconds
        for line in lines:
            kind, rank, payload = decode(line)
            if kind == "error":
                raise BenchError(f"rank {rank} failed:\n{payload}")
            if kind == "start":
                if use_mpirun:
                    job.adopt(rank, int(str(payload)))
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
