"""Training that survives a killed rank: examples/train.py under torchrun's restarts.

A rank is SIGKILLed once rank 0 has written its first checkpoint. pyddp must
make the survivor fail at once naming the dead rank, torchrun must start both
ranks again, pyddp must initialise again on the same machine (no segment,
port or name left from the first attempt), and training must resume from the
checkpoint and end with the accuracy of an uninterrupted run.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from harness import pyddp_segments
from paths import REPO

pytestmark = pytest.mark.multiprocess

TRAIN = os.path.join(REPO, "examples", "train.py")
ARGS = ["--epochs", "6", "--checkpoint-every", "10"]
RUN_SECONDS = 300
"""Bound on one whole training job (about 10 s on an idle 2-core machine)."""



def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (REPO, os.environ.get("PYTHONPATH")) if p))


def _accuracy(output: str) -> str:
    found = re.findall(r"final test accuracy: ([0-9.]+)%", output)
    assert found, output[-3000:]
    return found[-1]


def _workers(root: int) -> dict:
    """LOCAL_RANK -> pid of the training processes below ``root`` (torchrun's workers)."""
    found, todo = {}, [root]
    while todo:
        pid = todo.pop()
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                children = [int(c) for c in f.read().split()]
        except OSError:
            continue
        todo += children
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if pid != root and b"train.py" in cmdline and b"LOCAL_RANK" in env:
            found[int(env[b"LOCAL_RANK"])] = pid
    return found


def test_a_killed_rank_is_survived_under_torchrun_restarts(tmp_path):
    reference = subprocess.run([sys.executable, TRAIN, *ARGS], env=_env(), capture_output=True,
                               text=True, timeout=RUN_SECONDS)
    assert reference.returncode == 0, reference.stderr[-3000:]

    checkpoint = tmp_path / "checkpoint"
    log = tmp_path / "torchrun.log"
    # torchrun stops every worker within its monitor interval of one's death
    # (0.1 s by default): on a loaded machine that could come before the
    # survivor, busy between collectives, noticed the death and said so.
    with open(log, "w") as out:
        job = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             "--nproc-per-node", "2", "--max-restarts", "2", "--monitor-interval", "2",
             TRAIN, *ARGS, "--checkpoint", str(checkpoint)],
            env=_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + RUN_SECONDS
        victim = None
        while victim is None:
            assert job.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint was written"
            if (checkpoint / "checkpoint.pt").exists():
                victim = _workers(job.pid).get(1)
            time.sleep(0.02)
        os.kill(victim, signal.SIGKILL)
        code = job.wait(max(1.0, deadline - time.monotonic()))
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(10)
    output = log.read_text()
    assert code == 0, output[-3000:]
    # The survivor named the dead rank, torchrun restarted, training resumed.
    assert re.search(r"rank 0: .*rank 1", output), output[-3000:]
    assert "resumed from" in output, output[-3000:]
    assert _accuracy(output) == _accuracy(reference.stdout)
    assert pyddp_segments() == []
