"""Ranks on simulated hosts, for tests of groups that span machines.

Each simulated host is its own UTS and mount namespace (``unshare --uts --mount
--propagation private``) with another hostname and a private tmpfs on /dev/shm:
no shared memory passes between hosts, while loopback TCP (torch's stores, gloo)
still connects them, as separate machines on one network would be. The ranks of
one host share its namespace. Making namespaces needs root (CI runs as root);
``why_not()`` says why they cannot be made here, for a skip with the reason.

``HostRanks(placement)`` starts one process per rank once, on the hosts the
placement names, and ``run(fn, *args)`` calls the module-level function
``fn(ctx, *args)`` on every rank, as ``harness.Ranks`` does for one host. Every
wait is bounded; every process is killed by its process group at the end.
"""

from __future__ import annotations

import multiprocessing.connection as mpc
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

from harness import DEFAULT_CALL_TIMEOUT, START_TIMEOUT, Died, RankContext, RankFailure

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
# A private /dev/shm as large as the tests need (segments of a few MiB).
SHM_SIZE = "512m"


def why_not() -> Optional[str]:
    """None when simulated hosts can be made here; else why not."""
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is not installed"
    if os.geteuid() != 0:
        return "making mount and UTS namespaces needs root"
    probe = subprocess.run(["unshare", "--uts", "--mount", "--propagation", "private", "sh", "-c",
                            "hostname probe && mount -t tmpfs tmpfs /dev/shm"],
                           capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"unshare failed here: {probe.stderr.strip()}"
    return None


class HostRanks:
    def __init__(self, placement: List[str], env: Optional[Dict[str, str]] = None,
                 setup: Optional[Callable] = None) -> None:
        """placement[r] names the host of rank r."""
        self.world_size = len(placement)
        self.placement = list(placement)
        self.tmpdir = tempfile.mkdtemp(prefix="pyddp-hosts-")
        key = secrets.token_bytes(16)
        self._key = key
        # gloo binds to the address of the hostname, which the simulated
        # hostnames do not have: loopback, said so rather than warned about.
        child_env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", **(env or {}))
        child_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (TESTS, ROOT, child_env.get("PYTHONPATH")) if p)
        child_env["PYDDP_TEST_AUTHKEY"] = key.hex()
        self._hosts: List[subprocess.Popen] = []
        for host in dict.fromkeys(placement):
            ranks = [r for r, h in enumerate(placement) if h == host]
            workers = " ".join(
                shlex.join([sys.executable, __file__, str(r), str(self.world_size),
                            self.tmpdir]) + " &" for r in ranks)
            script = (f"hostname {shlex.quote(host)} && "
                      f"mount -t tmpfs -o size={SHM_SIZE} tmpfs /dev/shm && "
                      f"{{ {workers} wait; }}")
            self._hosts.append(subprocess.Popen(
                ["unshare", "--uts", "--mount", "--propagation", "private", "sh", "-c", script],
                env=child_env, start_new_session=True, stdin=subprocess.DEVNULL))
        self._conns: List[Any] = [None] * self.world_size
        self._pids: List[int] = [0] * self.world_size
        try:
            self._accept()
            if setup is not None:
                self.run(setup, timeout=START_TIMEOUT)
        except BaseException:
            self.close()
            raise

    def _accept(self) -> None:
        """Connects to every rank, which says where it listens in a file of tmpdir."""
        deadline = time.monotonic() + START_TIMEOUT
        for rank in range(self.world_size):
            path = os.path.join(self.tmpdir, f"rank{rank}.address")
            while not os.path.exists(path):
                if time.monotonic() > deadline or any(h.poll() is not None for h in self._hosts):
                    raise RankFailure(f"rank {rank} on host {self.placement[rank]} did not start "
                                      f"within {START_TIMEOUT} s")
                time.sleep(0.05)
            with open(path) as f:
                port = int(f.read())
            conn = mpc.Client(("127.0.0.1", port), authkey=self._key)
            self._conns[rank], self._pids[rank] = conn, conn.recv()

    def _collect(self, timeout: float, what: str, allow_dead: bool) -> List[Any]:
        results: List[Any] = []
        failures = []
        for rank, conn in enumerate(self._conns):
            if not conn.poll(timeout):
                self.close()
                raise RankFailure(f"rank {rank} gave no answer to {what} within {timeout} s")
            try:
                status, value = conn.recv()
            except EOFError:
                status, value = "dead", Died(None)
            if status == "dead" and allow_dead:
                results.append(value)
            elif status == "dead":
                failures.append(f"--- rank {rank} (host {self.placement[rank]}) exited ---")
                results.append(None)
            elif status == "err":
                failures.append(f"--- rank {rank} (host {self.placement[rank]}) ---\n{value}")
                results.append(None)
            else:
                results.append(value)
        if failures:
            raise RankFailure(f"{what} failed:\n" + "\n".join(failures))
        return results

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
        """SIGKILLs rank ``rank`` (its pid as the rank reported it)."""
        try:
            os.kill(self._pids[rank], signal.SIGKILL)
        except ProcessLookupError:
            pass

    def close(self) -> None:
        for conn in self._conns:
            if conn is not None:
                try:
                    conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
        for host in self._hosts:
            try:
                host.wait(30)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(host.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            host.wait(10)
        shutil.rmtree(self.tmpdir, ignore_errors=True)


def _worker(rank: int, world_size: int, tmpdir: str) -> None:
    """One rank: runs the functions the parent sends until it sends None."""
    import importlib

    import torch

    torch.set_num_threads(1)
    key = bytes.fromhex(os.environ["PYDDP_TEST_AUTHKEY"])
    listener = mpc.Listener(("127.0.0.1", 0), authkey=key)
    path = os.path.join(tmpdir, f"rank{rank}.address")
    with open(path + ".tmp", "w") as f:
        f.write(str(listener.address[1]))
    os.rename(path + ".tmp", path)  # the parent never reads half a port
    conn = listener.accept()
    listener.close()
    conn.send(os.getpid())
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
    _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
