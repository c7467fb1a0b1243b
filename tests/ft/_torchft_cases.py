"""Running torchft's own ``unittest`` cases under pytest (tests/ft/test_*torchft_suite.py)."""

from __future__ import annotations

import sys
import unittest

QUORUM_TIMEOUT = ("_async_quorum", "Timeout expired")
"""What a torchft quorum RPC that ran out of time leaves in a traceback."""


def _problems(case: unittest.TestCase) -> list[str]:
    result = unittest.TestResult()
    case.run(result)
    assert not result.skipped, result.skipped
    return [tb for _, tb in result.errors + result.failures]


def run_case(case: unittest.TestCase, quorum_retries: int = 0) -> None:
    """Run one of torchft's test methods; fail with its tracebacks, and on a skip (a
    case that skips here tests nothing of pipeoff's).

    ``quorum_retries``: how many times a fresh instance of the case is run again when
    every failure is a quorum RPC that ran out of time. torchft's integration cases
    run several replicas as threads of one process, and those with a replica that
    joins late (``test_streaming_diloco_upscale``) depend on every replica reaching
    each quorum within the Lighthouse's join timeout: on 2 cores shared with other
    processes a replica lagged past it about once in 500 cases (CI, 2026-12-05), the
    quorum formed without it, its peers finished, and it waited alone until its RPC
    timed out. A real hang, or any other failure, fails every run."""
    for attempt in range(quorum_retries + 1):
        problems = _problems(case)
        if not problems:
            return
        timed_out = all(all(s in tb for s in QUORUM_TIMEOUT) for tb in problems)
        if not timed_out or attempt == quorum_retries:
            break
        print(f"{case.id()}: a quorum RPC timed out; running the case again "
              f"(attempt {attempt + 2})", file=sys.stderr)
        case = type(case)(case._testMethodName)
    raise AssertionError("\n".join(problems))
