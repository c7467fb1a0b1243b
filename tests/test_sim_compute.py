"""The simulator's training compute (``pipeoff.sim.DeviceCompute``) and what it says of
a DiLoCo sync: how much of it the training loop waits for."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

import pipeoff
from pipeoff import ConfigError, TaskGraph, TaskKind
from pipeoff.sim import CostModel, DeviceCompute, HostCosts, HostNode, forward_flops, model_shape
from pipeoff.sim._compare import compare


def _node_cost() -> CostModel:
    return dataclasses.replace(CostModel.h200_pcie5(),
                               host=HostCosts(node=HostNode.h200_node(), design="native"))


def test_forward_flops_and_the_h200_figure() -> None:
    assert forward_flops(1000, 10) == 20_000
    assert forward_flops(1000, 10, layers=2, hidden=4, seq_len=8) == 10 * (2000 + 128)
    c = DeviceCompute.h200()
    assert c.flops_per_s == pytest.approx(989e12 * 0.4)
    assert c.seconds(c.flops_per_s) == pytest.approx(1.0)
    shape = model_shape("8b", fsdp=8)
    # 8B at 8K tokens: about 1.5e14 FLOPs, 0.38 s at 40 % of an H200
    assert 0.35 < c.seconds(shape.forward_flops(8192, 8192)) < 0.4


@pytest.mark.parametrize(("kw", "match"), [
    ({"peak_flops": 0, "mfu": 0.4}, "peak_flops"),
    ({"peak_flops": 1e15, "mfu": 1.5}, "mfu"),
    ({"peak_flops": 1e15, "mfu": True}, "mfu"),
])
def test_bad_compute_is_refused_by_name(kw: dict[str, float], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        DeviceCompute(**kw)


def test_a_training_task_is_charged_its_flops() -> None:
    g = TaskGraph()
    g.add_task("fwd", TaskKind.HOST, lane="forward", nbytes=int(989e12 * 0.4 / 10))
    ex = pipeoff.execute(g, pipeoff.Schedule.pipelined(), backend="sim",
                         cost_model=CostModel.h200_pcie5())
    (t,) = [t for t in ex.trace.tasks if t.name == "fwd"]
    assert t.duration_ns == pytest.approx(100e6, rel=1e-6)
    no_compute = dataclasses.replace(CostModel.h200_pcie5(), compute=None)
    with pytest.raises(ConfigError, match="training compute"):
        pipeoff.execute(g, pipeoff.Schedule.pipelined(), backend="sim", cost_model=no_compute)


def test_the_pipelined_sync_exposes_less_than_torchfts() -> None:
    """torchft's sync is all exposed (the forward starts after it); pipeoff's returns at
    the decision and its writes run under the forward. With a delay the averaging runs
    under the inner steps too, and the pipelined sync exposes a fraction of torchft's."""
    shape = model_shape("8b", fsdp=8)
    cost = _node_cost()
    for delay in (0, 1):
        preds = {p.schedule: p for p in compare(
            shape, "diloco", ("original", "synchronous", "pipelined"), cost,
            bucket_bytes=64 << 20, tokens=8192, seq_len=8192, fragment_sync_delay=delay)}
        orig, sync, pipe = preds["original"], preds["synchronous"], preds["pipelined"]
        assert all(p.exposed_ms is not None for p in preds.values())
        if delay == 0:
            assert orig.exposed_ms == pytest.approx(orig.time_ms, rel=1e-3)
        assert sync.exposed_ms > orig.exposed_ms > pipe.exposed_ms > 0  # type: ignore[operator]
        assert pipe.bound == "outer_step"  # (training lanes are not a bound)
    assert pipe.exposed_ms < 0.3 * orig.exposed_ms  # type: ignore[operator]
    # without tokens: the sync alone, as before
    (alone,) = compare(shape, "diloco", ("pipelined",), cost, bucket_bytes=64 << 20)
    assert alone.exposed_ms is None


def test_cli_prints_the_exposed_column_and_json() -> None:
    run = [sys.executable, "-m", "pipeoff.cli", "simulate", "--feature", "diloco",
           "--model", "0.6b", "--fragment-sync-delay", "1", "--seq-len", "4096"]
    out = subprocess.run(run, capture_output=True, text=True, check=True).stdout
    assert "exposed ms" in out and "fragment_sync_delay 1" in out and "4096 tokens" in out
    data = json.loads(subprocess.run([*run, "--json"], capture_output=True, text=True,
                                     check=True).stdout)
    assert {r["schedule"] for r in data} == {"original", "synchronous", "pipelined"}
    assert all(isinstance(r["exposed_ms"], float) for r in data)
    bad = subprocess.run([*run[:-2], "--micro-batch", "0"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--micro-batch: must be at least 1" in bad.stderr
