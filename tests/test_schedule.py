from __future__ import annotations

import dataclasses
import itertools
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pipeoff
from pipeoff import BudgetError, ConfigError, Schedule, TaskGraph, TaskKind


def test_schedules_are_frozen_values() -> None:
    s = Schedule.pipelined(device_budget_bytes=64)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.device_budget_bytes = 128  # type: ignore[misc]
    assert s == Schedule.pipelined(device_budget_bytes=64)
    assert hash(s) == hash(Schedule.pipelined(device_budget_bytes=64))
    assert Schedule.synchronous().is_synchronous


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"device_budget_bytes": 0}, "device_budget_bytes must be a positive int"),
        ({"host_budget_bytes": -5}, "host_budget_bytes must be a positive int"),
        ({"device_budget_bytes": True}, "device_budget_bytes must be a positive int"),
        ({"max_in_flight": 0}, "max_in_flight must be a positive int"),
        ({"max_in_flight": 2.0}, "max_in_flight must be a positive int"),
    ],
)
def test_bad_schedule_arguments(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Schedule.pipelined(**kwargs)  # type: ignore[arg-type]


def test_buffer_larger_than_budget_is_named() -> None:
    g = TaskGraph()
    g.add_buffer("small", 100)
    g.add_buffer("huge", 1000, where="host")
    g.add_task("a", TaskKind.D2H, buffers=["small", "huge"])
    msg = "'huge' needs 1000 bytes of host memory.*host_budget_bytes=512"
    with pytest.raises(BudgetError, match=msg):
        Schedule.pipelined(host_budget_bytes=512).plan(g)


def test_lanes_follow_kinds_and_overrides() -> None:
    g = TaskGraph()
    for kind in TaskKind:
        g.add_task(kind.value, kind)
    g.add_task("custom", TaskKind.ALLREDUCE, lane="comm2")
    plan = Schedule.pipelined().plan(g)
    assert dict(zip(plan.order, plan.lanes)) == {
        "d2h": "d2h", "h2d": "h2d", "allreduce": "comm", "optimizer_chunk": "compute",
        "host": "host", "custom": "comm2",
    }
    sync = Schedule.synchronous().plan(g)
    assert set(sync.lanes) == {"main"}


def test_no_feasible_order_is_refused() -> None:
    # Two buffers that must both stay open: a1 uses A, b1 uses B, then a2 needs
    # b1 done while A is still open, and b2 needs a1 while B is open.
    g = TaskGraph()
    g.add_buffer("A", 60)
    g.add_buffer("B", 60)
    g.add_task("a1", TaskKind.H2D, buffers=["A"])
    g.add_task("b1", TaskKind.H2D, buffers=["B"])
    g.add_task("a2", TaskKind.D2H, deps=["a1", "b1"], buffers=["A"])
    g.add_task("b2", TaskKind.D2H, deps=["a1", "b1"], buffers=["B"])
    Schedule.pipelined(device_budget_bytes=120).plan(g)
    with pytest.raises(BudgetError, match="no issue order keeps live staging"):
        Schedule.pipelined(device_budget_bytes=100).plan(g)


def test_greedy_falls_back_to_search() -> None:
    # Greedy issues t0 (opens X) first, which strands it; only t1-first works.
    g = TaskGraph()
    g.add_buffer("X", 50)
    g.add_buffer("Y", 80)
    g.add_task("t0", TaskKind.H2D, buffers=["X"])
    g.add_task("t1", TaskKind.H2D, buffers=["Y"])
    g.add_task("t2", TaskKind.D2H, deps=["t1"], buffers=["Y"])
    g.add_task("t3", TaskKind.D2H, deps=["t0", "t2"], buffers=["X"])
    plan = Schedule.pipelined(device_budget_bytes=100).plan(g)
    assert plan.order.index("t2") < plan.order.index("t0")


def test_budget_waits_make_a_bucket_pipeline_double_buffered() -> None:
    g = TaskGraph()
    for k in range(4):
        g.add_buffer(f"b{k}", 100)
        g.add_task(f"copy{k}", TaskKind.H2D, buffers=[f"b{k}"])
        g.add_task(f"reduce{k}", TaskKind.ALLREDUCE, deps=[f"copy{k}"], buffers=[f"b{k}"])
        g.add_task(f"d2h{k}", TaskKind.D2H, deps=[f"reduce{k}"], buffers=[f"b{k}"])
    plan = Schedule.pipelined(device_budget_bytes=200).plan(g)
    pos = {n: i for i, n in enumerate(plan.order)}
    # copy2 may not start before d2h0 (which frees b0) has finished.
    assert pos["d2h0"] in plan.waits[pos["copy2"]]
    assert pos["d2h1"] in plan.waits[pos["copy3"]]
    assert plan.planned_peak_bytes["device"] == 200


# -- property tests over random DAGs and budgets -----------------------------------

Spec = tuple[list[tuple[str, list[int], list[int]]], list[int], int]


@st.composite
def graphs(draw: st.DrawFn, max_tasks: int = 7) -> Spec:
    n = draw(st.integers(2, max_tasks))
    nbuf = draw(st.integers(0, 4))
    sizes = [draw(st.integers(1, 8)) * 8 for _ in range(nbuf)]
    tasks = []
    for i in range(n):
        deps = sorted(draw(st.sets(st.integers(0, i - 1), max_size=3))) if i else []
        bufs = sorted(draw(st.sets(st.integers(0, nbuf - 1), max_size=2))) if nbuf else []
        kind = draw(st.sampled_from(list(TaskKind)))
        tasks.append((kind.value, deps, bufs))
    used = sorted({b for _, _, bs in tasks for b in bs})
    budget = draw(st.integers(max([sizes[b] for b in used], default=8), 8 * 8 * 4))
    return tasks, sizes, budget


def _build(spec: Spec, work=None) -> TaskGraph:
    tasks, sizes, _ = spec
    g = TaskGraph()
    used = sorted({b for _, _, bs in tasks for b in bs})
    for b in used:
        g.add_buffer(f"buf{b}", sizes[b])
    # Insert in a shuffled-but-fixed order so ties are not trivially topological.
    for i, (kind, deps, bufs) in enumerate(tasks):
        g.add_task(f"t{i}", TaskKind(kind), work, deps=[f"t{d}" for d in deps],
                   buffers=[f"buf{b}" for b in bufs])
    return g


def _feasible(g: TaskGraph, budget: int) -> bool:
    """Brute force: does any topological order keep open bytes within budget?"""
    names = list(g.tasks)
    users = {b: sum(b in t.buffers for t in g.tasks.values()) for b in g.buffers}
    for perm in itertools.permutations(names):
        seen: set[str] = set()
        count: dict[str, int] = {}
        open_b = 0
        ok = True
        for n in perm:
            t = g.tasks[n]
            if any(d not in seen for d in t.deps):
                ok = False
                break
            need = sum(g.buffers[b].nbytes for b in set(t.buffers) if b not in count)
            if open_b + need > budget:
                ok = False
                break
            open_b += need
            for b in set(t.buffers):
                count[b] = count.get(b, 0) + 1
                if count[b] == users[b]:
                    open_b -= g.buffers[b].nbytes
            seen.add(n)
        if ok:
            return True
    return False


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graphs(max_tasks=6))
def test_planner_finds_an_order_exactly_when_one_exists(spec) -> None:
    g = _build(spec)
    budget = spec[2]
    try:
        plan = Schedule.pipelined(device_budget_bytes=budget).plan(g)
    except BudgetError:
        assert not _feasible(g, budget)
        return
    assert plan.planned_peak_bytes["device"] <= budget
    pos = {n: i for i, n in enumerate(plan.order)}
    assert all(pos[d] < pos[n] for n, t in g.tasks.items() for d in t.deps)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graphs(max_tasks=9), st.lists(st.floats(0, 0.002), min_size=9, max_size=9))
