from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest
import torch

import pipeoff
import pipeoff.testing
from pipeoff import Schedule, TaskGraph, TaskKind, Trace, TraceFormatError
from pipeoff.trace import BufferRecord, TaskRecord


def rec(name: str, lane: str, start: int, end: int, deps: tuple[str, ...] = (),
        buffers: tuple[str, ...] = (), kind: str = "host") -> TaskRecord:
    return TaskRecord(name=name, kind=kind, lane=lane, start_ns=start * 1000,
                      end_ns=end * 1000, deps=deps, buffers=buffers)


def test_single_chain_has_efficiency_one() -> None:
    t = Trace(tasks=(rec("a", "x", 0, 10), rec("b", "x", 10, 30, ("a",)),
                     rec("c", "x", 30, 35, ("b",))))
    s = t.summary()
    assert s.makespan_us == 35 and s.critical_path_us == 35 and s.efficiency == 1.0


def test_critical_path_of_a_hand_built_dag() -> None:
    # a(10) -> b(20) -> d(5); a -> c(40) -> d.  Longest chain: a, c, d = 55.
    t = Trace(tasks=(
        rec("a", "l1", 0, 10),
        rec("b", "l1", 10, 30, ("a",)),
        rec("c", "l2", 10, 50, ("a",)),
        rec("d", "l1", 60, 65, ("b", "c")),  # started late: 10 us of slack
    ))
    s = t.summary()
    assert s.critical_path_us == 55
    assert s.makespan_us == 65
    assert s.efficiency == pytest.approx(55 / 65)
    assert dict(s.lane_busy_us) == {"l1": 35, "l2": 40}


def test_a_merged_trace_of_two_ranks_keeps_their_lanes_and_chains_apart() -> None:
    # Each rank: a(10) -> b(10) on lane x, the same names; rank 1 runs 5 us later.
    ranks = [Trace(tasks=tuple(
        dataclasses.replace(r, rank=k, start_ns=r.start_ns + 5000 * k, end_ns=r.end_ns + 5000 * k)
        for r in (rec("a", "x", 0, 10), rec("b", "x", 10, 20, ("a",)))))
        for k in (0, 1)]
    s = Trace.merge(ranks).summary()
    assert dict(s.lane_busy_us) == {"r0:x": 20, "r1:x": 20}
    assert s.makespan_us == 25
    assert s.critical_path_us == 20  # a chain of 20 per rank, not 40 through both


def test_busiest_lane_bounds_the_critical_path() -> None:
    # Independent tasks serialized on one lane: no chain, but the lane is busy 30.
    t = Trace(tasks=(rec("a", "x", 0, 10), rec("b", "x", 10, 20), rec("c", "x", 20, 30)))
    assert t.summary().critical_path_us == 30


def test_staging_timeline_and_peaks() -> None:
    t = Trace(
        tasks=(
            rec("in0", "h2d", 0, 10, buffers=("b0",)),
            rec("out0", "d2h", 10, 20, ("in0",), buffers=("b0",)),
            rec("in1", "h2d", 10, 15, buffers=("b1",)),
            rec("out1", "d2h", 20, 30, ("in1",), buffers=("b1",)),
            rec("h", "host", 25, 40, buffers=("hb",)),
        ),
        buffers=(BufferRecord(name="b0", nbytes=100, where="device"),
                 BufferRecord(name="b1", nbytes=50, where="device"),
                 BufferRecord(name="hb", nbytes=7, where="host")),
        device_budget_bytes=150,
    )
    s = t.summary()
    assert s.peak_device_staging_bytes == 150
    assert s.peak_host_staging_bytes == 7
    timeline = t.staging_timeline()
    assert timeline[-1][1:] == (0, 0)
    # b0 is released at t=20 exactly when nothing else starts; never above 150.
    assert max(d for _, d, _ in timeline) == 150


