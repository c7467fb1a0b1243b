"""Running torchft's own ``unittest`` cases under pytest (tests/ft/test_*torchft_suite.py)."""

from __future__ import annotations

import unittest


def run_case(case: unittest.TestCase) -> None:
    """Run one of torchft's test methods; fail with its tracebacks, and on a skip (a
    case that skips here tests nothing of pipeoff's)."""
    result = unittest.TestResult()
    case.run(result)
    problems = result.errors + result.failures
    assert not problems, "\n".join(tb for _, tb in problems)
    assert not result.skipped, result.skipped
