"""python -m pyddp.bench recovery runs a job that loses a rank and reports every survivor:
a row per survivor and job, with times that lie between the kill and the end of the run,
and the medians. (What the times are is the benchmark's to say, not this test's.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from paths import REPO

pytestmark = pytest.mark.multiprocess


def test_the_recovery_benchmark_reports_each_survivor():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pyddp.bench", "recovery", "--world-size",
                           "3", "--steps", "5", "--repeat", "1"], capture_output=True,
                          text=True, timeout=300, env=env)
    elapsed = time.monotonic() - start
    assert done.returncode == 0, done.stdout + done.stderr
    rows = re.findall(r"^ +0 +(\d) +([0-9.]+) +([0-9.]+) +([0-9.]+) +([0-9.]+)$", done.stdout,
                      re.MULTILINE)
    assert [int(r[0]) for r in rows] == [0, 1], done.stdout
    for _, detection, recovery, after, fresh in rows:
        assert 0 < float(detection) <= float(recovery) < 1000 * elapsed
        assert float(after) > 0 and float(fresh) > 0
    assert "# median: detection" in done.stdout, done.stdout