def _run_graph() -> pipeoff.Execution:
    x = torch.zeros(1024)
    g = TaskGraph()
    for k in range(3):
        g.add_buffer(f"b{k}", 4096)
        g.add_task(f"h2d{k}", TaskKind.H2D, lambda ctx, k=k: ctx.buffer(f"b{k}").fill_(k),
                   buffers=[f"b{k}"], nbytes=4096)
        g.add_task(f"opt{k}", TaskKind.OPTIMIZER_CHUNK,
                   lambda ctx, k=k: x.add_(ctx.buffer(f"b{k}", torch.float32)),
                   deps=[f"h2d{k}"], buffers=[f"b{k}"], nbytes=4096)
        g.add_task(f"d2h{k}", TaskKind.D2H, deps=[f"opt{k}"], buffers=[f"b{k}"], nbytes=4096)
        g.add_task(f"ar{k}", TaskKind.ALLREDUCE, deps=[f"d2h{k}"])
    ex = pipeoff.execute(g, Schedule.pipelined(device_budget_bytes=8192))
    ex.wait(timeout=30)
    return ex


def test_json_round_trip(tmp_path: Path) -> None:
    trace = _run_graph().trace
    path = trace.save(tmp_path / "t.json")
    loaded = Trace.load(path)
    assert loaded == trace
    assert loaded.summary() == trace.summary()


def test_chrome_structure(tmp_path: Path) -> None:
    trace = _run_graph().trace
    doc = json.loads(trace.save(tmp_path / "t.json").read_text())
    events = doc["traceEvents"]
    xs = [e for e in events if e["ph"] == "X"]
    assert len(xs) == 12
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {"pipeoff h2d", "pipeoff compute", "pipeoff d2h", "pipeoff comm"}
    # One tid per lane, and events on a track nest (no partial overlap).
    by_tid: dict[int, list[dict]] = {}
    for e in xs:
        by_tid.setdefault(e["tid"], []).append(e)
        assert e["dur"] >= 0
    for evs in by_tid.values():
        assert len({e["args"]["lane"] for e in evs}) == 1
        evs.sort(key=lambda e: e["ts"])
        for a, b in zip(evs, evs[1:]):
            assert b["ts"] >= a["ts"] + a["dur"] - 1e-3
    # Copies look like profiler memcpy events.
    d2h = next(e for e in xs if e["args"]["pipeoff.task"] == "d2h0")
    assert d2h["cat"] == "gpu_memcpy" and d2h["name"].startswith("Memcpy DtoH")
    # Flows bind to existing slices: 's' inside its producer, 'f' at its consumer's start.
    flows = [e for e in events if e["ph"] in ("s", "f")]
    assert flows and len(flows) % 2 == 0
    for e in flows:
        on_track = by_tid[e["tid"]]
        if e["ph"] == "s":
            assert any(x["ts"] <= e["ts"] <= x["ts"] + x["dur"] for x in on_track)
        else:
            assert any(abs(x["ts"] - e["ts"]) < 1e-6 for x in on_track)
    ids = [e["id"] for e in flows]
    assert all(ids.count(i) == 2 for i in ids)
    counters = [e for e in events if e["ph"] == "C"]
    assert counters and counters[-1]["args"] == {"device": 0, "host": 0}
    assert max(c["args"]["device"] for c in counters) <= 8192
    assert doc["pipeoff"]["device_budget_bytes"] == 8192


def test_load_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Trace.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(TraceFormatError, match="not valid JSON"):
        Trace.load(bad)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"traceEvents": []}))
    with pytest.raises(TraceFormatError, match="not one pipeoff wrote"):
        Trace.load(other)
    notchrome = tmp_path / "list.json"
    notchrome.write_text("[1, 2]")
    with pytest.raises(TraceFormatError, match="not a Chrome trace"):
        Trace.load(notchrome)


def test_trace_of_failed_execution_records_statuses() -> None:
    g = TaskGraph()
    g.add_task("ok", TaskKind.H2D)
    g.add_task("bad", TaskKind.OPTIMIZER_CHUNK, lambda ctx: 1 / 0, deps=["ok"])
    g.add_task("never", TaskKind.D2H, deps=["bad"])
    ex = pipeoff.execute(g)
    with pytest.raises(ZeroDivisionError):
        ex.wait(timeout=30)
    s = ex.trace.summary()
    assert (s.tasks, s.failed, s.cancelled) == (3, 1, 1)


