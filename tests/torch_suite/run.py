"""Runs PyTorch's own distributed test suite against pyddp, with gloo as the baseline.

    python tests/torch_suite/run.py                 # both backends, the list of selection.py
    python tests/torch_suite/run.py -k object       # tests whose name contains "object"
    python tests/torch_suite/run.py --backends pyddp --json out.json

Like torch's ``test/distributed/test_distributed_spawn.py``, it runs the tests of
``DistributedTest._DistTestBase`` (``torch/testing/_internal/distributed/
distributed_test.py``) through a ``MultiProcessTestCase`` subclass, one
process per rank, the backend named by the ``BACKEND`` variable and a file://
rendezvous in ``TEMP_DIR``. torch's suite reads ``BACKEND`` when it is
imported, so each backend runs in a child process of this script
(``--child``); the parent classifies and prints the results.

Ranks are forked from the child, which has imported torch and the suite
once, instead of spawned as in torch's driver: spawning re-imports them in
every rank of every test, about 10 s a test on a 2-core machine, against
well under 1 s forked.

What is expected of each test is in ``selection.py``: a test needing an
operation pyddp does not implement yet must fail with pyddp's refusal of
it; a known failure must fail with its known message; every other test must
pass on both backends (or be skipped by torch, with torch's reason). Exits 1
when anything else happens: a failure, or a pass that ``selection.py`` does
not expect.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# An installed pyddp comes first; else the source tree's in-place build.
sys.path.append(os.path.dirname(os.path.dirname(HERE)))

import selection  # noqa: E402

BACKENDS = ("pyddp", "gloo")
TEST_TIMEOUT_S = 60
"""Bounds each test (torch's MultiProcessTestCase kills its ranks after this)."""
CHILD_TIMEOUT_S = 900
"""Bounds one backend's whole run."""


def all_tests() -> Dict[str, Optional[str]]:
    """Every selected test and the operation of NOT_IMPLEMENTED_YET it needs (or None)."""
    return {test: need for group in selection.TESTS.values() for test, need in group.items()}


# --- the child: one backend ---------------------------------------------------------------


def run_child(backend: str, names: List[str], out_path: str) -> None:
    """Runs ``names`` on ``backend``; writes {test: {"outcome", "detail", "seconds"}}."""
    import unittest

    import torch

    import pyddp  # noqa: F401  (registers the "pyddp" backend)
    from torch.testing._internal.common_distributed import DistTestCases

    # How torch's suite learns what a backend beyond its own supports: these
    # sets gate its DDP and subgroup tests, and "plugin" makes
    # require_backend_is_available accept the name.
    for feature in ("ddp", "subgroup", "plugin"):
        DistTestCases.backend_feature[feature].add("pyddp")
    from torch.testing._internal.distributed.distributed_test import (DistributedTest,
                                                                      TestDistBackend)

    class TorchSuite(TestDistBackend, DistributedTest._DistTestBase):
        def setUp(self) -> None:
            super().setUp()
            self._start_processes(torch.multiprocessing.get_context("fork").Process)

    for name in names:
        fn = getattr(TorchSuite, name)
        why = getattr(fn, "__unittest_skip_why__", "")
        gate = selection.LIFTED_GATES.get(name)
        if getattr(fn, "__unittest_skip__", False) and gate and why.startswith(gate):
            del fn.__unittest_skip__
            del fn.__unittest_skip_why__

    results: Dict[str, dict] = {}

    class Recorder(unittest.TextTestResult):
        def startTest(self, test: unittest.TestCase) -> None:
            self._started = time.monotonic()
            super().startTest(test)

        def _record(self, test: unittest.TestCase, outcome: str, detail: str = "") -> None:
            results[test._testMethodName] = {
                "outcome": outcome, "detail": detail,
                "seconds": round(time.monotonic() - self._started, 2)}

        def addSuccess(self, test):
            super().addSuccess(test)
            self._record(test, "passed")

        def addFailure(self, test, err):
            super().addFailure(test, err)
            self._record(test, "failed", self._exc_info_to_string(err, test))

        def addError(self, test, err):
            super().addError(test, err)
            self._record(test, "failed", self._exc_info_to_string(err, test))

        def addSkip(self, test, reason):
            super().addSkip(test, reason)
            self._record(test, "skipped", reason)

    suite = unittest.TestSuite(TorchSuite(name) for name in names)
    with open(os.devnull, "w") as quiet:
        unittest.TextTestRunner(stream=quiet, resultclass=Recorder).run(suite)
    with open(out_path, "w") as f:
        json.dump(results, f)


# --- the parent: classify and report --------------------------------------------------------


def classify(backend: str, test: str, result: dict) -> tuple:
    """(verdict, note): verdict is "passed", "expected failure", "skipped" or "FAILED"."""
    outcome, detail = result["outcome"], result["detail"]
    if outcome == "skipped":
        return "skipped", detail
    if backend != "pyddp":
        return ("passed", "") if outcome == "passed" else ("FAILED", detail)
    need = all_tests()[test]
    pending = need if need in selection.NOT_IMPLEMENTED_YET else None
    known = selection.KNOWN_FAILURES.get(test)
    if outcome == "passed":
        if pending:
            return "FAILED", (f"passes although {pending!r} is in NOT_IMPLEMENTED_YET: delete its "
                              "line in tests/torch_suite/selection.py")
        if known:
            return "FAILED", ("passes although it is in KNOWN_FAILURES: delete it there in "
                              "tests/torch_suite/selection.py")
        return "passed", ""
    if pending:
        refused = "|".join(map(re.escape, selection.NOT_IMPLEMENTED_YET[pending]))
        if re.search(rf"\(c10d's ({refused})\)", detail):
            return "expected failure", f"not implemented yet: {pending}"
        return "FAILED", f"needs {pending}, but failed otherwise:\n{detail}"
    if known and known[1] in detail:
        return "expected failure", known[0]
    return "FAILED", detail


def run_backend(backend: str, names: List[str]) -> Dict[str, dict]:
    """Runs the child for ``backend``; its results by test, or raises with its output."""
    with tempfile.TemporaryDirectory(prefix="pyddp-torch-suite-") as tmp:
        out = os.path.join(tmp, "results.json")
        env = dict(os.environ, BACKEND=backend, WORLD_SIZE=str(selection.WORLD_SIZE),
                   TEMP_DIR=tmp, DISTRIBUTED_TESTS_DEFAULT_TIMEOUT=str(TEST_TIMEOUT_S))
        # Some of torch's tests set a debug level themselves and expect only
        # theirs; one inherited from the caller would change their checks.
        env.pop("TORCH_DISTRIBUTED_DEBUG", None)
        log_path = os.path.join(tmp, "child.log")
        with open(log_path, "w") as log:
            # A session of its own, so that a run past its time is ended with
            # every rank it forked.
            proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child",
                                     backend, "--out", out, *names], env=env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                proc.wait(timeout=CHILD_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if proc.returncode != 0 or not os.path.exists(out):
            with open(log_path) as log:
                tail = log.read()[-6000:]
            raise RuntimeError(f"the {backend} run exited with {proc.returncode}:\n{tail}")
        with open(out) as f:
            return json.load(f)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-k", dest="pattern", default="",
                        help="only the tests whose name contains this")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--json", help="write every result to this file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("names", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_child(args.child, args.names, args.out)
        return 0

    names = [t for t in all_tests() if args.pattern in t]
    backends = args.backends.split(",")
    report: Dict[str, Dict[str, dict]] = {}
    failed = False
    for backend in backends:
        start = time.monotonic()
        results = run_backend(backend, names)
        seconds = time.monotonic() - start
        report[backend] = {}
        counts = {"passed": 0, "FAILED": 0, "skipped": 0, "expected failure": 0}
        print(f"\n=== {backend}: {len(names)} tests of torch's distributed suite, "
              f"{selection.WORLD_SIZE} ranks ({seconds:.0f} s) ===")
        for test in names:
            result = results.get(test, {"outcome": "failed", "detail": "no result", "seconds": 0})
            verdict, note = classify(backend, test, result)
            counts[verdict] += 1
            report[backend][test] = dict(result, verdict=verdict, note=note)
            if verdict != "passed":
                first = note.strip().splitlines()[0] if note.strip() else ""
                print(f"  {verdict:16s} {test}: {first}")
            if verdict == "FAILED":
                failed = True
                print("    " + note.strip().replace("\n", "\n    ")[-4000:])
        print(f"{backend}: {counts['passed']} passed, {counts['FAILED']} failed, "
              f"{counts['skipped']} skipped, {counts['expected failure']} expected failures")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if len(backends) > 1:
        base, *others = backends
        for other in others:
            lost = [t for t in names if report[other][t]["verdict"] == "passed"
                    and report[base][t]["verdict"] != "passed"]
            print(f"{other} passes, {base} does not: {', '.join(lost) or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