def test_threads_respect_budget_deps_and_run_each_task_once(spec, delays) -> None:
    runs: list[str] = []
    lock = threading.Lock()
    finished: set[str] = set()
    violations: list[str] = []

    def work(ctx: pipeoff.TaskContext) -> None:
        i = int(ctx.task.name[1:])
        for d in ctx.task.deps:
            if d not in finished:
                violations.append(f"{ctx.task.name} started before {d}")
        time.sleep(delays[i % len(delays)])
        with lock:
            runs.append(ctx.task.name)
            finished.add(ctx.task.name)

    g = _build(spec, work)
    budget = spec[2]
    try:
        ex = pipeoff.execute(g, Schedule.pipelined(device_budget_bytes=budget), backend="threads")
    except BudgetError:
        return
    ex.wait(timeout=30)  # a deadlock becomes a StepTimeoutError
    assert not violations
    assert sorted(runs) == sorted(g.tasks)  # each exactly once
    summary = ex.trace.summary()
    assert summary.peak_device_staging_bytes <= budget
    assert pipeoff.pools_for("cpu").device.stats().live_bytes == 0


def test_the_search_handles_graphs_deeper_than_the_recursion_limit() -> None:
    """The greedy order gets stuck (a1 holds A, b1 cannot open B); the search must
    find b1, a1, a2 even with thousands of tasks after them."""
    import sys

    g = TaskGraph()
    g.add_buffer("A", 60)
    g.add_buffer("B", 60)
    g.add_task("a1", TaskKind.H2D, buffers=["A"])
    g.add_task("b1", TaskKind.D2H, buffers=["B"])
    g.add_task("a2", TaskKind.H2D, deps=["b1"], buffers=["A"])
    prev = "a2"
    for i in range(sys.getrecursionlimit() + 500):
        prev = g.add_task(f"p{i}", TaskKind.HOST, deps=[prev])
    plan = Schedule.pipelined(device_budget_bytes=100).plan(g)
    assert plan.order[:3] == ("b1", "a1", "a2")


