"""The runner of torchft's own cases retries only a quorum RPC's timeout."""

from __future__ import annotations

import unittest

import pytest

from tests.ft._torchft_cases import run_case

RUNS: list[str] = []


class _Flaky(unittest.TestCase):
    __test__ = False  # (run by the tests below, not collected)

    def test_quorum_timeout_once(self) -> None:
        RUNS.append("q")
        if len(RUNS) == 1:
            raise TimeoutError("in _async_quorum: status: Cancelled, message: \"Timeout expired\"")

    def test_other_failure(self) -> None:
        RUNS.append("o")
        raise AssertionError("replicas differ")

    def test_quorum_timeout_always(self) -> None:
        RUNS.append("a")
        raise TimeoutError("in _async_quorum: status: Cancelled, message: \"Timeout expired\"")


@pytest.fixture(autouse=True)
def _fresh() -> None:
    RUNS.clear()


def test_a_quorum_timeout_is_run_again() -> None:
    run_case(_Flaky("test_quorum_timeout_once"), quorum_retries=1)
    assert RUNS == ["q", "q"]


def test_no_retry_unless_asked() -> None:
    with pytest.raises(AssertionError, match="Timeout expired"):
        run_case(_Flaky("test_quorum_timeout_once"))
    assert RUNS == ["q"]


def test_other_failures_and_repeated_timeouts_fail() -> None:
    with pytest.raises(AssertionError, match="replicas differ"):
        run_case(_Flaky("test_other_failure"), quorum_retries=1)
    assert RUNS == ["o"]
    with pytest.raises(AssertionError, match="Timeout expired"):
        run_case(_Flaky("test_quorum_timeout_always"), quorum_retries=1)
    assert RUNS == ["o", "a", "a"]
