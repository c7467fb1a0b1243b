"""The simulator's host-node model (``pipeoff.sim.HostNode`` / ``HostCosts``): a rank's
share of the node's DRAM bandwidth, the bytes each host op moves, and the rank's host
tasks and pinned copies sharing that bandwidth while they run at once."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

import pipeoff
from pipeoff import ConfigError, Schedule, TaskGraph, TaskKind
from pipeoff.sim import HOST_OP_BYTES, CostModel, HostCosts, HostNode
from pipeoff.sim._compare import compare
from pipeoff.sim._workloads import model_shape

GB = 1e9
NODE = HostNode(name="test", ranks=4, cores=8, dram_gbps=40.0, core_gbps=20.0)
"""10 GB/s per rank (40 / 4), below what its 2 threads draw (40)."""
FLAT = CostModel(
    name="test", h2d_gbps=10.0, d2h_gbps=10.0, hbm_gbps=1000.0, interconnect_gbps=100.0,
    interconnect_latency_s=0.0, optimizer_elems_per_s=1e9, cpu_optimizer_elems_per_s=1e8,
    launch_overhead_s=0.0)
NATIVE = dataclasses.replace(FLAT, host=HostCosts(node=NODE, design="native"))


def seconds(g: TaskGraph, cost: CostModel, sched: Schedule | None = None) -> float:
    ex = pipeoff.execute(g, sched or Schedule.pipelined(), backend="sim", cost_model=cost)
    return ex.trace.makespan_ns() / 1e9


def outer_task(g: TaskGraph, name: str, elems: int, lane: str = "outer_step") -> str:
    # nbytes: one FP32 element per parameter, as the graphs give host tasks
    return g.add_task(name, TaskKind.HOST, lane=lane, nbytes=4 * elems)


def test_a_rank_gets_its_share_of_the_node_at_most_what_its_threads_draw() -> None:
    assert NODE.rank_gbps == 10.0 and NODE.threads_per_rank == 2
    few = dataclasses.replace(NODE, cores=4, core_gbps=3.0)  # 1 thread of 3 GB/s
    assert few.rank_gbps == 3.0
    h200 = HostNode.h200_node()
    assert h200.ranks == 8 and h200.threads_per_rank == 14
    assert h200.rank_gbps == pytest.approx(0.8 * 614.4 / 8)
    # unbound: half its pages on the other socket, at 0.6 of the rate
    assert HostNode.h200_node(numa_bound=False).rank_gbps == pytest.approx(
        h200.rank_gbps * (0.5 + 0.5 * 0.6))


def test_a_host_task_costs_its_bytes_over_the_ranks_bandwidth() -> None:
    g = TaskGraph()
    outer_task(g, "outer", 10**9)
    # 1e9 elements x 20 B (native SGD with momentum) / 10 GB/s
    assert seconds(g, NATIVE) == pytest.approx(2.0, rel=1e-9)
    torch_kernels = dataclasses.replace(FLAT, host=HostCosts(node=NODE, design="torch"))
    assert seconds(g, torch_kernels) == pytest.approx(4.4, rel=1e-9)
    assert seconds(g, FLAT) == pytest.approx(10.0, rel=1e-9)  # the flat 1e8 elements/s


def test_a_synchronous_schedule_costs_the_same_op_on_its_one_lane() -> None:
    g = TaskGraph()
    outer_task(g, "outer", 10**9)
    assert seconds(g, NATIVE, Schedule.synchronous()) == pytest.approx(2.0, rel=1e-9)


def test_a_ranks_host_tasks_share_its_bandwidth() -> None:
    """Two host lanes at once take as long as one after the other (bandwidth-bound);
    the flat model, which shares nothing, overlaps them fully."""
    g = TaskGraph()
    outer_task(g, "a", 10**9, lane="host_step")      # 32 B (one pass): 3.2 s alone
    outer_task(g, "b", 10**9, lane="accumulate")     # 10 B: 1 s alone
    assert seconds(g, NATIVE) == pytest.approx(4.2, rel=1e-9)
    assert seconds(g, FLAT) == pytest.approx(10.0, rel=1e-9)  # max of two 10 s tasks


def test_pinned_copies_draw_on_the_same_bandwidth() -> None:
    g = TaskGraph()
    outer_task(g, "outer", 10**9)                    # 20 GB of host traffic
    g.add_task("d2h", TaskKind.D2H, nbytes=10 * 10**9)  # 10 GB at the link's 10 GB/s
    # 30 GB through a 10 GB/s share: 3 s, where either alone takes 2 s and 1 s
    assert seconds(g, NATIVE) == pytest.approx(3.0, rel=1e-9)
    g2 = TaskGraph()
    g2.add_task("d2h", TaskKind.D2H, nbytes=10 * 10**9)
    assert seconds(g2, NATIVE) == pytest.approx(1.0, rel=1e-9)  # alone: the link's rate


def test_host_tasks_on_lanes_it_does_not_know_keep_the_flat_rate() -> None:
    g = TaskGraph()
    g.add_task("other", TaskKind.HOST, lane="bookkeeping", nbytes=4 * 10**8)
    assert seconds(g, NATIVE) == pytest.approx(1.0, rel=1e-9)


def test_the_op_bytes_are_the_kernels_counts() -> None:
    # The final micro-step in one pass (docs/host_step.md: 32 B), the fold apart 10 + 30.
    assert HOST_OP_BYTES["native"] == {"accumulate": 10.0, "host_step": 32.0,
                                       "outer_step": 20.0}
    assert HOST_OP_BYTES["native-fold"] == {"accumulate": 10.0, "host_step": 30.0,
                                            "outer_step": 20.0}
    assert HOST_OP_BYTES["torch"]["outer_step"] == 44.0  # bench_outer_step.py's BYTES
    from pipeoff.ft._diloco_graph import OUTER_LANE
    from pipeoff.optim._full_offload._graph import ACCUMULATE_LANE, STEP_LANE

    for design in HOST_OP_BYTES:
        assert set(HOST_OP_BYTES[design]) == {OUTER_LANE, ACCUMULATE_LANE, STEP_LANE}


@pytest.mark.parametrize(("make", "message"), [
    (lambda: HostNode(ranks=0, cores=8, dram_gbps=1.0, core_gbps=1.0), "HostNode.ranks"),
    (lambda: HostNode(ranks=8, cores=8, dram_gbps=-1.0, core_gbps=1.0), "HostNode.dram_gbps"),
    (lambda: HostNode(ranks=8, cores=8, dram_gbps=1.0, core_gbps=float("nan")),
     "HostNode.core_gbps"),
    (lambda: HostNode(ranks=8, cores=8, dram_gbps=1.0, core_gbps=1.0, remote_factor=2.0),
     "HostNode.remote_factor must be in"),
    (lambda: HostCosts(node=NODE, design="magic"), "HostCosts.design must be one of"),
    (lambda: HostCosts(node="h200", design="native"), "HostCosts.node must be a HostNode"),
    (lambda: dataclasses.replace(FLAT, host="h200_node"), "CostModel.host must be"),
])
def test_bad_input_names_the_field(make: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make()  # type: ignore[operator]


def test_diloco_predictions_by_host_model() -> None:
    """At 8B on an H200 node the native outer step beats torch's kernels, which the
    flat rate happened to price alike; torchft's sync does no host op but its copies
    now share the host's bandwidth."""
    shape = model_shape("8b", fsdp=8)
    flat = CostModel.h200_pcie5()
    by = {}
    for design in ("native", "torch"):
        cost = dataclasses.replace(flat, host=HostCosts(node=HostNode.h200_node(),
                                                        design=design))
        by[design] = {p.schedule: p for p in compare(shape, "diloco",
                                                     ("original", "pipelined"), cost)}
    by["flat"] = {p.schedule: p for p in compare(shape, "diloco", ("original", "pipelined"),
                                                 flat)}
    assert by["native"]["pipelined"].time_ms < 0.7 * by["torch"]["pipelined"].time_ms
    assert by["native"]["original"].time_ms == by["torch"]["original"].time_ms
    assert by["native"]["original"].time_ms >= by["flat"]["original"].time_ms
    assert by["native"]["pipelined"].bound == "outer_step"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pipeoff.cli", *args], capture_output=True,
                          text=True, timeout=120)


@pytest.mark.slow  # runs a Python interpreter (subprocess)
def test_simulate_cli_host_models() -> None:
    res = _cli("simulate", "--model", "0.6b", "--feature", "diloco", "--schedules",
               "pipelined")
    assert res.returncode == 0, res.stderr
    assert "h200_node (native host kernels)" in res.stdout and "61.4 GB/s" in res.stdout
    res = _cli("simulate", "--model", "0.6b", "--feature", "diloco", "--host", "flat")
    assert res.returncode == 0 and "host:" not in res.stdout, res.stderr
    res = _cli("simulate", "--model", "0.6b", "--feature", "full-offload", "--host", "torch",
               "--no-numa-binding")
    assert res.returncode == 0, res.stderr
    assert "h200_node_unbound (torch host kernels)" in res.stdout
    assert "no NUMA binding" in res.stdout
    for args, message in ((("--preset", "cpu_here", "--host", "native"),
                           "--host native models an H200 node"),
                          (("--host", "flat", "--no-numa-binding"),
                           "--no-numa-binding applies to the host-node model")):
        res = _cli("simulate", "--model", "0.6b", *args)
        assert res.returncode == 2 and message in res.stderr, res.stderr