def test_lookahead_is_the_deprecated_name_of_max_in_flight() -> None:
    with pytest.warns(FutureWarning, match="now max_in_flight"):
        s = Schedule.pipelined(lookahead=3)
    assert s == Schedule.pipelined(max_in_flight=3)
    with pytest.warns(FutureWarning, match="Schedule.max_in_flight"):
        assert s.lookahead == 3
    with pytest.raises(ConfigError, match="not both"):
        Schedule.pipelined(lookahead=3, max_in_flight=3)


def test_a_rebuilt_graph_of_the_same_structure_is_planned_once() -> None:
    """A training loop rebuilds its step graph every step: the plan is cached by the
    graph's structure (work aside), and a change of structure plans anew."""
    def build(nbytes: int, marker: list[int]) -> TaskGraph:
        g = TaskGraph("cpu")
        g.add_buffer("b", nbytes)
        g.add_task("load", TaskKind.H2D, lambda ctx: marker.append(1), buffers=["b"])
        g.add_task("use", TaskKind.HOST, lambda ctx: marker.append(2), deps=["load"],
                   buffers=["b"])
        return g

    sched = Schedule.pipelined(device_budget_bytes=1 << 20)
    first = sched.plan(build(1024, []))
    again = build(1024, [])
    assert sched.plan(again) is first
    assert again.topological_order() == ("load", "use")  # validated by the cached plan
    assert sched.plan(build(2048, [])) is not first
    assert Schedule.pipelined(device_budget_bytes=1 << 21).plan(build(1024, [])) is not first
    with pytest.raises(BudgetError):  # a new structure is still checked
        sched.plan(build(2 << 20, []))


def test_the_plan_cache_follows_the_default_lanes(monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeoff import schedule

    g = TaskGraph("cpu")
    g.add_task("a", TaskKind.HOST, lambda ctx: None)
    sched = Schedule.pipelined()
    before = sched.plan(g)
    monkeypatch.setitem(schedule.DEFAULT_LANES, TaskKind.HOST, "elsewhere")
    assert sched.plan(g).lanes == ("elsewhere",) != before.lanes
