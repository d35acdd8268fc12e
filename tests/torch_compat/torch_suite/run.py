"""Runs PyTorch's own distributed test suite against pyddp, with gloo as the baseline.

    python tests/torch_compat/torch_suite/run.py            # the whole class, both backends
    python tests/torch_compat/torch_suite/run.py -k object  # tests whose name contains "object"
    python tests/torch_compat/torch_suite/run.py --json out.json

Like torch's ``test/distributed/test_distributed_spawn.py``
(``TestDistBackendWithSpawn``), it runs every test of
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

Two reports:

1. The class as torch gates it: every test that passes with gloo must pass
   with pyddp, unless ``selection.DIFFERENCES`` lists it with pyddp's outcome
   and the reason (a skip by torch's check of the backend's name, a failure
   torch's Python or the test's body makes for every backend but gloo).
2. The tests that pass with gloo and that torch skips for pyddp, run again on
   pyddp with torch's skips lifted: each must pass, unless
   ``selection.LIFTED_FAILURES`` says why it fails.

Exits 1 when anything else happens, or when a listed difference no longer
happens (so that the lists stay true).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# An installed pyddp comes first; else the source tree's in-place build.
sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(HERE))))

import selection  # noqa: E402

BACKENDS = ("gloo", "pyddp")
TEST_TIMEOUT_S = 60
"""Bounds each test (torch's MultiProcessTestCase kills its ranks after this)."""
CHILD_TIMEOUT_S = 1200
"""Bounds one backend's whole run."""


def suite_source() -> str:
    """torch's distributed_test.py, located, not imported (importing it needs BACKEND)."""
    spec = importlib.util.find_spec("torch.testing._internal.distributed.distributed_test")
    with open(spec.origin, encoding="utf-8") as f:
        return f.read()


def suite_tests(source: str) -> Dict[str, ast.FunctionDef]:
    """Every test of DistributedTest._DistTestBase, in the file's order, with its definition."""
    tree = ast.parse(source)
    outer = next(n for n in tree.body if isinstance(n, ast.ClassDef)
                 and n.name == "DistributedTest")
    base = next(n for n in outer.body if isinstance(n, ast.ClassDef) and n.name == "_DistTestBase")
    return {n.name: n for n in base.body
            if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}


# --- the child: one backend ---------------------------------------------------------------


def run_child(backend: str, names: List[str], out_path: str, lift: bool) -> None:
    """Runs ``names`` on ``backend`` (with their skips lifted when ``lift``); writes
    {test: {"outcome", "detail", "seconds"}}."""
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

    if lift:
        for name in names:
            fn = getattr(TorchSuite, name)
            if getattr(fn, "__unittest_skip__", False):
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


def classify(test: str, gloo: dict, pyddp: dict) -> Tuple[str, str]:
    """pyddp's verdict on ``test`` beside gloo's outcome: (verdict, note), the verdict one of
    "passed", "as gloo" (neither passed: both skipped or failed as torch gates or fails them
    here), "expected difference" or "FAILED"."""
    listed = selection.DIFFERENCES.get(test)
    if pyddp["outcome"] == "passed":
        if listed:
            return "FAILED", ("passes although it is in DIFFERENCES: delete it there in "
                              "tests/torch_compat/torch_suite/selection.py")
        return "passed", ""
    if gloo["outcome"] != "passed":
        return "as gloo", f"gloo {gloo['outcome']} too"
    if listed:
        outcome, reason, text = listed
        if pyddp["outcome"] == outcome and text in pyddp["detail"]:
            return "expected difference", reason
        return "FAILED", (f"listed in DIFFERENCES as {outcome} ({text!r}), but "
                          f"{pyddp['outcome']}:\n{pyddp['detail']}")
    return "FAILED", f"passes with gloo, {pyddp['outcome']} with pyddp:\n{pyddp['detail']}"


def classify_lifted(test: str, result: dict) -> Tuple[str, str]:
    """pyddp's verdict on a test torch skips for pyddp by name, run with the skips lifted."""
    listed = selection.LIFTED_FAILURES.get(test)
    if result["outcome"] == "passed":
        if listed:
            return "FAILED", ("passes although it is in LIFTED_FAILURES: delete it there in "
                              "tests/torch_compat/torch_suite/selection.py")
        return "passed", ""
    if listed and result["outcome"] == "failed" and listed[1] in result["detail"]:
        return "expected failure", listed[0]
    return "FAILED", f"{result['outcome']}:\n{result['detail']}"


def run_backend(backend: str, names: List[str], lift: bool = False) -> Dict[str, dict]:
    """Runs the child for ``backend``; its results by test, or raises with its output."""
    with tempfile.TemporaryDirectory(prefix="pyddp-torch-suite-") as tmp:
        out = os.path.join(tmp, "results.json")
        # TMPDIR too: torch's MultiProcessTestCase makes each test's FileStore
        # with NamedTemporaryFile(delete=False) and never removes it; here it
        # goes with the directory.
        env = dict(os.environ, BACKEND=backend, WORLD_SIZE=str(selection.WORLD_SIZE),
                   TEMP_DIR=tmp, TMPDIR=tmp,
                   DISTRIBUTED_TESTS_DEFAULT_TIMEOUT=str(TEST_TIMEOUT_S))
        # Some of torch's tests set a debug level themselves and expect only
        # theirs; one inherited from the caller would change their checks.
        env.pop("TORCH_DISTRIBUTED_DEBUG", None)
        log_path = os.path.join(tmp, "child.log")
        with open(log_path, "w") as log:
            # A session of its own, so that a run past its time is ended with
            # every rank it forked.
            proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child",
                                     backend, "--out", out, *(["--lift"] if lift else []),
                                     *names], env=env, stdout=log,
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


