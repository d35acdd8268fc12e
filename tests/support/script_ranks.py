"""Ranks that are plain interpreters running a script (``python -c``), for tests that
must see what a whole process does: exit, get interrupted, leave its groups behind."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Callable, Dict, Optional

from paths import REPO, SUPPORT


def _script_env(extra: Optional[Dict[str, str]]) -> dict:
    """Scripts import pyddp from this tree and the helpers (fault_stores) from tests/support."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        [REPO, SUPPORT] + [p for p in sys.path if p]), **(extra or {}))


@contextlib.contextmanager
def script_ranks(script: str, world: int, *args: str,
                 env: Optional[Callable[[int], Optional[Dict[str, str]]]] = None):
    """``world`` interpreters running ``script`` with the arguments rank, a store
    path and ``args`` (stdin a pipe), rank r with ``env(r)`` in its environment too;
    every one killed and the store removed on the way out."""
    path = tempfile.mktemp(prefix="pyddp-faults-")
    # SIGINT as a foreground job has it (see harness._rank_main).
    procs = [subprocess.Popen([sys.executable, "-c", script, str(r), path, *args],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=_script_env(env(r) if env is not None else None),
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
             for r in range(world)]
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        if os.path.exists(path):
            os.remove(path)


def next_line(p: subprocess.Popen, timeout: float) -> str:
    """p's next line of output, or a failure after `timeout` seconds (a rank that hangs
    is killed by the caller's cleanup, which ends the reading thread)."""
    lines = []
    reader = threading.Thread(target=lambda: lines.append(p.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    assert lines, f"no output from pid {p.pid} within {timeout} s (exit code {p.poll()})"
    return lines[0]
