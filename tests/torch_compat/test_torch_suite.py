"""The driver of torch's distributed suite (torch_suite/ beside it): its lists and its verdicts.

The lists must name tests that torch's suite has and skip reasons torch
gives those tests, or the driver would silently expect less than it says.
The run itself is a CI step (``python tests/torch_compat/torch_suite/run.py``).
"""

from __future__ import annotations

import ast
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "torch_suite"))

import run  # noqa: E402
import selection  # noqa: E402


@pytest.fixture(scope="module")
def suite():
    source = run.suite_source()
    return source, run.suite_tests(source)


def test_the_whole_class_is_run(suite):
    _, tests = suite
    # TestDistBackendWithSpawn's class: a few hundred tests, none left out.
    assert len(tests) > 200, len(tests)
    assert "test_sparse_all_reduce_sum" in tests and "test_send_recv_any_source" in tests


def test_listed_tests_exist_and_say_how_and_why(suite):
    _, tests = suite
    for table in (selection.DIFFERENCES, selection.LIFTED_FAILURES):
        assert set(table) <= set(tests), sorted(set(table) - set(tests))
    for test, (outcome, reason, text) in selection.DIFFERENCES.items():
        assert outcome in ("skipped", "failed") and reason and text, test
    for test, (reason, text) in selection.LIFTED_FAILURES.items():
        assert reason and text, test


def test_listed_skips_are_torchs_checks_of_the_backends_name(suite):
    source, tests = suite
    for test, (outcome, _, text) in selection.DIFFERENCES.items():
        if outcome != "skipped":
            continue
        decorators = "".join(ast.get_source_segment(source, d)
                             for d in tests[test].decorator_list)
        if text.startswith("Test requires backend pyddp to be one of"):
            assert "require_backend_is_available" in decorators, test
        else:
            assert text in decorators and "BACKEND" in decorators, test
    # A test skipped by name is what the second report runs with the skip lifted.
    assert set(selection.LIFTED_FAILURES) <= {t for t, (o, _, _) in
                                              selection.DIFFERENCES.items() if o == "skipped"}


PASSED = {"outcome": "passed", "detail": ""}
SKIPPED = {"outcome": "skipped", "detail": "Need at least 2 CUDA devices"}
FAILED = {"outcome": "failed", "detail": "AssertionError: tensors differ"}


@pytest.mark.parametrize("gloo, pyddp, verdict", [
    (PASSED, PASSED, "passed"),
    (SKIPPED, SKIPPED, "as gloo"),
    (FAILED, FAILED, "as gloo"),
    (FAILED, PASSED, "passed"),
    (PASSED, FAILED, "FAILED"),
    (PASSED, SKIPPED, "FAILED"),
])
def test_pyddp_must_pass_what_gloo_passes(gloo, pyddp, verdict):
    assert run.classify("test_not_listed", gloo, pyddp)[0] == verdict


def test_a_listed_difference_must_happen_as_listed(monkeypatch):
    monkeypatch.setitem(selection.DIFFERENCES, "test_x",
                        ("failed", "a reason", "only implemented for GLOO"))
    known = {"outcome": "failed", "detail": "RuntimeError: ... only implemented for GLOO ..."}
    assert run.classify("test_x", PASSED, known) == ("expected difference", "a reason")
    assert run.classify("test_x", PASSED, FAILED)[0] == "FAILED"
    assert run.classify("test_x", PASSED, SKIPPED)[0] == "FAILED"
    verdict, note = run.classify("test_x", PASSED, PASSED)
    assert verdict == "FAILED" and "delete it" in note


def test_a_lifted_gate_must_pass_unless_listed(monkeypatch):
    assert run.classify_lifted("test_x", PASSED) == ("passed", "")
    assert run.classify_lifted("test_x", FAILED)[0] == "FAILED"
    monkeypatch.setitem(selection.LIFTED_FAILURES, "test_x", ("a reason", "tensors differ"))
    assert run.classify_lifted("test_x", FAILED) == ("expected failure", "a reason")
    assert run.classify_lifted("test_x", PASSED)[0] == "FAILED"
