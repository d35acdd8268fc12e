"""The driver of torch's distributed suite (tests/torch_suite/): its list and its verdicts.

The list must name tests that torch's suite has, skip reasons it gives and
refusals pyddp makes, or the driver would silently run less than it says.
The run itself is a CI step (``python tests/torch_suite/run.py``).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "torch_suite"))

import run  # noqa: E402
import selection  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _suite_source() -> str:
    # Located, not imported: importing torch's suite needs BACKEND and more.
    spec = importlib.util.find_spec("torch.testing._internal.distributed.distributed_test")
    with open(spec.origin, encoding="utf-8") as f:
        return f.read()


def _suite_tests(source: str) -> dict:
    """test name -> its FunctionDef in DistributedTest._DistTestBase."""
    tree = ast.parse(source)
    outer = next(n for n in tree.body if isinstance(n, ast.ClassDef)
                 and n.name == "DistributedTest")
    base = next(n for n in outer.body if isinstance(n, ast.ClassDef) and n.name == "_DistTestBase")
    return {n.name: n for n in base.body
            if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}


def test_every_selected_test_exists_in_torchs_suite():
    tests = _suite_tests(_suite_source())
    selected = run.all_tests()
    missing = sorted(set(selected) - set(tests))
    assert not missing, f"not in torch's distributed_test.py: {missing}"
    assert len(selected) == sum(len(group) for group in selection.TESTS.values()), \
        "a test is listed in two groups"


def test_expectations_name_selected_tests_and_known_operations():
    selected = run.all_tests()
    for table in (selection.LIFTED_GATES, selection.KNOWN_FAILURES):
        assert set(table) <= set(selected), sorted(set(table) - set(selected))
    needs = {need for need in selected.values() if need is not None}
    # An operation may leave NOT_IMPLEMENTED_YET (it landed); its tests stay.
    assert set(selection.NOT_IMPLEMENTED_YET) <= needs | set(selection.NOT_IMPLEMENTED_YET)
    for test in selection.KNOWN_FAILURES:
        assert selected[test] is None, f"{test}: a known failure needs no pending operation"


def test_lifted_gates_are_torchs_reasons_for_those_tests():
    source = _suite_source()
    tests = _suite_tests(source)
    for test, reason in selection.LIFTED_GATES.items():
        decorators = "".join(ast.get_source_segment(source, d)
                             for d in tests[test].decorator_list)
        if reason.startswith("Test requires backend pyddp to be one of"):
            assert "require_backend_is_available" in decorators, test
        else:
            assert reason in decorators, f"{test}: torch no longer gives {reason!r}"


def test_pending_operations_are_refused_by_those_c10d_entry_points():
    with open(os.path.join(REPO, "csrc", "backend", "refusing_backend.cpp")) as f:
        table = set(re.findall(r'^\s*\{"(\w+)",', f.read(), re.M))
    for op, entry_points in selection.NOT_IMPLEMENTED_YET.items():
        assert set(entry_points) <= table, (op, set(entry_points) - table)


@pytest.mark.parametrize("outcome, detail, expected", [
    ("passed", "", "passed"),
    ("skipped", "Need at least 2 CUDA devices", "skipped"),
    ("failed", "NotImplementedError: pyddp: rank 1: torch.distributed.all_gather_coalesced "
               "(c10d's allgather_coalesced): pyddp's shm engine does not support it",
     "expected failure"),
    ("failed", "AssertionError: tensors differ", "FAILED"),
])
def test_a_pending_operations_test_must_fail_with_pyddps_refusal(monkeypatch, outcome, detail,
                                                                 expected):
    # As the list read while all_gather_coalesced was pending.
    monkeypatch.setitem(selection.NOT_IMPLEMENTED_YET, "all_gather_coalesced",
                        ("allgather_coalesced",))
    monkeypatch.setitem(selection.TESTS["coalesced collectives"],
                        "test_all_gather_coalesced_simple", "all_gather_coalesced")
    verdict, note = run.classify("pyddp", "test_all_gather_coalesced_simple",
                                 {"outcome": outcome, "detail": detail})
    if outcome == "passed":
        # Still listed as not implemented: the list must be updated.
        assert verdict == "FAILED" and "delete its line" in note
    else:
        assert verdict == expected, note


def test_a_landed_operations_tests_must_pass():
    assert "all_gather_coalesced" not in selection.NOT_IMPLEMENTED_YET
    test = "test_all_gather_coalesced_simple"
    assert run.classify("pyddp", test, {"outcome": "passed", "detail": ""}) == ("passed", "")
    refused = "NotImplementedError: pyddp: rank 0: ... (c10d's allgather_coalesced): ..."
    assert run.classify("pyddp", test, {"outcome": "failed", "detail": refused})[0] == "FAILED"


def test_known_failures_must_fail_as_known_and_gloo_must_pass():
    test, (_, text) = next(iter(selection.KNOWN_FAILURES.items()))
    assert run.classify("pyddp", test, {"outcome": "failed", "detail": f"x {text} y"})[0] == \
        "expected failure"
    assert run.classify("pyddp", test, {"outcome": "failed", "detail": "other"})[0] == "FAILED"
    assert run.classify("pyddp", test, {"outcome": "passed", "detail": ""})[0] == "FAILED"
    assert run.classify("gloo", test, {"outcome": "failed", "detail": text})[0] == "FAILED"
