"""Spawned ranks for multi-process tests.

A ``Ranks`` pool starts ``world_size`` processes once (importing torch costs
seconds on the 2-core CI machines) and runs many test cases inside them:
``ranks.run(fn, *args)`` calls the module-level function ``fn(ctx, *args)`` on
every rank and returns the per-rank results, re-raising the first rank
failure. Every wait is bounded; processes that do not answer are killed.
pyddp's launcher (``pyddp._launch``) starts, supervises and reaps the
processes; this module adds the pipes that carry the calls.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import re
import signal
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from pyddp import _launch

DEFAULT_CALL_TIMEOUT = 120.0


class RankFailure(AssertionError):
    """A rank raised; the message carries its traceback."""


@dataclass
class Died:
    """Stands in for the result of a rank whose process exited."""

    exitcode: Optional[int]


@dataclass
class RankContext:
    """What a test function gets on each rank."""

    rank: int
    world_size: int
    tmpdir: str
    groups: Dict[str, Any] = field(default_factory=dict)
    state: Dict[str, Any] = field(default_factory=dict)

    def store_path(self, name: str) -> str:
        return os.path.join(self.tmpdir, name)


def _rank_main(rank: int, world_size: int, tmpdir: str, setup: Optional[Callable],
               conn) -> None:
    import torch

    # Ctrl-C as in a foreground Python, even when the suite was started with
    # SIGINT ignored (a background job of a non-interactive shell): a
    # disposition every child inherits, under which Python raises nothing.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    torch.set_num_threads(1)
    ctx = RankContext(rank, world_size, tmpdir)
    try:
        if setup is not None:
            setup(ctx)
        conn.send(("ok", None))
    except BaseException:
        conn.send(("err", traceback.format_exc()))
        return
    while True:
        # Unpickled inside the try: naming ``fn`` imports its module, which can
        # fail (a setup that dropped privileges may no longer read the tests),
        # and the test should get that traceback, not a bare exit code.
        message = conn.recv_bytes()
        try:
            call = pickle.loads(message)
            if call is None:
                break
            fn, args = call
            conn.send(("ok", fn(ctx, *args)))
        except BaseException:
            conn.send(("err", traceback.format_exc()))
    for group in ctx.groups.values():
        group.shutdown()


class Ranks:
    def __init__(self, world_size: int, setup: Optional[Callable] = None,
                 env: Optional[Dict[str, str]] = None) -> None:
        self.world_size = world_size
        self._rendezvous = _launch.Rendezvous(prefix="pyddp-test-")
        self.tmpdir = self._rendezvous.directory
        pipes = [mp.get_context("spawn").Pipe() for _ in range(world_size)]
        self._conns = [parent for parent, _ in pipes]
        try:
            self._job = _launch.spawn(_rank_main, world_size, (world_size, self.tmpdir, setup),
                                      rank_args=lambda rank: (pipes[rank][1],), env=env,
                                      daemon=True)
        except BaseException:
            self._rendezvous.close()
            raise
        finally:
            # The ranks hold the only other ends, so a rank's exit shows here as EOF.
            for _, child in pipes:
                child.close()
        try:
            self._collect(_launch.STARTUP_SECONDS, "start")
        except BaseException:
            self.close()
            raise

    def _collect(self, timeout: float, what: str, allow_dead: bool = False) -> List[Any]:
        return collect(self._conns, self._job, timeout, what, allow_dead)

    def run(self, fn: Callable, *args: Any, timeout: float = DEFAULT_CALL_TIMEOUT) -> List[Any]:
        """fn(ctx, *args) on every rank; the list of results by rank."""
        for conn in self._conns:
            conn.send((fn, args))
        return self._collect(timeout, fn.__name__)

    def run_each(self, fns: List[Callable], *args: Any, timeout: float = DEFAULT_CALL_TIMEOUT,
                 allow_dead: bool = False) -> List[Any]:
        """fns[rank](ctx, *args) on each rank; with allow_dead, a rank whose
        process exits yields a Died result instead of a failure."""
        for conn, fn in zip(self._conns, fns):
            conn.send((fn, args))
        return self._collect(timeout, "/".join(sorted({f.__name__ for f in fns})), allow_dead)

    def pid(self, rank: int) -> int:
        return self._job.pid(rank)

    def kill(self) -> None:
        self._job.kill()

    def close(self) -> None:
        for rank, conn in enumerate(self._conns):
            if self._job.exitcode(rank) is None:
                try:
                    conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
        self._job.reap(_launch.JOIN_SECONDS)
        self._rendezvous.close()


def collect(conns: List[Any], job: _launch.Job, timeout: float, what: str, allow_dead: bool,
            label: Callable[[int], str] = lambda rank: f"rank {rank}") -> List[Any]:
    """Every rank's answer to ``what`` from its connection, by rank.

    A rank that raised, or exited (unless ``allow_dead``: its result is then a
    ``Died``), fails the call with its traceback or exit code; a rank that does
    not answer within ``timeout`` seconds gets the job killed.
    """
    results: List[Any] = []
    failures = []
    for rank, conn in enumerate(conns):
        if not conn.poll(timeout):
            job.kill()
            raise RankFailure(f"{label(rank)} gave no answer to {what} within {timeout} s")
        try:
            status, value = conn.recv()
        except EOFError:
            status, value = "dead", Died(job.exitcode(rank, _launch.EXIT_SECONDS))
        if status == "dead" and allow_dead:
            results.append(value)
            continue
        results.append(None if status != "ok" else value)
        if status == "dead":
            tail = job.log_tail(rank)
            failures.append(f"--- {label(rank)} exited with code {value.exitcode} ---"
                            + ("" if tail is None else f"\n{tail}"))
        elif status == "err":
            failures.append(f"--- {label(rank)} ---\n{value}")
    if failures:
        raise RankFailure(f"{what} failed:\n" + "\n".join(failures))
    return results


def raises(exc_type: type, pattern: str, fn: Callable, *args: Any, **kwargs: Any) -> str:
    """The message of the ``exc_type`` that ``fn(*args, **kwargs)`` raises, which must
    match the regular expression ``pattern``; AssertionError if it does not raise it."""
    try:
        fn(*args, **kwargs)
    except exc_type as error:
        message = str(error)
        assert re.search(pattern, message), f"{message!r} does not match {pattern!r}"
        return message
    raise AssertionError(f"{getattr(fn, '__name__', fn)} did not raise {exc_type.__name__} "
                         f"({pattern})")


def process_exited(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie not yet reaped counts)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def pyddp_segments() -> List[str]:
    """pyddp's shared-memory segments currently named in /dev/shm."""
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith("pyddp-"))
