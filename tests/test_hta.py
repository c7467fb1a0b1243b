"""HTA (Holistic Trace Analysis) reads pipeoff's traces, from every backend.

HTA finds device work by its ``stream``, collectives by NCCL's kernel names
and copies by ``Memcpy``; pipeoff writes its Chrome traces that way.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import pipeoff
import pipeoff.testing
from pipeoff import Schedule, TaskGraph, TaskKind
from pipeoff.trace import Trace

hta = pytest.importorskip("hta.trace_analysis")
logging.getLogger("hta").setLevel(logging.ERROR)


def mixed_graph(device: torch.device | str | None = None, work: bool = True) -> TaskGraph:
    """Collectives, copies and optimizer chunks that overlap on their lanes."""
    x = torch.zeros(1 << 16) if work else None
    g = TaskGraph(device=device)
    for k in range(4):
        def busy(ctx: pipeoff.TaskContext, x: torch.Tensor | None = x) -> None:
            if x is not None:
                for _ in range(20):
                    x.add_(1.0)

        w = busy if work else None
        g.add_task(f"allreduce:b{k}", TaskKind.ALLREDUCE, w, nbytes=8 << 20)
        g.add_task(f"d2h:b{k}", TaskKind.D2H, w, deps=[f"allreduce:b{k}"], nbytes=8 << 20)
        g.add_task(f"opt{k}", TaskKind.OPTIMIZER_CHUNK, w, nbytes=4 << 20)
        g.add_task(f"h2d{k}", TaskKind.H2D, w, deps=[f"opt{k}"], nbytes=4 << 20)
    g.add_task("should_commit", TaskKind.HOST, (lambda ctx: True) if work else None,
               deps=[f"d2h:b{k}" for k in range(4)])
    return g


def traces() -> dict[str, Trace]:
    out = {}
    with pipeoff.testing.delay_lane("comm", 0.002), pipeoff.testing.delay_lane("compute", 0.002):
        out["threads"] = pipeoff.execute(mixed_graph()).trace
        out["inline"] = pipeoff.execute(mixed_graph(), Schedule.synchronous()).trace
        with pipeoff.testing.simulated_cuda() as sim:
            out["cuda"] = pipeoff.execute(mixed_graph(sim.device)).trace
    out["sim"] = pipeoff.execute(mixed_graph(work=False), backend="sim").trace
    with pipeoff.trace.record() as rec:  # a recorded region: several executions
        for _ in range(3):
            pipeoff.execute(mixed_graph()).wait()
    out["recorded"] = rec.trace
    from pipeoff._lowlevel import train_span

    with pipeoff.trace.record() as rec:  # with the training loop's spans (user annotations)
        for step in range(3):
            with train_span("forward", step):
                torch.zeros(1 << 16).add_(1.0)
            with train_span("step", step):
                pipeoff.execute(mixed_graph()).wait()
    out["training"] = rec.trace
    assert any(t.kind == "train" for t in out["training"].tasks)
    return out


@pytest.fixture(scope="module")
def analyses(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Trace, object]]:
    out = {}
    for name, trace in traces().items():
        d = Path(tmp_path_factory.mktemp(name))
        trace.save(d / "rank0_trace.json")
        out[name] = (trace, hta.TraceAnalysis(trace_dir=str(d)))
    return out


@pytest.mark.parametrize("backend", ["threads", "inline", "cuda", "sim", "recorded", "training"])
def test_hta_overlap_agrees_with_the_summary(analyses: dict[str, tuple[Trace, object]],
                                             backend: str) -> None:
    trace, analysis = analyses[backend]
    ours = trace.summary().comm_overlap_pct
    theirs = float(analysis.get_comm_comp_overlap(visualize=False)  # type: ignore[attr-defined]
                   ["comp_comm_overlap_pctg"].iloc[0])
    assert ours is not None
    # HTA works in whole microseconds; pipeoff in nanoseconds.
    assert theirs == pytest.approx(ours, abs=3.0), (backend, ours, theirs)


@pytest.mark.parametrize("backend", ["threads", "inline", "cuda", "sim", "recorded", "training"])
def test_hta_breakdowns_see_the_device_work(analyses: dict[str, tuple[Trace, object]],
                                            backend: str) -> None:
    trace, analysis = analyses[backend]
    temporal = analysis.get_temporal_breakdown(visualize=False)  # type: ignore[attr-defined]
    assert float(temporal["kernel_time(us)"].iloc[0]) > 0
    assert float(temporal["compute_time(us)"].iloc[0]) > 0  # the optimizer chunks
    idle = analysis.get_idle_time_breakdown(visualize=False)  # type: ignore[attr-defined]
    frame = idle[0] if isinstance(idle, tuple) else idle
    lanes = {t.lane for t in trace.tasks if t.kind not in ("host", "train")}
    assert frame["stream"].nunique() == len(lanes)  # one stream per device lane


def test_hta_reads_sub_microsecond_tasks_and_odd_compute_names(tmp_path: Path) -> None:
    g = TaskGraph()
    for k in range(8):
        g.add_task(f"ar{k}", TaskKind.ALLREDUCE)  # null work: under a microsecond
        g.add_task(f"gradSync{k}", TaskKind.OPTIMIZER_CHUNK)  # HTA's regex: not compute
    with pipeoff.testing.delay_lane("comm", 0.002), pipeoff.testing.delay_lane("compute", 0.002):
        trace = pipeoff.execute(g).trace
    trace.save(tmp_path / "rank0_trace.json")
    analysis = hta.TraceAnalysis(trace_dir=str(tmp_path))
    analysis.get_temporal_breakdown(visualize=False)  # raised on durations of -1 us
    theirs = float(analysis.get_comm_comp_overlap(visualize=False)
                   ["comp_comm_overlap_pctg"].iloc[0])
    ours = trace.summary().comm_overlap_pct
    assert ours is not None and theirs == pytest.approx(ours, abs=3.0)
    loaded = Trace.load(tmp_path / "rank0_trace.json")
    assert {t.name for t in loaded.tasks} == {t.name for t in trace.tasks}  # names kept
