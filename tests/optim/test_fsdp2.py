"""FSDP2 over gloo, two processes: overlap mode is bitwise equal to FSDP2 with plain AdamW."""

from __future__ import annotations

import pytest

from tests._two_ranks import run_two_ranks
from tests.optim import fsdp2_worker

pytestmark = pytest.mark.slow  # every test reads a module fixture that spawns two gloo processes


@pytest.fixture(scope="module")
def results() -> dict[int, dict]:
    return run_two_ranks(fsdp2_worker.worker)


@pytest.mark.parametrize("prefetch", [False, True], ids=["no_prefetch", "prefetch"])
def test_overlap_bitwise_equal_to_plain_fsdp2(results: dict[int, dict], prefetch: bool) -> None:
    for rank in (0, 1):
        r = results[rank][(prefetch, True)]
        assert r["losses_equal"], rank
        assert r["params_equal"], rank
        assert r["state_equal"], rank


def test_parameters_outside_every_fsdp_unit_are_waited_for(results: dict[int, dict]) -> None:
    """A root that is not sharded, and a plain Linear under it: plain forward waits."""
    for rank in (0, 1):
        r = results[rank][("plain_root", True)]
        assert r["losses_equal"], rank
        assert r["params_equal"], rank


@pytest.mark.parametrize("mode", ["chunked", "overlap"])
def test_optimizer_state_pickles_and_a_rank_local_load_needs_no_collective(
        results: dict[int, dict], mode: str) -> None:
    """Issue 10, inputs 1 and 2: torch.save of the state of DTensor parameters (whose
    host state shares one allocation), and load_state_dict on rank 1 only, then
    training on: bitwise FSDP2 with plain AdamW doing the same."""
    for rank in (0, 1):
        r = results[rank][("checkpoint", mode)]
        assert r["saved"] and r["loaded_equal"], rank
        assert r["losses_equal"], rank
        assert r["params_equal"], rank


def test_uneven_shards_give_identical_plans(results: dict[int, dict]) -> None:
    a, b = results[0][(True, True)], results[1][(True, True)]
    assert a["local_numels"] != b["local_numels"]  # the shards really are uneven
    assert a["signature"] == b["signature"]


def test_without_forward_waits_fsdp2_reads_stale_shards(results: dict[int, dict]) -> None:
    """The control: the same run without attach() does not match."""
    assert not all(results[r][(True, False)]["losses_equal"] for r in (0, 1))


def test_waiting_for_own_chunks_only_misses_the_prefetched_all_gathers(
    results: dict[int, dict],
) -> None:
    """The control for prefetch: module 0 issues module 2's all-gather in its own
    pre-forward, so a hook that waits only for module 0's chunks reads module 2's
    shards before their chunks have run."""
    runs = [results[r][(True, "own_only")] for r in (0, 1)]
    assert not all(r["losses_equal"] and r["params_equal"] for r in runs)