def _result(results: Dict[str, dict], test: str) -> dict:
    return results.get(test, {"outcome": "failed", "detail": "no result", "seconds": 0})


def _print_verdicts(title: str, verdicts: Dict[str, Tuple[str, str]]) -> bool:
    """Prints every verdict but a pass; returns whether one FAILED."""
    print(f"\n=== {title} ===")
    counts: Dict[str, int] = {}
    failed = False
    for test, (verdict, note) in verdicts.items():
        counts[verdict] = counts.get(verdict, 0) + 1
        if verdict in ("passed", "as gloo"):
            continue
        first = note.strip().splitlines()[0] if note.strip() else ""
        print(f"  {verdict:20s} {test}: {first}")
        if verdict == "FAILED":
            failed = True
            print("    " + note.strip().replace("\n", "\n    ")[-4000:])
    print(", ".join(f"{n} {v}" for v, n in sorted(counts.items())))
    return failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-k", dest="pattern", default="",
                        help="only the tests whose name contains this")
    parser.add_argument("--json", help="write every result to this file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--lift", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("names", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_child(args.child, args.names, args.out, args.lift)
        return 0

    names = [t for t in suite_tests(suite_source()) if args.pattern in t]
    report: Dict[str, Dict[str, dict]] = {}
    for backend in BACKENDS:
        start = time.monotonic()
        report[backend] = run_backend(backend, names)
        seconds = time.monotonic() - start
        outcomes: Dict[str, int] = {}
        for test in names:
            outcome = _result(report[backend], test)["outcome"]
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
        print(f"{backend}: {len(names)} tests of torch's distributed suite, "
              f"{selection.WORLD_SIZE} ranks, {seconds:.0f} s: "
              + ", ".join(f"{n} {o}" for o, n in sorted(outcomes.items())))
    verdicts = {t: classify(t, _result(report["gloo"], t), _result(report["pyddp"], t))
                for t in names}
    failed = _print_verdicts("pyddp beside gloo (torch's gates as they are)", verdicts)
    gated = [t for t in names if _result(report["gloo"], t)["outcome"] == "passed"
             and _result(report["pyddp"], t)["outcome"] == "skipped"]
    if gated:
        start = time.monotonic()
        report["pyddp, gates lifted"] = run_backend("pyddp", gated, lift=True)
        lifted = {t: classify_lifted(t, _result(report["pyddp, gates lifted"], t))
                  for t in gated}
        failed |= _print_verdicts(f"pyddp with torch's gates lifted: the {len(gated)} tests "
                                  f"gloo passes and torch skips for pyddp "
                                  f"({time.monotonic() - start:.0f} s)", lifted)
    # A listed difference that no longer happens must leave the list.
    stale = sorted([t for t in selection.DIFFERENCES if t in names
                    and verdicts[t][0] == "as gloo"] +
                   [t for t in selection.LIFTED_FAILURES if t in names and t not in gated])
    if stale:
        failed = True
        print(f"\nlisted in selection.py, but gloo does not pass them or torch no longer "
              f"skips them for pyddp: {', '.join(stale)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
