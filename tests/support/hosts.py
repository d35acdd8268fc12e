"""Ranks on simulated hosts, for tests of groups that span machines.

Each rank runs on a host simulated by pyddp's launcher (``pyddp._launch.
SimulatedHosts``: a UTS and mount namespace of its own, with its host's
hostname and its host's private /dev/shm; loopback TCP connects the hosts).
Making namespaces needs root (CI runs as root);
``_launch.simulated_hosts_unavailable()`` says why they cannot be made here,
for a skip with the reason.

``HostRanks(placement)`` starts one process per rank once, through pyddp's
launcher (which supervises and reaps them), on the hosts the placement
names, and ``run(fn, *args)`` calls the module-level function ``fn(ctx,
*args)`` on every rank, as ``harness.Ranks`` does for one host. Every wait is
bounded.
"""

from __future__ import annotations

import multiprocessing.connection as mpc
import os
import secrets
import signal
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

from harness import DEFAULT_CALL_TIMEOUT, RankContext, RankFailure, collect
from pyddp import _launch


class HostRanks:
    def __init__(self, placement: List[str], env: Optional[Dict[str, str]] = None,
                 setup: Optional[Callable] = None) -> None:
        """placement[r] names the host of rank r."""
        self.world_size = len(placement)
        self.placement = list(placement)
        self._rendezvous = _launch.Rendezvous(prefix="pyddp-hosts-")
        self.tmpdir = self._rendezvous.directory
        self._key = secrets.token_bytes(16)
        # The ranks are commands, not spawned processes: they get this process's sys.path
        # as spawned ranks do, so that they import the tests' modules from their folders.
        self._job = _launch.SimulatedHosts(self.placement, self.tmpdir).start_commands(
            [sys.executable, __file__, self.tmpdir], log_dir=self.tmpdir,
            env={"PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
                 "PYDDP_TEST_AUTHKEY": self._key.hex(), **(env or {})})
        self._conns: List[Any] = [None] * self.world_size
        try:
            self._accept()
            if setup is not None:
                self.run(setup, timeout=_launch.STARTUP_SECONDS)
        except BaseException:
            self.close()
            raise

    def _accept(self) -> None:
        """Connects to every rank, which says where it listens in a file of tmpdir."""
        deadline = time.monotonic() + _launch.STARTUP_SECONDS
        for rank in range(self.world_size):
            path = os.path.join(self.tmpdir, f"rank{rank}.address")
            while not os.path.exists(path):
                code = self._job.exitcode(rank)
                if code is not None or time.monotonic() > deadline:
                    raise RankFailure(f"rank {rank} on host {self.placement[rank]} did not "
                                      f"start (exit code {code}); its output ends:\n"
                                      f"{self._job.log_tail(rank)}")
                time.sleep(_launch.POLL_SECONDS)
            with open(path) as f:
                port = int(f.read())
            self._conns[rank] = mpc.Client(("127.0.0.1", port), authkey=self._key)

    def _collect(self, timeout: float, what: str, allow_dead: bool) -> List[Any]:
        return collect(self._conns, self._job, timeout, what, allow_dead,
                       lambda rank: f"rank {rank} (host {self.placement[rank]})")

    def run_each(self, fns: List[Callable], *args: Any, timeout: float = DEFAULT_CALL_TIMEOUT,
                 allow_dead: bool = False) -> List[Any]:
        """fns[rank](ctx, *args) on each rank."""
        for conn, fn in zip(self._conns, fns):
            conn.send((fn.__module__, fn.__name__, args))
        return self._collect(timeout, "/".join(sorted({f.__name__ for f in fns})), allow_dead)

    def run(self, fn: Callable, *args: Any, timeout: float = DEFAULT_CALL_TIMEOUT) -> List[Any]:
        """fn(ctx, *args) on every rank; the results by rank."""
        return self.run_each([fn] * self.world_size, *args, timeout=timeout)

    def kill(self, rank: int) -> None:
        """SIGKILLs rank ``rank``."""
        try:
            os.kill(self._job.pid(rank), signal.SIGKILL)
        except ProcessLookupError:
            pass

    def close(self) -> None:
        for rank, conn in enumerate(self._conns):
            if conn is not None and self._job.exitcode(rank) is None:
                try:
                    conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
        self._job.reap(_launch.JOIN_SECONDS)
        self._rendezvous.close()


def _worker(tmpdir: str) -> None:
    """One rank: runs the functions the parent sends until it sends None."""
    import importlib

    import torch

    torch.set_num_threads(1)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    key = bytes.fromhex(os.environ["PYDDP_TEST_AUTHKEY"])
    listener = mpc.Listener(("127.0.0.1", 0), authkey=key)
    path = os.path.join(tmpdir, f"rank{rank}.address")
    with open(path + ".tmp", "w") as f:
        f.write(str(listener.address[1]))
    os.rename(path + ".tmp", path)  # the parent never reads half a port
    conn = listener.accept()
    listener.close()
    ctx = RankContext(rank, world_size, tmpdir)
    while True:
        msg = conn.recv()
        if msg is None:
            break
        module, name, args = msg
        try:
            fn = getattr(importlib.import_module(module), name)
            conn.send(("ok", fn(ctx, *args)))
        except BaseException:
            conn.send(("err", traceback.format_exc()))
    for group in ctx.groups.values():
        group.shutdown()


if __name__ == "__main__":
    _worker(sys.argv[1])