def test_overlap_pct_of_two_lanes_with_known_overlap() -> None:
    # comm runs 0-100; copies run 50-150 and compute 120-200.
    t = Trace(tasks=(
        rec("ar", "comm", 0, 100, kind="allreduce"),
        rec("cp", "d2h", 50, 150, kind="d2h"),
        rec("opt", "compute", 120, 200, kind="optimizer_chunk"),
    ))
    s = t.summary()
    assert s.comm_overlap_pct == pytest.approx(0.0)  # no compute during the collective
    assert s.comm_hidden_pct == pytest.approx(50.0)  # 50 of 100 us under the copy
    # copy 50-150: 50-100 under comm, 120-150 under compute -> 80 of 100.
    assert s.copy_overlap_pct == pytest.approx(80.0)
    assert Trace(tasks=(rec("a", "x", 0, 1),)).summary().comm_overlap_pct is None


def test_longest_tasks_and_hook_waits() -> None:
    tasks = tuple(rec(f"t{k}", "x", 10 * k, 10 * k + k) for k in range(12))
    waits = (TaskRecord(name="layer0", kind="hook_wait", lane="forward hooks", start_ns=0,
                        end_ns=3000),
             TaskRecord(name="layer1", kind="hook_wait", lane="forward hooks", start_ns=5000,
                        end_ns=6000))
    s = Trace(tasks=tasks + waits).summary()
    assert [n for n, _, _ in s.longest] == [f"t{k}" for k in range(11, 1, -1)]
    assert (s.hook_waits, s.hook_wait_total_us, s.hook_wait_max_us) == (2, 4.0, 3.0)
    assert s.tasks == 12  # hook waits are not tasks


def test_record_region_captures_every_execution_and_hook_waits(tmp_path: Path) -> None:
    import time

    def graph(tag: str) -> TaskGraph:
        g = TaskGraph()
        g.add_task("a", TaskKind.H2D, lambda ctx: time.sleep(0.005))
        g.add_task("b", TaskKind.ALLREDUCE, lambda ctx: time.sleep(0.005), deps=["a"])
        return g

    outside = pipeoff.execute(graph("before"))
    outside.wait()
    with pipeoff.trace.record(tmp_path / "run.json", replica_id=3) as rec:
        pipeoff.execute(graph("one")).wait()
        ex2 = pipeoff.execute(graph("two"))
        t0 = time.perf_counter_ns()
        ex2.wait()
        pipeoff.trace.record_hook_wait("layers.0", t0, time.perf_counter_ns())
    trace = Trace.load(tmp_path / "run.json")
    assert trace == rec.trace
    names = [t.name for t in trace.tasks]
    assert names == ["x0/a", "x0/b", "x1/a", "x1/b", "layers.0"]
    assert trace.metadata["replica_id"] == 3 and trace.metadata["executions"] == 2
    info = json.loads((tmp_path / "run.json").read_text())["distributedInfo"]
    assert info["replica_id"] == 3 and info["rank"] == trace.metadata.get("rank", 0)
    # One timeline: the second execution starts after the first one ended.
    by = {t.name: t for t in trace.tasks}
    assert by["x1/a"].start_ns >= by["x0/b"].end_ns
    assert trace.summary().hook_waits == 1
    # Two sequential executions: the bound accounts for when each was issued, so
    # it holds both executions' chains (a then b, twice), not the longest one only
    # (which would put the efficiency near 0.5). Bounds from this run's own task
    # times, so a loaded machine's slower tasks and lane hand-offs cannot fail it.
    s = trace.summary()
    ran = [t for t in trace.tasks if t.kind != "hook_wait"]
    chains_ns = sum(t.duration_ns for t in ran)
    assert s.critical_path_us * 1e3 >= chains_ns - 1, (s.critical_path_us, chains_ns)
    spans_ns = 0
    for part in trace.executions().values():
        tasks = [t for t in part.tasks if t.kind != "hook_wait"]
        if tasks:
            spans_ns += max(t.end_ns for t in tasks) - min(t.start_ns for t in tasks)
    assert s.efficiency >= min(1.0, chains_ns / spans_ns) - 1e-9, (s.efficiency, chains_ns,
                                                                   spans_ns)


