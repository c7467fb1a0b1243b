"""A whole training step, predicted (``pipeoff simulate --feature train-step``).

The prime-rl figures these tests hold the simulator to (Qwen3-30B-A3B, FSDP over
8xH200, one node):

- PrimeIntellect-ai/prime-rl #3234's description: no offload 1.75 s, full offload
  3.96 s at 8K; 5.17 s and 5.73 s at 16K.
- #3248's correction of its no-offload reference: 3.39 s and 3.95 s at 8K, 6.23 s
  and 5.91 s at 16K ("parity from ~16K").
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from pipeoff._errors import BudgetError, ConfigError
from pipeoff.cli import main
from pipeoff.sim import (
    TRAIN_STEP_SCHEDULES,
    CostModel,
    DeviceCompute,
    HostCosts,
    HostNode,
    TrainStep,
    TrainStepRow,
    model_shape,
    train_step,
)
from pipeoff.sim._compute import MFU_MOE
from pipeoff.trace import Trace

QWEN = model_shape("qwen3-30b-a3b", fsdp=8)


def cost(*, mfu: float = MFU_MOE, design: str = "native") -> CostModel:
    """The calibration: h200_pcie5 (compute at ``mfu``) on an h200_node host."""
    return dataclasses.replace(CostModel.h200_pcie5(), compute=DeviceCompute.h200(mfu=mfu),
                               host=HostCosts(node=HostNode.h200_node(), design=design))


def overhead_error(predicted: float, published: float) -> float:
    """The error on a ratio's overhead: (predicted - 1) / (published - 1) - 1."""
    return (predicted - 1) / (published - 1) - 1


def test_the_moe_preset_is_qwen3_30b_a3b_and_its_flops_count_the_active_experts() -> None:
    assert QWEN.params == pytest.approx(30.5e9, rel=0.01)      # "30.5B in total"
    assert QWEN.active_params == pytest.approx(3.3e9, rel=0.03)  # "3.3B activated"
    assert QWEN.expert_share == 8 / 128
    assert QWEN.hidden == 32 * 128  # the attention's width, not the model's 2048
    # FLOPs from the active parameters, memory from all of them.
    assert QWEN.forward_flops(8192, 8192) == pytest.approx(
        8192 * (2 * QWEN.active_params + 2 * 48 * 8192 * 4096))
    assert QWEN.local_params == pytest.approx(QWEN.params / 8, rel=0.001)
    dense = model_shape("8b")
    assert dense.active is None and dense.active_params == dense.params


def named(rows: list[TrainStepRow], schedule: str) -> TrainStepRow:
    return next(r for r in rows if r.schedule == schedule)


def test_rows_are_present_and_consistent() -> None:
    got = train_step(QWEN, TrainStep(seq_len=8192, offload_fraction=0.5), cost())
    by = {r.schedule: r for r in got}
    assert tuple(by)[:5] == TRAIN_STEP_SCHEDULES and "fraction-0.5" in by
    assert "backward-fraction-0.5" in by
    base = by["no-offload"]
    assert base.vs_no_offload == 1.0 and base.offload_fraction == 0.0
    for r in got:
        if r.offload_fraction == 1.0:  # (a fraction may beat it: a smaller device step)
            assert r.time_ms >= base.time_ms * (1 - 1e-9), r.schedule
        assert r.exposed_ms == pytest.approx(r.time_ms - r.compute_ms)
        assert r.compute_ms == base.compute_ms
        assert r.vs_no_offload == pytest.approx(r.time_ms / base.time_ms)
    # 16 B per local parameter kept on the device, 4 offloaded.
    assert base.peak_device_bytes == 16 * QWEN.local_params
    assert by["full-offload-forward"].peak_device_bytes == 4 * QWEN.local_params
    assert (by["full-offload-forward"].peak_device_bytes < by["fraction-0.5"].peak_device_bytes
            < base.peak_device_bytes)
    # pipeoff prices its one-pass final micro-step, prime-rl the fold then the step.
    assert by["full-offload-forward"].host_bytes_per_param == 32
    assert by["full-offload-backward"].host_bytes_per_param == 40
    # Stepping the chunks in the order the forward needs them (as built) only helps.
    assert by["full-offload-forward"].time_ms <= by["full-offload-forward-last-first"].time_ms


def test_peak_device_bytes_fall_as_the_fraction_rises() -> None:
    peaks = [named(train_step(QWEN, TrainStep(seq_len=2048, offload_fraction=f), cost()),
                   f"fraction-{f:g}").peak_device_bytes for f in (0.0, 0.3, 0.7, 1.0)]
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == 4


