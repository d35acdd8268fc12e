"""Starting, supervising and reaping the rank processes of a job.

Everything in pyddp that starts ranks (the benchmarks, the examples, the test
harness) starts them here. A job's ranks are started in one of three forms:

- ``spawn``: a Python function, ``target(rank, *args)``, in processes of
  multiprocessing's "spawn" context; its return value comes back by rank, and
  an exception comes back as its traceback;
- ``start_commands``: one command (argv) per rank, with RANK, WORLD_SIZE,
  LOCAL_RANK and LOCAL_WORLD_SIZE in its environment and pyddp's parent
  directory first on PYTHONPATH; each rank's argv may get a prefix of its own
  (a wrapper such as ``unshare --uts --mount ...`` that puts the rank in a
  simulated other host; function ranks cannot take one, as multiprocessing
  starts every spawned process with the same interpreter command);
- ``start_launcher``: one command that starts every rank itself (mpirun).

``SimulatedHosts`` starts command ranks on hosts simulated on this machine
(the tests of groups that span hosts, ``python -m pyddp.bench --hosts``).

This module guarantees:

- a rank that fails (raises, exits with a non-zero code, is killed by a
  signal, or exits before it finished) is reported as a ``RankFailed`` that
  names the rank and its exit code, with its traceback or the tail of its log
  when there is one, at the next poll (every ``POLL_SECONDS``); one failure
  ends the wait for the other ranks at once (they would fail only at their
  group timeout);
- every wait is bounded;
- every started process is reaped: waited for a bounded time, then killed by
  its own pid; for a launcher, the rank pids it was told of (``Job.adopt``)
  are killed too;
- nothing is printed: what the launcher does goes to the ``pyddp`` logger.

``Rendezvous`` is the temporary directory where ranks meet through a
FileStore (a ``file://`` init method), removed afterwards.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import shutil
import signal
import subprocess
import tempfile
import time
import traceback
from collections import deque
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from multiprocessing.connection import Connection
from types import TracebackType
from typing import Any, Optional, Union

logger = logging.getLogger("pyddp")

POLL_SECONDS = 0.1
"""How often a supervisor looks at its ranks: a failure is seen within a tenth of a
second, and the polling costs nothing next to ranks that run for seconds."""

JOIN_SECONDS = 30.0
"""How long ranks that finished may take to exit before they are killed. They still
tear down their groups (unlink shared memory, close gloo's sockets), which takes
seconds on the loaded 2-core development machines; 30 s leaves a wide margin and
still bounds a teardown that hangs (the benchmark launcher's and the test harness's
value before this module)."""

ABORT_JOIN_SECONDS = 3.0
"""After a failure, how long the other ranks get to exit by themselves before they
are killed. Blocked on the failed rank, most would fail only at their group timeout
(minutes), so this only lets ranks that are already failing finish reporting why
(the benchmark launcher's value before this module)."""

STARTUP_SECONDS = 120.0
"""Extra time a job gets before its first sign of progress: every rank's interpreter
imports torch (4.6 s for ``import pyddp`` measured at a load average of 9 on the
2-core machines, more when several ranks start at once) and DeepSpeed may JIT-build
its op (about 30 s the first time). The value the benchmarks and the test harness
used before this module."""

EXIT_SECONDS = 10.0
"""How long a process that was killed, or whose pipes closed, may take to finish
exiting; it bounds the wait for one stuck in uninterruptible sleep (the test
harness's value before this module)."""

LOG_TAIL_LINES = 40
"""Lines of a failed rank's log quoted in its report: room for a Python traceback."""

RankEnv = Union[Mapping[str, str], Callable[[int], Mapping[str, str]]]
"""Environment variables for the ranks: the same for every rank, or a function of the rank."""

RankPrefix = Callable[[int], Sequence[str]]
"""The argv prefix of a rank's command (a wrapper that runs it), as a function of the rank."""


class LaunchError(RuntimeError):
    """A job did not complete: a rank failed, or the wait for the ranks timed out."""


class RankFailed(LaunchError):
    """A rank raised, exited with a non-zero code, was killed, or exited before it finished.

    ``rank`` is None when the process was a launcher that ran several ranks;
    ``exitcode`` is None when the rank's exception arrived before its process
    exited, and negative (minus the signal number) when a signal killed it.
    """

    def __init__(self, message: str, rank: Optional[int], exitcode: Optional[int],
                 traceback_text: Optional[str] = None, log_tail: Optional[str] = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode
        self.traceback = traceback_text
        self.log_tail = log_tail


class RanksTimedOut(LaunchError):
    """The ranks did not all finish within the time given to ``Job.wait``."""


@contextmanager
def temporary_environ(values: Mapping[str, str]) -> Iterator[None]:
    """Sets environment variables for the duration of the block, then restores them."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


class Rendezvous:
    """A temporary directory where the ranks of a job meet; removed by ``close``.

    Use it as a context manager, or call ``close`` when the ranks are gone.
    """

    def __init__(self, prefix: str = "pyddp-") -> None:
        self.directory = tempfile.mkdtemp(prefix=prefix)

    def store_path(self, name: str = "store") -> str:
        """The path of the FileStore ``name`` in the directory."""
        return os.path.join(self.directory, name)

    def init_method(self, name: str = "store") -> str:
        """A ``file://`` init method for the FileStore ``name``."""
        return "file://" + self.store_path(name)

    def close(self) -> None:
        """Removes the directory and everything in it."""
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> Rendezvous:
        return self

    def __exit__(self, exc_type: Optional[type[BaseException]],
                 exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        self.close()


class _Process:
    """One started process: what it is called in reports, the ranks it runs, its log."""

    def __init__(self, name: str, ranks: tuple[int, ...], log_path: Optional[str]) -> None:
        self.name = name
        self.ranks = ranks
        self.log_path = log_path

    @property
    def pid(self) -> int:
        raise NotImplementedError

    def poll(self) -> Optional[int]:
        """The exit code, or None while it runs."""
        raise NotImplementedError

    def wait(self, timeout: float) -> Optional[int]:
        """Waits up to ``timeout`` seconds for it to exit; the exit code, or None."""
        raise NotImplementedError

    def send(self, signum: int) -> None:
        """Sends ``signum`` to its pid unless it has already been reaped."""
        raise NotImplementedError


class _SpawnedProcess(_Process):
    def __init__(self, process: multiprocessing.process.BaseProcess, name: str,
                 ranks: tuple[int, ...]) -> None:
        super().__init__(name, ranks, None)
        self._process = process

    @property
    def pid(self) -> int:
        return self._process.pid

    def poll(self) -> Optional[int]:
        return self._process.exitcode

    def wait(self, timeout: float) -> Optional[int]:
        self._process.join(timeout)
        return self._process.exitcode

    def send(self, signum: int) -> None:
        if self._process.exitcode is None:
            os.kill(self._process.pid, signum)


class _CommandProcess(_Process):
    def __init__(self, process: subprocess.Popen, name: str, ranks: tuple[int, ...],
                 log_path: Optional[str]) -> None:
        super().__init__(name, ranks, log_path)
        self._process = process

    @property
    def pid(self) -> int:
        return self._process.pid

    def poll(self) -> Optional[int]:
        return self._process.poll()

    def wait(self, timeout: float) -> Optional[int]:
        try:
            return self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def send(self, signum: int) -> None:
        self._process.send_signal(signum)


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name} (exit code {code})"
        except ValueError:
            pass
    return f"exited with code {code}"


def _ranks_text(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {list(ranks)}"


class Job:
    """The processes of one job, from start to reaping.

    Supervise with ``wait`` (function ranks, or commands that report by exit
    code) or, for ranks that report through a channel of their own, by calling
    ``poll`` in the caller's loop. Use the job as a context manager, or call
    ``reap``: leaving the block reaps with ``JOIN_SECONDS`` when it completed
    and ``ABORT_JOIN_SECONDS`` when it raised.
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.results: list[Any] = [None] * world_size
        """By rank: a function rank's return value, a command rank's exit code (0)."""
        self._processes: list[_Process] = []
        self._by_rank: dict[int, _Process] = {}
        self._results: list[Optional[Connection]] = [None] * world_size
        self._finished: set[int] = set()
        self._raised: dict[int, str] = {}
        self._adopted: dict[int, int] = {}
        self._launcher: Optional[_Process] = None

    def _add(self, process: _Process, results: Optional[Connection] = None) -> None:
        self._processes.append(process)
        for rank in process.ranks:
            self._by_rank[rank] = process
            self._results[rank] = results

    def pid(self, rank: int) -> int:
        """The pid of rank ``rank``: its own process's, or the one its launcher reported."""
        if rank in self._adopted:
            return self._adopted[rank]
        process = self._by_rank[rank]
        if process.ranks != (rank,):
            raise LookupError(f"rank {rank} runs under {process.name}, which has not "
                              "reported its pid (Job.adopt)")
        return process.pid

    def adopt(self, rank: int, pid: int) -> None:
        """Records the pid that a launcher's rank ``rank`` reported, so that it is reaped too."""
        self._adopted[rank] = pid

    def exitcode(self, rank: int, timeout: float = 0.0) -> Optional[int]:
        """The exit code of the process running ``rank``, after waiting up to ``timeout``
        seconds for it to exit; None while it runs."""
        return self._by_rank[rank].wait(timeout)

    def exitcodes(self) -> list[Optional[int]]:
        """By rank, the exit code of the process running it; None while it runs."""
        return [self._by_rank[rank].poll() for rank in range(self.world_size)]

    def log_tail(self, rank: int) -> Optional[str]:
        """The last ``LOG_TAIL_LINES`` lines of the log of the process running ``rank``."""
        path = self._by_rank[rank].log_path
        if path is None:
            return None
        try:
            with open(path, "rb") as f:
                lines = deque(f.read().decode(errors="replace").splitlines(), LOG_TAIL_LINES)
        except OSError:
            return None
        return "\n".join(lines)

    def _receive(self) -> None:
        """Takes the return values and tracebacks that function ranks have sent."""
        for rank, conn in enumerate(self._results):
            if conn is None:
                continue
            try:
                while conn.poll():
                    status, value = conn.recv()
                    if status == "ok":
                        self.results[rank] = value
                        self._finished.add(rank)
                    else:
                        self._raised[rank] = value
            except (EOFError, OSError):
                conn.close()
                self._results[rank] = None

    def poll(self, done: Optional[Collection[int]] = None) -> bool:
        """Looks at every rank once: True when all have finished.

        A rank has finished when its function returned, when it is in
        ``done`` (ranks that told the caller so through a channel of its own),
        or, for commands when ``done`` is None, when it exited with code 0.
        Raises ``RankFailed`` for a rank that raised, or whose process exited
        before all its ranks finished.
        """
        codes = [process.poll() for process in self._processes]
        # Exit codes first: what a process sent before it exited is then read.
        self._receive()
        for rank in sorted(self._raised):
            text = self._raised[rank]
            raise RankFailed(f"rank {rank} failed:\n{text.rstrip()}", rank,
                             self._by_rank[rank].poll(), traceback_text=text)
        finished = self._finished | set(done or ())
        for process, code in zip(self._processes, codes):
            pending = [rank for rank in process.ranks if rank not in finished]
            if code is None or not pending:
                continue
            if code == 0 and done is None and isinstance(process, _CommandProcess):
                for rank in pending:
                    self.results[rank] = 0
                    self._finished.add(rank)
                continue
            raise self._failure(process, code, pending)
        return len(self._finished | set(done or ())) == self.world_size

    def _failure(self, process: _Process, code: int, pending: list[int]) -> RankFailed:
        if process.ranks == tuple(pending) and len(pending) == 1:
            message = f"rank {pending[0]} {_describe(code)}"
            if code == 0:
                message += (" without returning" if isinstance(process, _SpawnedProcess)
                            else " before finishing")
        else:
            message = f"{process.name} {_describe(code)} before {_ranks_text(pending)} finished"
        tail = self.log_tail(pending[0])
        if tail is not None:
            message += f"; its output ends:\n{tail}"
        rank = pending[0] if len(process.ranks) == 1 else None
        return RankFailed(message, rank, code, log_tail=tail)

    def wait(self, timeout: float) -> list[Any]:
        """Waits until every rank has finished and returns ``results``.

        Raises ``RankFailed`` as soon as a rank fails (see ``poll``), and
        ``RanksTimedOut`` when they have not all finished within ``timeout``
        seconds. The processes are left for ``reap``.
        """
        deadline = time.monotonic() + timeout
        while not self.poll():
            left = deadline - time.monotonic()
            if left <= 0:
                running = [rank for rank in range(self.world_size) if rank not in self._finished]
                raise RanksTimedOut(f"{_ranks_text(running)} still running after "
                                    f"{timeout:.0f} s")
            time.sleep(min(POLL_SECONDS, left))
        return list(self.results)

    def follow(self, lines: Any, stall_seconds: float, show: Callable[[str], None]) -> list[Any]:
        """``wait``, for ranks that report progress: each line they put in the queue
        ``lines`` goes to ``show`` as it comes, and ``RanksTimedOut`` is raised when no
        line has come for ``stall_seconds`` (``STARTUP_SECONDS`` more before the first).
        When it returns, every line the ranks put has been shown.
        """
        deadline = time.monotonic() + STARTUP_SECONDS + stall_seconds
        while not self.poll():
            if _show_lines(lines, POLL_SECONDS, show):
                deadline = time.monotonic() + stall_seconds
            elif time.monotonic() > deadline:
                raise RanksTimedOut(f"no progress from the ranks for {stall_seconds:.0f} s")
        # A rank's lines reach the queue through a feeder thread that its exit
        # flushes: the last ones may still be on their way when its result is in.
        for rank in range(self.world_size):
            self.exitcode(rank, JOIN_SECONDS)
        _show_lines(lines, 0.0, show)
        return list(self.results)

    def kill(self) -> None:
        """Kills every process still running, now, by its pid, and waits for it to exit."""
        for process in self._processes:
            if process.poll() is None:
                logger.info("killing %s (pid %d)", process.name, process.pid)
                process.send(signal.SIGKILL)
        deadline = time.monotonic() + EXIT_SECONDS
        for process in self._processes:
            if process.wait(max(0.0, deadline - time.monotonic())) is None:
                logger.error("%s (pid %d) is still there %.0f s after SIGKILL",
                             process.name, process.pid, EXIT_SECONDS)

    def reap(self, timeout: float = JOIN_SECONDS) -> None:
        """Waits ``timeout`` seconds in all for the processes to exit, then kills the rest.

        A launcher gets SIGTERM first, and ``ABORT_JOIN_SECONDS`` more, as mpirun
        then stops the ranks it started; ranks it reported (``adopt``) are killed
        by their pids, as they may outlive it. Safe to call more than once.
        """
        deadline = time.monotonic() + timeout
        for process in self._processes:
            process.wait(max(0.0, deadline - time.monotonic()))
        launcher = self._launcher
        if launcher is not None and launcher.poll() is None:
            logger.info("stopping %s (pid %d) with SIGTERM", launcher.name, launcher.pid)
            launcher.send(signal.SIGTERM)
            launcher.wait(ABORT_JOIN_SECONDS)
        self.kill()
        for rank, pid in self._adopted.items():
            try:
                os.kill(pid, signal.SIGKILL)
                logger.info("killed rank %d (pid %d)", rank, pid)
            except ProcessLookupError:
                pass
        self._adopted.clear()
        for rank, conn in enumerate(self._results):
            if conn is not None:
                conn.close()
                self._results[rank] = None

    def __enter__(self) -> Job:
        return self

    def __exit__(self, exc_type: Optional[type[BaseException]],
                 exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        self.reap(JOIN_SECONDS if exc_type is None else ABORT_JOIN_SECONDS)


def _show_lines(lines: Any, timeout: float, show: Callable[[str], None]) -> bool:
    """Passes the lines in the queue to ``show``, waiting up to ``timeout`` for the first;
    whether there was any."""
    shown = False
    try:
        while True:
            show(lines.get(timeout=timeout))
            shown, timeout = True, 0.0
    except queue.Empty:
        return shown


def _rank_value(values: Optional[RankEnv], rank: int) -> Mapping[str, str]:
    if values is None:
        return {}
    return values(rank) if callable(values) else values


def _run_function_rank(conn: Connection, target: Callable[..., Any], rank: int,
                       args: tuple[Any, ...]) -> None:
    """The entry point of a spawned rank: ``target(rank, *args)``, its outcome sent to the job."""
    try:
        conn.send(("ok", target(rank, *args)))
    except Exception as error:
        # From the frame below this one: the report is about the rank's code, not this wrapper.
        text = "".join(traceback.format_exception(type(error), error,
                                                  error.__traceback__.tb_next))
        try:
            conn.send(("err", text))
        except OSError:
            pass  # the parent is gone; the exit status is all that is left to say
        # This function is the process's entry point: its exit status is ours to set.
        raise SystemExit(1) from None
    finally:
        conn.close()


def spawn(target: Callable[..., Any], world_size: int, args: Sequence[Any] = (), *,
          rank_args: Optional[Callable[[int], Sequence[Any]]] = None,
          env: Optional[RankEnv] = None, daemon: bool = False) -> Job:
    """Starts ``world_size`` processes of multiprocessing's "spawn" context.

    Rank ``r`` calls ``target(r, *args, *rank_args(r))``; ``target`` and the
    arguments must pickle (a module-level function). Its return value ends up
    in ``Job.results[r]``; an exception, as its traceback in ``RankFailed``.
    ``env`` is in the rank's environment from the start of its interpreter
    (multiprocessing has no environment argument, so it is set in this
    process's environment while the rank starts, then restored). ``daemon``
    makes multiprocessing terminate the ranks when this process exits, and
    forbids them children of their own.
    """
    context = multiprocessing.get_context("spawn")
    job = Job(world_size)
    try:
        for rank in range(world_size):
            extra = tuple(rank_args(rank)) if rank_args is not None else ()
            reader, writer = context.Pipe(duplex=False)
            process = context.Process(target=_run_function_rank, daemon=daemon,
                                      name=f"pyddp-rank{rank}",
                                      args=(writer, target, rank, (*args, *extra)))
            with temporary_environ(_rank_value(env, rank)):
                process.start()
            # The rank holds the only write end, so its exit shows here as EOF.
            writer.close()
            logger.debug("started rank %d (pid %d): %s", rank, process.pid,
                         getattr(target, "__qualname__", target))
            job._add(_SpawnedProcess(process, f"rank {rank}", (rank,)), reader)
    except BaseException:
        job.reap(0.0)
        raise
    return job


def _command_environment(extra: Mapping[str, str]) -> dict[str, str]:
    """This process's environment, pyddp's parent directory first on PYTHONPATH, and ``extra``."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


def _start_command(argv: Sequence[str], env: Mapping[str, str], name: str,
                   ranks: tuple[int, ...], log_path: Optional[str]) -> _CommandProcess:
    if log_path is None:
        process = subprocess.Popen(list(argv), env=dict(env), stdin=subprocess.DEVNULL)
    else:
        with open(log_path, "wb") as log:
            process = subprocess.Popen(list(argv), env=dict(env), stdin=subprocess.DEVNULL,
                                       stdout=log, stderr=subprocess.STDOUT)
    logger.debug("started %s (pid %d): %s", name, process.pid, " ".join(argv))
    return _CommandProcess(process, name, ranks, log_path)


def start_commands(command: Sequence[str], world_size: int, *, env: Optional[RankEnv] = None,
                   prefix: Optional[RankPrefix] = None,
                   log_dir: Optional[str] = None) -> Job:
    """Starts ``command`` once per rank.

    Rank ``r`` runs ``[*prefix(r), *command]`` with this process's environment,
    pyddp's parent directory first on PYTHONPATH, RANK, WORLD_SIZE,
    LOCAL_RANK and LOCAL_WORLD_SIZE (one host: the local rank is the rank;
    ``SimulatedHosts`` sets them per host), and ``env`` (or ``env(r)``) over all
    of them. With ``log_dir``, its stdout and
    stderr go to ``log_dir/rank{r}.log``, whose tail a failure report quotes.
    """
    job = Job(world_size)
    try:
        for rank in range(world_size):
            rank_env = _command_environment({
                "RANK": str(rank), "WORLD_SIZE": str(world_size),
                "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size),
                **_rank_value(env, rank)})
            argv = [*(prefix(rank) if prefix is not None else ()), *command]
            log_path = None if log_dir is None else os.path.join(log_dir, f"rank{rank}.log")
            job._add(_start_command(argv, rank_env, f"rank {rank}", (rank,), log_path))
    except BaseException:
        job.reap(0.0)
        raise
    return job


def start_launcher(command: Sequence[str], world_size: int, *,
                   env: Optional[Mapping[str, str]] = None,
                   log_dir: Optional[str] = None) -> Job:
    """Starts ``command``, which starts all ``world_size`` ranks itself (mpirun).

    It gets this process's environment, pyddp's parent directory first on
    PYTHONPATH, and ``env``. With ``log_dir``, its output (every rank's, under
    mpirun) goes to ``log_dir/NAME.log``, NAME being the command's file name.
    The job cannot tell one of its ranks from another until they report their
    pids (``Job.adopt``); a failure names the launcher and the ranks that had
    not finished.
    """
    name = os.path.basename(command[0])
    log_path = None if log_dir is None else os.path.join(log_dir, f"{name}.log")
    job = Job(world_size)
    process = _start_command(command, _command_environment(env or {}), name,
                             tuple(range(world_size)), log_path)
    job._add(process)
    job._launcher = process
    return job


UNSHARE = ("unshare", "--uts", "--mount", "--propagation", "private")
"""The wrapper that puts a rank in a UTS and mount namespace of its own, private to it."""

UNSHARE_PROBE_SECONDS = 30.0
"""How long the probe of ``simulated_hosts_unavailable`` may take (it answers in
milliseconds; the bound only keeps a wedged ``unshare`` from hanging the caller)."""


def simulated_hosts_unavailable() -> Optional[str]:
    """None when ``SimulatedHosts`` can run here; else why not (for a skip or an error)."""
    if shutil.which(UNSHARE[0]) is None:
        return "unshare (util-linux) is not installed"
    if os.geteuid() != 0:
        return "making mount and UTS namespaces (unshare) needs root"
    probe = subprocess.run([*UNSHARE, "sh", "-c", "hostname probe && mount --bind /tmp /dev/shm"],
                           capture_output=True, text=True, timeout=UNSHARE_PROBE_SECONDS)
    if probe.returncode != 0:
        return f"unshare failed here: {probe.stderr.strip()}"
    return None


class SimulatedHosts:
    """Hosts simulated on this machine, for ranks started by ``start_commands``.

    Each rank runs in a UTS and mount namespace of its own (``UNSHARE``) with
    its host's hostname and its host's directory bind-mounted on /dev/shm:
    ranks of one host share shared memory, ranks of different hosts cannot
    see each other's, while loopback TCP (torch's stores, gloo) still
    connects them, as separate machines on one network would be. Making the
    namespaces needs root; ``simulated_hosts_unavailable`` says why they
    cannot be made here. The hosts' directories live in ``directory`` and go
    with it.
    """

    ENV = {"GLOO_SOCKET_IFNAME": "lo"}
    """gloo binds to the address of the hostname, which simulated hostnames do not
    have: loopback, said so rather than warned about."""

    def __init__(self, placement: Sequence[str], directory: str) -> None:
        """``placement[r]`` names the host of rank r; ``directory`` exists and outlives the ranks."""
        self.placement = list(placement)
        self._directory = directory
        for host in dict.fromkeys(self.placement):
            os.mkdir(self.shm(host), 0o1777)

    def shm(self, host: str) -> str:
        """The directory that is /dev/shm on ``host``."""
        return os.path.join(self._directory, f"shm-{host}")

    def prefix(self, rank: int) -> list[str]:
        """The argv prefix that runs rank ``rank``'s command on its host."""
        host = self.placement[rank]
        # exec: the rank keeps the pid the launcher knows, so kill() reaches it.
        script = 'hostname "$1" && mount --bind "$2" /dev/shm && shift 2 && exec "$@"'
        return [*UNSHARE, "sh", "-c", script, "sh", host, self.shm(host)]

    def environment(self, rank: int) -> dict[str, str]:
        """``ENV``, and LOCAL_RANK and LOCAL_WORLD_SIZE of rank ``rank`` on its host."""
        host = self.placement[rank]
        return {**self.ENV, "LOCAL_RANK": str(self.placement[:rank].count(host)),
                "LOCAL_WORLD_SIZE": str(self.placement.count(host))}

    def start_commands(self, command: Sequence[str], *, env: Optional[RankEnv] = None,
                       log_dir: Optional[str] = None) -> Job:
        """``start_commands`` with one rank per entry of the placement, each on its host.

        ``env`` (or ``env(r)``) goes over ``environment(r)``.
        """
        return start_commands(command, len(self.placement), prefix=self.prefix,
                              env=lambda rank: {**self.environment(rank),
                                                **_rank_value(env, rank)},
                              log_dir=log_dir)