def test_recording_off_costs_nothing_and_catches_nothing() -> None:
    from pipeoff.recording import _recorder as _record

    assert not _record.active()
    g = TaskGraph()
    g.add_task("a", TaskKind.HOST)
    pipeoff.execute(g).wait()
    assert _record._active == []


def test_torch_profiler_trace_with_pipeoff_ranges_loads(tmp_path: Path) -> None:
    from torch.profiler import profile

    g = TaskGraph()
    g.add_task("copy", TaskKind.H2D, lambda ctx: torch.ones(1000).sum())
    g.add_task("reduce", TaskKind.ALLREDUCE, lambda ctx: torch.ones(1000).sum(), deps=["copy"])
    with profile() as prof:
        # The inline backend runs on this thread, where the profiler listens.
        pipeoff.execute(g, Schedule.synchronous()).wait()
    path = tmp_path / "prof.json"
    prof.export_chrome_trace(str(path))
    trace = Trace.load(path)
    assert trace.metadata["source"] == "torch.profiler"
    assert [(t.name.split("#")[0], t.kind) for t in trace.tasks] == [
        ("copy", "h2d"), ("reduce", "allreduce")]
    assert trace.summary().makespan_us > 0


def test_a_recorded_region_reports_each_execution_not_the_host_gaps() -> None:
    """Efficiency over a region used to count the host's time between executions as
    part of every bound (0.98 with lanes 15% busy); now it is the executions' own."""
    g = TaskGraph()
    g.add_task("a", TaskKind.H2D)
    g.add_task("b", TaskKind.OPTIMIZER_CHUNK, deps=["a"])
    g.add_task("c", TaskKind.D2H, deps=["b"])
    with pipeoff.testing.delay_lane("compute", 0.01), pipeoff.trace.record() as rec:
        for _ in range(3):
            pipeoff.execute(g).wait()
            time.sleep(0.05)  # the forward and backward, on the host
    s = rec.trace.summary()
    assert s.executions == 3
    assert s.execution_efficiency is not None and s.execution_makespan_us is not None
    lo, mid, hi = s.execution_efficiency
    assert 0 < lo <= mid <= hi <= 1
    assert lo <= s.efficiency <= hi  # a time-weighted mean of the executions'
    # The host gaps are visible here instead: the lanes are busy at most while an
    # execution ran. Bounded by this trace's own gaps (each holds a 50 ms sleep, so
    # load only widens it), not by a fixed share that slower tasks could exceed.
    spans = sorted((min(t.start_ns for t in p.tasks), max(t.end_ns for t in p.tasks))
                   for p in rec.trace.executions().values())
    gaps_ns = sum(nxt[0] - prev[1] for prev, nxt in zip(spans, spans[1:]))
    assert gaps_ns >= 2 * 50_000_000, spans
    makespan_ns = spans[-1][1] - spans[0][0]
    assert s.busy_pct <= 100 * (makespan_ns - gaps_ns) / makespan_ns + 1e-6, (s.busy_pct, spans)
    assert s.critical_path_us <= s.makespan_us
    assert "executions        3: efficiency" in s.format()
    # The executions survive a saved trace.
    loaded = rec.trace.to_chrome()
    from pipeoff.trace import _chrome

    again = Trace(**_chrome.from_chrome(loaded))
    assert again.summary().executions == 3


@pytest.mark.parametrize("schedule", ["synchronous", "threads"])
def test_a_task_that_says_what_it_moved_is_traced_with_that(schedule: str) -> None:
    g = TaskGraph()
    g.add_task("copy", TaskKind.D2H, lambda ctx: ctx.moved(7), nbytes=100)
    g.add_task("other", TaskKind.D2H, lambda ctx: None, nbytes=100)
    sched = Schedule.synchronous() if schedule == "synchronous" else Schedule.pipelined()
    trace = pipeoff.execute(g, sched).trace
    assert {t.name: t.nbytes for t in trace.tasks} == {"copy": 7, "other": 100}


# -- issue 34: a prediction is marked as one wherever it is shown ---------------------------