def test_auto_picks_the_fastest_fraction_that_fits_and_says_why() -> None:
    budget = 40 * 10**9
    got = train_step(QWEN, TrainStep(seq_len=8192, auto=True, device_budget_bytes=budget),
                     cost())
    auto = named(got, "auto")
    assert auto.schedule == "auto" and auto.peak_device_bytes <= budget
    assert 0 < auto.offload_fraction < 1  # all of it on the device does not fit
    assert "fastest" in auto.note and f"below {auto.offload_fraction:g}" in auto.note
    # Nothing that fits is faster.
    for f in (0.6, 0.8, 1.0):
        r = named(train_step(QWEN, TrainStep(seq_len=8192, offload_fraction=f), cost()),
                  f"fraction-{f:g}")
        assert r.peak_device_bytes > budget or r.time_ms >= auto.time_ms - 1e-6
    # The device's own memory by default (141 GB): every fraction fits, and a small
    # one wins, its host part hidden under the forward's first units and the device
    # step smaller than the whole state's (no-offload's).
    default = train_step(QWEN, TrainStep(seq_len=8192, auto=True), cost())
    assert "fit 131.32 GiB" in named(default, "auto").note  # 141 GB, and no "below"
    assert named(default, "auto").time_ms <= default[0].time_ms


def test_a_budget_below_full_offload_is_refused_with_the_least_that_fits() -> None:
    with pytest.raises(BudgetError, match=r"device_budget_bytes=1000000000 .* less than"):
        train_step(QWEN, TrainStep(seq_len=2048, auto=True, device_budget_bytes=10**9), cost())


