"""The simulator: deterministic, exact on simple graphs, contention and budgets as configured."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import pipeoff
import pipeoff.testing
from pipeoff import ConfigError, Schedule, TaskGraph, TaskKind
from pipeoff.sim import CostModel
from pipeoff.sim._compare import FEATURE_SCHEDULES, compare, parse_bytes
from pipeoff.sim._workloads import local_sgd_graph, model_shape, optimizer_graph

GB = 1e9
COST = CostModel(
    name="test", h2d_gbps=10.0, d2h_gbps=20.0, h2d_bidir_factor=0.5, d2h_bidir_factor=0.25,
    hbm_gbps=1000.0, interconnect_gbps=100.0, interconnect_latency_s=0.0, participants=2,
    optimizer_elems_per_s=1e9, cpu_optimizer_elems_per_s=1e8, launch_overhead_s=0.0,
)


def sim(g: TaskGraph, sched: Schedule | None = None, cost: CostModel = COST) -> pipeoff.Trace:
    ex = pipeoff.execute(g, sched or Schedule.pipelined(), backend="sim", cost_model=cost)
    assert ex.done()
    return ex.trace


def test_single_chain_time_is_the_sum_of_its_costs() -> None:
    g = TaskGraph()
    g.add_task("h2d", TaskKind.H2D, nbytes=10**9)  # 0.1 s at 10 GB/s
    g.add_task("opt", TaskKind.OPTIMIZER_CHUNK, deps=["h2d"], nbytes=4 * 10**8)  # 0.1 s
    g.add_task("ar", TaskKind.ALLREDUCE, deps=["opt"], nbytes=10**9)  # 0.01 s + hbm 0.002
    g.add_task("d2h", TaskKind.D2H, deps=["ar"], nbytes=10**9)  # 0.05 s
    t = sim(g)
    expected = 0.1 + 0.1 + (10**9 / (100 * GB) + 2 * 10**9 / (1000 * GB)) + 0.05
    assert t.makespan_ns() == pytest.approx(expected * 1e9, rel=1e-9)


def test_two_independent_lanes_take_the_max() -> None:
    g = TaskGraph()
    g.add_task("opt", TaskKind.OPTIMIZER_CHUNK, nbytes=4 * 10**8)  # 0.1 s
    g.add_task("ar", TaskKind.ALLREDUCE, nbytes=2 * 10**9)  # 0.02 + 0.004 s
    assert sim(g).makespan_ns() == pytest.approx(0.1e9, rel=1e-9)


def test_bidirectional_contention_slows_both_copies() -> None:
    g = TaskGraph()
    g.add_task("in", TaskKind.H2D, nbytes=10**9)
    g.add_task("out", TaskKind.D2H, nbytes=10**9)
    t = {r.name: r for r in sim(g).tasks}
    # Together: h2d at 5 GB/s, d2h at 5 GB/s -> both take 0.2 s.
    assert t["in"].end_ns == pytest.approx(0.2e9, rel=1e-9)
    assert t["out"].end_ns == pytest.approx(0.2e9, rel=1e-9)
    # Staggered: d2h alone for its first half at 20 GB/s, the rest shared.
    g2 = TaskGraph()
    g2.add_task("in", TaskKind.H2D, nbytes=10**9)
    g2.add_task("out", TaskKind.D2H, nbytes=10**9)
    no_contention = CostModel(**{**_fields(COST), "h2d_bidir_factor": 1.0,
                                 "d2h_bidir_factor": 1.0})
    t2 = {r.name: r for r in sim(g2, cost=no_contention).tasks}
    assert t2["in"].end_ns == pytest.approx(0.1e9) and t2["out"].end_ns == pytest.approx(0.05e9)


def test_a_synchronous_chain_pays_each_launch_after_the_last_task() -> None:
    """Sum of its costs including launch overheads: the host waits on every task."""
    cost = CostModel(**{**_fields(COST), "launch_overhead_s": 0.001})
    one = TaskGraph()
    one.add_task("t", TaskKind.OPTIMIZER_CHUNK, nbytes=4 * 10**7)
    work = sim(one).makespan_ns() / 1e9  # no launch overhead in COST
    g = TaskGraph()
    for k in range(4):
        g.add_task(f"t{k}", TaskKind.OPTIMIZER_CHUNK, deps=[f"t{k - 1}"] if k else [],
                   nbytes=4 * 10**7)
    # The makespan runs from the first task's start: 3 launches fall inside it.
    sync = sim(g, Schedule.synchronous(), cost=cost)
    assert sync.makespan_ns() == pytest.approx((4 * work + 3 * 0.001) * 1e9, rel=1e-9)
    # Pipelined, the launches overlap the chain.
    assert sim(g, cost=cost).makespan_ns() == pytest.approx(4 * work * 1e9, rel=1e-9)


def _fields(c: CostModel) -> dict[str, object]:
    return {f: getattr(c, f) for f in c.__slots__}  # type: ignore[attr-defined]


def test_launch_overhead_and_lookahead() -> None:
    cost = CostModel(**{**_fields(COST), "launch_overhead_s": 0.001})
    g = TaskGraph()
    for k in range(4):
        g.add_task(f"t{k}", list(TaskKind)[k], nbytes=0)
    t = sim(g, cost=cost)
    assert [r.enqueue_ns for r in t.tasks] == pytest.approx([1e6, 2e6, 3e6, 4e6])
    g2 = TaskGraph()
    for k in range(4):
        g2.add_task(f"o{k}", TaskKind.OPTIMIZER_CHUNK if k % 2 else TaskKind.ALLREDUCE,
                    nbytes=4 * 10**7)
    # lookahead=1: each task is issued only after the previous one finished.
    t2 = sim(g2, Schedule.pipelined(max_in_flight=1), cost=cost)
    starts = [r.start_ns for r in t2.tasks]
    ends = [r.end_ns for r in t2.tasks]
    assert all(s >= e for s, e in zip(starts[1:], ends))


def test_budgets_are_respected_in_simulation() -> None:
    g = optimizer_graph(model_shape("0.6b", fsdp=1), chunk_bytes=64 << 20)
    for budget in (64 << 20, 128 << 20, 3 * (64 << 20)):
        s = sim(g, Schedule.pipelined(device_budget_bytes=budget)).summary()
        assert s.peak_device_staging_bytes <= budget
    # More budget, more overlap, less time.
    t1 = sim(g, Schedule.pipelined(device_budget_bytes=64 << 20)).makespan_ns()
    t3 = sim(g, Schedule.pipelined(device_budget_bytes=3 * (64 << 20))).makespan_ns()
    assert t3 < t1


def test_simulation_is_deterministic_and_does_not_run_work() -> None:
    ran: list[int] = []
    g = local_sgd_graph(model_shape("0.6b", fsdp=2), variant="pipelined", bucket_bytes=32 << 20)
    g.add_task("side_effect", TaskKind.HOST, lambda ctx: ran.append(1))
    a = sim(g, Schedule.pipelined(device_budget_bytes=64 << 20))
    b = sim(g, Schedule.pipelined(device_budget_bytes=64 << 20))
    assert a.tasks == b.tasks and a.buffers == b.buffers and ran == []


def test_delay_hooks_apply_in_simulation() -> None:
    g = TaskGraph()
    g.add_task("x", TaskKind.OPTIMIZER_CHUNK, nbytes=4 * 10**8)
    with pipeoff.testing.delay_lane("compute", 0.5):
        assert sim(g).makespan_ns() == pytest.approx(0.6e9)


def test_cost_model_validation() -> None:
    with pytest.raises(ConfigError, match="h2d_gbps must be > 0"):
        CostModel(**{**_fields(COST), "h2d_gbps": 0})
    with pytest.raises(ConfigError, match="d2h_bidir_factor must be in"):
        CostModel(**{**_fields(COST), "d2h_bidir_factor": 1.5})
    with pytest.raises(ConfigError, match="unknown cost model preset 'tpu'"):
        CostModel.preset("tpu")
    with pytest.raises(ConfigError, match="cost_model is only for backend='sim'"):
        g = TaskGraph()
        g.add_task("t", TaskKind.HOST)
        pipeoff.execute(g, cost_model=COST)


def test_model_presets_and_sharding() -> None:
    m = model_shape("8b", fsdp=8)
    assert 7.9e9 < m.params < 8.1e9
    local = dict(m.local_numels)
    assert local["layers.0.q"] == 4096 * 4096 // 8
    assert 69e9 < model_shape("70b").params < 72e9
    # Uneven shards: the largest local shard, ceil per dim 0.
    assert dict(model_shape("0.6b", fsdp=3).local_numels)["embed"] == 50646 * 1024


def test_shape_json(tmp_path: Path) -> None:
    p = tmp_path / "m.json"
    p.write_text(json.dumps({"w": [3, 1000], "b": [7]}))
    m = model_shape(str(p), fsdp=2)
    assert dict(m.local_numels) == {"w": 2000, "b": 4}
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"w": [3, -1]}))
    with pytest.raises(ConfigError, match="parameter 'w' has shape"):
        model_shape(str(bad))
    with pytest.raises(ConfigError, match="does not exist"):
        model_shape(str(tmp_path / "none.json"))


def test_parse_bytes() -> None:
    assert parse_bytes("256MiB") == 256 << 20
    assert parse_bytes("1GiB") == 1 << 30
    assert parse_bytes("2e9") == 2 * 10**9
    with pytest.raises(ConfigError, match="must be a positive int"):
        parse_bytes("lots")


def test_the_simulator_parses_sizes_with_the_one_shared_parser() -> None:
    """Issue 34: pipeoff.sim._compare keeps no parser of its own; SI units are powers of
    ten, IEC powers of two, and errors name the argument."""
    from pipeoff import _validate

    assert parse_bytes is _validate.parse_bytes
    assert parse_bytes("1GB") == 10**9 and parse_bytes("1TiB") == 1 << 40
    with pytest.raises(ConfigError, match="--chunk-bytes"):
        parse_bytes("1XB", name="--chunk-bytes")


def test_a_budget_below_a_buffer_says_how_big_it_must_be_and_what_to_lower() -> None:
    from pipeoff import BudgetError

    shape = model_shape("8b", fsdp=8)
    with pytest.raises(BudgetError) as info:
        compare(shape, "optimizer", ("pipelined",), CostModel.h200_pcie5(),
                device_budget_bytes=10**9, names={"device_budget_bytes": "--device-budget",
                                                  "chunk_bytes": "--chunk-bytes"})
    msg = str(info.value)
    assert "raise --device-budget to at least 1GiB" in msg
    assert "or lower --chunk-bytes (now 1073741824 bytes" in msg
    assert "powers of 10" in msg  # 1GB is not 1GiB
    with pytest.raises(BudgetError, match="lower bucket_bytes"):
        compare(shape, "local-sgd", ("pipelined",), CostModel.h200_pcie5(),
                device_budget_bytes=100 << 20)


def test_predictions_count_the_host_state_each_feature_places() -> None:
    """Issue 34: the optimizer's state, full offload's masters, DiLoCo's backup are on the
    host; ``peak host`` counts them, not staging alone."""
    shape = model_shape("0.6b", fsdp=8)
    s_bytes = 4 * sum(n for _, n in shape.local_numels)
    cost = CostModel.h200_pcie5()
    expect = {"optimizer": 2, "full-offload": 4, "local-sgd": 0, "transfer": 0, "diloco": 3}
    for feature, k in expect.items():
        for p in compare(shape, feature, (FEATURE_SCHEDULES[feature][-1],), cost):
            assert p.host_state_bytes == k * s_bytes, feature
            assert p.peak_host_bytes == p.host_state_bytes + p.peak_host_staging_bytes
            assert p.host_state
    (orig,) = compare(shape, "diloco", ("original",), cost)
    assert orig.host_state_bytes == s_bytes  # torchft's backup


def test_compare_h200_predictions_have_the_expected_shape() -> None:
    cost = CostModel.h200_pcie5()
    shape = model_shape("8b", fsdp=8)
    opt = {p.schedule: p for p in compare(shape, "optimizer",
                                          ("single_pass", "sync_chunks", "pipelined"), cost)}
    assert opt["pipelined"].time_ms < opt["single_pass"].time_ms
    assert opt["pipelined"].peak_device_bytes <= 3 << 30
    assert opt["single_pass"].bound == "link"
    sgd = {p.schedule: p for p in compare(shape, "local-sgd", ("original", "rfc", "pipelined"),
                                          cost)}
    assert sgd["pipelined"].time_ms < sgd["rfc"].time_ms
    assert sgd["pipelined"].peak_device_bytes <= 512 << 20 < sgd["original"].peak_device_bytes
    full = {p.schedule: p for p in compare(shape, "full-offload", ("none", "pipelined"), cost)}
    assert full["pipelined"].time_ms < full["none"].time_ms
    assert full["pipelined"].peak_device_bytes == 0 and full["pipelined"].bound == "host"
    small = model_shape("0.6b", fsdp=4)
    xfer = {p.schedule: p for p in compare(small, "transfer", ("synchronous", "pipelined"),
                                           cost, device_budget_bytes=64 << 20)}
    assert xfer["pipelined"].time_ms < xfer["synchronous"].time_ms
    assert 0 < xfer["pipelined"].peak_device_bytes <= 64 << 20


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pipeoff.cli", *args], capture_output=True,
                          text=True, timeout=120)


@pytest.mark.slow  # runs a Python interpreter (subprocess)
def test_simulate_cli(tmp_path: Path) -> None:
    res = _cli("simulate", "--model", "0.6b", "--fsdp", "2", "--feature", "local-sgd",
               "--trace-dir", str(tmp_path))
    assert res.returncode == 0, res.stderr
    assert "PREDICTED" in res.stdout and "pipelined" in res.stdout
    assert (tmp_path / "local-sgd-pipelined.json").exists()
    res = _cli("simulate", "--model", "0.6b", "--json", "--schedules", "pipelined")
    data = json.loads(res.stdout)
    assert data[0]["schedule"] == "pipelined" and data[0]["time_ms"] > 0


@pytest.mark.slow  # runs a Python interpreter (subprocess)
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--model", "13b"), "model must be one of"),
        (("--model", "{shapes}"), "is not valid JSON"),
        (("--schedules", "magic"), "unknown schedule 'magic'"),
        (("--preset", "tpu"), "unknown cost model preset"),
        (("--chunk-bytes", "lots"), "--chunk-bytes must be a positive int (bytes) or a size"),
    ],
)
def test_simulate_cli_bad_input(tmp_path: Path, args: tuple[str, ...], message: str) -> None:
    bad = tmp_path / "shapes.json"
    bad.write_text("{nope")
    args = tuple(str(bad) if a == "{shapes}" else a for a in args)
    res = _cli("simulate", *args)
    assert res.returncode == 2, res.stdout
    assert message in res.stderr and "Traceback" not in res.stderr


def test_diloco_predictions_bound_device_memory() -> None:
    """DiLoCo's simulated syncs come from its own graph builder: the offloaded ones hold
    at most their budget of device staging, torchft's twice the local parameters."""
    cost = CostModel.h200_pcie5()
    shape = model_shape("8b", fsdp=8)
    pred = {p.schedule: p for p in compare(shape, "diloco",
                                           ("original", "synchronous", "pipelined"), cost,
                                           bucket_bytes=256 << 20)}
    local = sum(n for _, n in shape.local_numels) * 4
    assert pred["original"].peak_device_bytes == 2 * local
    assert pred["synchronous"].peak_device_bytes == 256 << 20
    assert pred["pipelined"].peak_device_bytes <= 512 << 20
    assert pred["pipelined"].time_ms < pred["synchronous"].time_ms
    tasks = {t.name.split(":")[0] for t in pred["pipelined"].trace.tasks}
    assert {"pseudograd", "allreduce", "d2h", "outer", "write"} <= tasks


def test_a_transfer_budget_the_planner_refuses_is_a_config_error() -> None:
    from pipeoff.sim import ModelShape, transfer_graph_shape

    shape = ModelShape(name="tiny", global_shapes=(("w", (8, 8)),), fsdp=2)
    with pytest.raises(ConfigError, match="budget_bytes=1 cannot transfer tiny"):
        transfer_graph_shape(shape, budget_bytes=1)