def _predicted() -> Trace:
    g = TaskGraph()
    g.add_task("in", TaskKind.H2D, nbytes=1 << 20)
    g.add_task("opt", TaskKind.OPTIMIZER_CHUNK, deps=["in"], nbytes=1 << 20)
    return pipeoff.execute(g, backend="sim").trace


def test_a_simulated_trace_is_marked_predicted_through_save_and_load(tmp_path: Path) -> None:
    trace = _predicted()
    assert trace.predicted_by == "pipeoff's simulator"
    again = Trace.load(trace.save(tmp_path / "sim.json"))
    for t in (trace, again):
        s = t.summary()
        assert s.predicted_by == "pipeoff's simulator" and s.to_dict()["predicted"] is True
        first = s.format().splitlines()[0]
        assert first.startswith("PREDICTED by pipeoff's simulator, not measured")
    names = [e["args"]["name"] for e in trace.to_chrome()["traceEvents"]
             if e.get("name") == "process_name"]
    assert names == ["rank 0 (PREDICTED by pipeoff's simulator, not measured)"]  # Perfetto
    measured = pipeoff.execute(_graph_of(_predicted()), backend="inline").trace
    assert measured.predicted_by is None
    assert not measured.summary().format().startswith("PREDICTED")


def _graph_of(trace: Trace) -> TaskGraph:
    g = TaskGraph()
    for t in trace.tasks:
        g.add_task(t.name, TaskKind(t.kind), deps=list(t.deps), nbytes=t.nbytes)
    return g


def test_a_prediction_stays_marked_when_recorded_merged_or_from_compare(tmp_path: Path) -> None:
    from pipeoff.sim import CostModel, compare, model_shape

    with pipeoff.trace.record() as rec:
        _predicted()
    assert rec.trace.predicted_by is not None
    assert Trace.merge([_predicted(), Trace(tasks=())], metadata={"rank": 0}).predicted_by
    (p,) = compare(model_shape("0.6b"), "optimizer", ("pipelined",), CostModel.h200_pcie5())
    loaded = Trace.load(p.trace.save(tmp_path / "p.json"))
    assert loaded.predicted_by == "pipeoff's simulator (h200_pcie5 cost model)"


def test_the_plot_title_of_a_prediction_says_so() -> None:
    pytest.importorskip("matplotlib")
    from pipeoff.trace._plot import figure

    assert figure(_predicted()).axes[0].get_title().startswith(
        "PREDICTED by pipeoff's simulator, not measured")
    measured = pipeoff.execute(_graph_of(_predicted()), backend="inline").trace
    assert "PREDICTED" not in figure(measured).axes[0].get_title()


def test_plotting_leaves_matplotlibs_backend_alone(tmp_path: Path) -> None:
    # A notebook's backend is the user's: plot() draws on a figure of its own.
    pytest.importorskip("matplotlib")
    import matplotlib

    from pipeoff.trace._plot import plot

    before = matplotlib.get_backend()
    matplotlib.use("svg", force=True)  # a backend the user chose, not Agg
    try:
        plot(_predicted(), tmp_path / "p.png")
        assert matplotlib.get_backend() == "svg"
    finally:
        matplotlib.use(before, force=True)
    assert (tmp_path / "p.png").stat().st_size > 0


def test_a_profiler_traces_summary_says_what_it_cannot_know(tmp_path: Path) -> None:
    """No dependencies, issue times or staging in a torch.profiler trace: the summary
    said "efficiency 1.00: no schedule of these tasks finishes sooner" with one lane
    67 % busy, and "peak 0 B" (a tester's find). They read n/a."""
    events = [{"ph": "X", "name": f"pipeoff::h2d::c{k}", "ts": 10 * k, "dur": 5, "pid": 0,
               "tid": 1} for k in range(3)]
    path = tmp_path / "prof.json"
    path.write_text(json.dumps({"traceEvents": events}))
    s = Trace.load(path).summary()
    assert s.from_profiler
    text = s.format()
    for row in ("critical path", "efficiency", "device staging", "host staging"):
        assert f"{row:<18}n/a: a torch.profiler trace" in text, text