@pytest.mark.parametrize(("kw", "message"), [
    ({"seq_len": 0}, "seq_len"),
    ({"seq_len": 8, "micro_batch": 0}, "micro_batch"),
    ({"seq_len": 8, "offload_fraction": 1.5}, "offload_fraction must be a number in"),
    ({"seq_len": 8, "offload_fraction": -0.1}, "offload_fraction"),
    ({"seq_len": 8, "device_budget_bytes": 0}, "device_budget_bytes"),
])
def test_bad_configs_name_the_parameter(kw: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TrainStep(**kw)  # type: ignore[arg-type]


def test_a_cost_model_without_compute_is_refused() -> None:
    flat = dataclasses.replace(CostModel.h200_pcie5(), compute=None)
    with pytest.raises(ConfigError, match="no training compute"):
        train_step(QWEN, TrainStep(seq_len=8), flat)


# -- prime-rl's published figures -------------------------------------------------


def test_prime_rl_3234_figures_at_the_calibration() -> None:
    """At the calibration (MFU 16.6 %, prime-rl's own benchmark; h200_node), prime-rl's
    design reproduces #3234's table: 3.96 / 1.75 = 2.26x at 8K, within 25 % of its
    overhead, and 5.73 / 5.17 = 1.108x at 16K within 0.1."""
    at8 = train_step(QWEN, TrainStep(seq_len=8192), cost())[1]
    assert at8.schedule == "full-offload-backward"
    assert abs(overhead_error(at8.vs_no_offload, 3.96 / 1.75)) < 0.25
    at16 = train_step(QWEN, TrainStep(seq_len=16384), cost())[1]
    assert abs(at16.vs_no_offload - 5.73 / 5.17) < 0.1


@pytest.mark.xfail(strict=True, reason="the calibrated compute (MFU 16.6 %) predicts 1.51 s "
                   "without offload at 8K where #3248 measured 3.39 s: 2.18x, not 1.165x "
                   "(docs/simulation.md, 'A whole training step')")
def test_prime_rl_3248_corrected_figure_at_the_calibration() -> None:
    at8 = train_step(QWEN, TrainStep(seq_len=8192), cost())[1]
    assert abs(overhead_error(at8.vs_no_offload, 3.95 / 3.39)) < 0.25


def test_prime_rl_3248_figure_given_its_own_compute_time() -> None:
    """A check of the host side alone, not a calibration: with the compute that makes the
    no-offload step #3248's 3.39 s at 8K (MFU 7.32 %), prime-rl's design costs 3.95 s
    within 25 % of the overhead, and is at parity (within 1.05x) from 16K."""
    c = cost(mfu=0.0732)
    at8 = train_step(QWEN, TrainStep(seq_len=8192), c)
    assert at8[0].time_ms == pytest.approx(3390, rel=0.01)
    assert abs(overhead_error(at8[1].vs_no_offload, 3.95 / 3.39)) < 0.25
    for seq in (16384, 32768):
        assert train_step(QWEN, TrainStep(seq_len=seq), c)[1].vs_no_offload <= 1.05


def test_the_one_pass_design_is_cheaper_than_the_fold_and_step() -> None:
    """Issue 35: the final micro-step in one pass (32 B) against the fold apart (40 B)."""
    from pipeoff.sim import compare

    shape = model_shape("8b", fsdp=8)
    t = {d: compare(shape, "full-offload", ("pipelined",), cost(design=d))[0].time_ms
         for d in ("native", "native-fold")}
    assert t["native"] < t["native-fold"]
    # Host-bound: the times go as the bytes, 32 against 40, give or take the copies.
    assert t["native"] / t["native-fold"] == pytest.approx(32 / 40, rel=0.05)


# -- the command ------------------------------------------------------------------


def test_cli_json_shape(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--feature", "train-step", "--model", "qwen3-30b-a3b",
                 "--fsdp", "8", "--seq-len", "4096", "--offload-fraction", "0.25",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["feature"] == "train-step" and out["predicted"] is True
    assert out["mfu"] == MFU_MOE and out["active_params"] < out["params"]
    names = [r["schedule"] for r in out["schedule"]]
    assert names == [*TRAIN_STEP_SCHEDULES, "fraction-0.25", "backward-fraction-0.25"]
    for r in out["schedule"]:
        assert {"time_ms", "peak_device_bytes", "vs_no_offload", "exposed_ms",
                "offload_fraction", "note"} <= set(r)
        assert math.isfinite(r["time_ms"])
    assert out["schedule"][0]["host_bytes_per_param"] is None


def test_cli_auto_says_what_it_chose(capsys: pytest.CaptureFixture[str],
                                     tmp_path: Path) -> None:
    assert main(["simulate", "--feature", "train-step", "--model", "qwen3-30b-a3b",
                 "--seq-len", "2048", "--offload-fraction", "auto",
                 "--device-budget", "40GB", "--trace-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "PREDICTED" in out and "auto: offload fraction 0.5: the fastest" in out
    saved = Trace.load(tmp_path / "train-step-auto.json")
    assert saved.metadata["backend"] == "sim"
    assert len(list(tmp_path.glob("train-step-*.json"))) == 7  # (auto and auto-backward too)


@pytest.mark.parametrize(("args", "message"), [
    (["--offload-fraction", "1.5"], "--offload-fraction must be a number in [0, 1]"),
    (["--offload-fraction", "half"], "--offload-fraction must be a number in [0, 1]"),
    (["--mfu", "0"], "--mfu must be in [0.001, 1]"),
    (["--mfu", "1e-300"], "--mfu must be in [0.001, 1]"),  # (a traceback: ns overflowed)
    (["--device-budget", "40GB"], "--device-budget applies to train-step with"),
    (["--schedules", "none"], "--schedules does not apply to --feature train-step"),
    (["--preset", "cpu_here"], "h200_pcie5"),
    (["--offload-fraction", "auto", "--device-budget", "1GB"], "--device-budget=1000000000"),
])
def test_cli_bad_arguments_name_the_option(capsys: pytest.CaptureFixture[str],
                                           args: list[str], message: str) -> None:
    assert main(["simulate", "--feature", "train-step", "--model", "qwen3-30b-a3b",
                 "--seq-len", "1024", *args]) == 2
    assert message in capsys.readouterr().err


def test_auto_without_a_budget_names_the_devices_memory(
        capsys: pytest.CaptureFixture[str]) -> None:
    """It blamed a ``--device-budget`` the user never gave (a tester's find)."""
    assert main(["simulate", "--feature", "train-step", "--model", "70b", "--fsdp", "1",
                 "--offload-fraction", "auto"]) == 2
    err = capsys.readouterr().err
    assert "the device's memory (--device-budget not given)" in err, err
    assert "shard over more ranks (--fsdp)" in err, err


def test_cli_train_step_options_are_refused_elsewhere(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--feature", "optimizer", "--offload-fraction", "0.5"]) == 2
    assert "--offload-fraction applies only with --feature train-step" in \
        capsys.readouterr().err


def test_overlap_backward_with_a_device_part_hides_more_than_the_forward_at_8k() -> None:
    """Under a 40 GB budget (fraction 0.5 at least) the host part under overlap="backward"
    (the last units, their gradients first) has the backward and the next forward's
    first half to hide under; under "forward" only the forward's second half."""
    got = train_step(QWEN, TrainStep(seq_len=8192, auto=True, device_budget_bytes=40 * 10**9),
                     cost())
    fwd, bwd = named(got, "auto"), named(got, "auto-backward")
    assert fwd.offload_fraction == bwd.offload_fraction == 0.5
    assert bwd.time_ms < fwd.time_ms
    assert bwd.exposed_ms < fwd.exposed_ms / 2
    # At fraction 1 the forward's first unit waits for the chunk stepped last: the
    # step-at-once of attach() gains (almost) nothing over prime-rl's step().
    attach, prime = named(got, "full-offload-backward-attach"), named(got, "full-offload-backward")
    assert attach.time_ms <= prime.time_ms + 1e-6
