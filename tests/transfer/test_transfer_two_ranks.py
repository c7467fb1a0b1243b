"""StateTransfer across two real gloo processes: layouts, refusals, torn transfers, FSDP2.

One spawn runs every case (``transfer_worker.py``); the tests below check what
each rank reported, and that both ranks reported the same.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests._two_ranks import run_two_ranks
from tests.transfer import transfer_worker

# Every test spawns gloo processes (a module fixture, or its own run).
pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


@pytest.fixture(scope="module")
def ranks() -> dict[int, dict[str, Any]]:
    out = run_two_ranks(transfer_worker.worker)
    for rank, res in out.items():
        assert "crash" not in res, f"rank {rank}:\n{res['crash']}"
    return out


@pytest.mark.parametrize("case", ["fp32", "bf16", "cast", "tiny"])
def test_replicated_targets_from_uneven_shards_are_bitwise(ranks: dict[int, Any],
                                                           case: str) -> None:
    for rank, res in ranks.items():
        r = res[case]
        assert all(r["bitwise"].values()), (rank, r["bitwise"])
        # NaN in the sources' padding never reached a target, and the targets'
        # padding keeps its sentinel.
        assert all(r["padding"].values()), (rank, r["padding"])
    assert ranks[0][case]["signature"] == ranks[1][case]["signature"]


def test_a_128_byte_budget_splits_runs_into_rounds_and_peaks_stay_within_it(
        ranks: dict[int, Any]) -> None:
    for res in ranks.values():
        tiny = res["tiny"]
        assert tiny["rounds"] > 50  # (3, 1000) FP32 alone is 12,000 bytes
        host, device = tiny["peak"]
        assert 0 < host <= 128
        assert device <= 128


def test_resharding_matches_dtensor(ranks: dict[int, Any]) -> None:
    for rank, res in ranks.items():
        assert res["reshard"] == {"shard0_to_shard1": True, "two_to_one": True,
                                  "one_to_two": True}, rank


REFUSALS = {
    "unavailable": (1, "unavailable"),
    "dtype_mismatch": (0, "no cast is declared"),
    "gap_and_overlap": (1, "overlaps"),
    "not_pinned": (0, "declared pinned"),
    "budget_too_small": (0, "less than one"),
    "extra_key": (1, "no source on any rank"),
    "failed_readiness": (1, "readiness completion"),
}


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_refusals_are_raised_identically_on_every_rank_before_any_write(
        ranks: dict[int, Any], name: str) -> None:
    rank, words = REFUSALS[name]
    got = {r: res["refusals"][name] for r, res in ranks.items()}
    assert got[0]["error"] is not None, got
    assert got[0]["error"] == got[1]["error"], got
    assert got[0]["problems"] == got[1]["problems"]
    assert got[0]["problems"][0][0] == rank, got[0]["problems"]
    assert words in got[0]["error"], got[0]["error"]
    assert got[0]["sentinel"] and got[1]["sentinel"]


def test_the_gap_and_the_overlap_are_both_named(ranks: dict[int, Any]) -> None:
    err = ranks[0]["refusals"]["gap_and_overlap"]["error"]
    assert "[2:3, 0:7]" in err  # the overlap: row 2


@pytest.mark.parametrize(("case", "faulty"), [("torn", 1), ("torn_rank0", 0)])
def test_a_fault_in_one_ranks_unpack_is_torn_on_both_ranks_and_nothing_hangs(
        ranks: dict[int, Any], case: str, faulty: int) -> None:
    # Rank 0 still has packs to do after its first unpack: they are cancelled, and its
    # exchanges still join the collectives (with the fault flag).
    a, b = ranks[0][case], ranks[1][case]
    assert a["error"] == b["error"] == "TransferTornError"
    assert a["written"] == b["written"] and a["partial"] == b["partial"]
    assert a["faults"] == b["faults"] and list(a["faults"]) == [faulty]
    failed = int(a["faults"][faulty].split(":")[0].removeprefix("unpack"))
    assert a["message"] == b["message"]
    # The faulty rank failed inside that round's unpack (after its first copy).
    assert failed in a["partial"][faulty] and failed not in a["written"].get(faulty, ()), a
    assert a["keys"] == ("w",)
    mine, peer = (a, b) if faulty == 0 else (b, a)
    assert mine["cause"] == "RuntimeError" and peer["cause"] == "NoneType"
    assert a["seconds"] < 20 and b["seconds"] < 20  # well under the 30 s group timeout
    assert a["second"] and b["second"]


@pytest.mark.parametrize("case", ["torn_staging", "torn_setup0", "torn_setup2",
                                  "torn_setup0_sync"])
def test_a_rank_failing_before_it_joined_a_round_tears_the_transfer_on_both(
        ranks: dict[int, Any], case: str) -> None:
    """An out-of-memory allocating a round's wire buffer, or the exchange's own work
    raising before its fault flag, on rank 1: rank 0 waited in the collective until the
    group's 30 s timeout."""
    a, b = ranks[0][case], ranks[1][case]
    assert a["error"] == b["error"] == "TransferTornError", (a, b)
    assert a["written"] == b["written"] and a["faults"] == b["faults"]
    assert list(a["faults"]) == [1], a["faults"]
    assert a["seconds"] < 20 and b["seconds"] < 20, (a["seconds"], b["seconds"])
    assert a["second"] and b["second"]


def test_launching_twice_aliasing_parameters_and_global_ranks(ranks: dict[int, Any]) -> None:
    for rank, res in ranks.items():
        misc = res["misc"]
        assert misc["second_launch"] is True and misc["first_done"], (rank, misc)
        assert misc["inplace_reshard"] == (0, True), (rank, misc)
        assert misc["inplace_gather"] and misc["parameters"], (rank, misc)
        assert misc["reserved"] == (True, True), (rank, misc)
    assert ranks[1]["misc"]["global_rank"] == 1


def test_delayed_lanes_do_not_change_a_bit(ranks: dict[int, Any]) -> None:
    for res in ranks.values():
        assert all(res["delays"].values()), res["delays"]


def test_full_offload_masters_broadcast_as_bf16_replicated_weights(
        ranks: dict[int, Any]) -> None:
    for res in ranks.values():
        assert res["full_offload"] and all(res["full_offload"].values()), res["full_offload"]


def test_both_wires_on_the_simulated_cuda_device(ranks: dict[int, Any]) -> None:
    for rank, res in ranks.items():
        for name, ok in res["simulated_cuda"].items():
            assert ok is True, (rank, name, ok)


@pytest.mark.parametrize("case", ["host,device,pinned,host_sync",
                                  "device,pinned,device,cross_lane_wait"])
def test_a_removed_wait_on_the_wire_path_is_a_race(case: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # Host wire: the exchange reads the send buffer on the host after synchronizing the
    # packs' device-to-host copies. Device wire: the exchange's stream waits for the
    # packs' streams. Without it the device sees the race (and the peer is torn or
    # times out); never a silent success.
    monkeypatch.setenv("PIPEOFF_TEST_MUTATION", case)
    seen = list(run_two_ranks(transfer_worker.mutation_worker).values())
    assert "race" in seen, seen
    assert True not in seen, seen


def test_three_ranks_pack_a_region_sent_to_two_peers_once() -> None:
    out = run_two_ranks(transfer_worker.three_rank_worker, world=3)
    for rank, res in out.items():
        assert "crash" not in res, f"rank {rank}:\n{res['crash']}"
        assert all(res["host"]["bitwise"].values()) and all(res["host"]["padding"].values())
        assert res["sim-host"] is True and res["sim-device"] is True, res
        assert res["mixed"] is True, (rank, res["mixed"])
