"""The training loop on the trace (issue 24): train spans, the plot's structure, the
summary's clauses, and per-step figures for loggers that match the trace."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import pipeoff
import pipeoff.trace
from pipeoff.optim import FullOffloadOptimizer, OffloadOptimizer
from pipeoff.trace import StepStats, Trace
from pipeoff.trace._records import train_step


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))


def _train(model: nn.Module, opt: Any, steps: int, micro: int = 1) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for _ in range(micro):
            model(torch.randn(8, 32, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _overlap() -> tuple[nn.Module, Any]:
    model = _net()
    opt = OffloadOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), mode="overlap",
                           chunk_bytes=4096)
    opt.attach(model)
    return model, opt


def _full() -> tuple[nn.Module, Any]:
    model = _net()
    return model, FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, slot_bytes=1024)


@pytest.fixture(params=["overlap", "full_offload"])
def recorded(request: pytest.FixtureRequest) -> tuple[str, Trace, Any]:
    model, opt = _overlap() if request.param == "overlap" else _full()
    with pipeoff.trace.record() as rec:
        _train(model, opt, 3, micro=2 if request.param == "full_offload" else 1)
        opt.wait_for_step()
    return request.param, rec.trace, opt


def _spans(trace: Trace) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for t in trace.tasks:
        ts = train_step(t)
        if ts is not None:
            out.setdefault(ts[0], []).append(ts[1])
    return out


def test_the_training_loop_is_on_the_train_row(recorded: tuple[str, Trace, Any]) -> None:
    kind, trace, _ = recorded
    spans = _spans(trace)
    micro = 2 if kind == "full_offload" else 1
    assert sorted(spans["step"]) == [0, 1, 2]
    assert sorted(spans["forward"]) == sorted([0, 1, 2] * micro)
    assert sorted(spans["backward"]) == sorted([0, 1, 2] * micro)
    train = [t for t in trace.tasks if t.kind == "train"]
    assert {t.lane for t in train} == {"train"}
    # In order on the training thread: step k's forward, backward, then step() itself.
    by_step: dict[int, dict[str, Any]] = {}
    for t in train:
        what, n = train_step(t)  # type: ignore[misc]
        by_step.setdefault(n, {}).setdefault(what, []).append(t)
    for spans_n in by_step.values():
        assert max(t.end_ns for t in spans_n["forward"]) <= min(t.start_ns for t in spans_n["step"])
        assert max(t.end_ns for t in spans_n["backward"]) <= min(
            t.start_ns for t in spans_n["step"])
    # Not tasks: the summary's task count and makespan leave them out.
    s = trace.summary()
    assert s.tasks == sum(t.kind not in ("train", "gate", "hook_wait") for t in trace.tasks)
    assert s.train_steps == 3
    assert [k for k, _ in s.train_median_us][:3] == ["forward", "backward", "step"]


def test_nothing_is_recorded_outside_a_region() -> None:
    model, opt = _full()
    _train(model, opt, 1)
    with pipeoff.trace.record() as rec:
        pass
    assert not rec.trace.tasks


def test_the_train_spans_survive_chrome_json_as_user_annotations(
        recorded: tuple[str, Trace, Any], tmp_path: Path) -> None:
    _, trace, _ = recorded
    path = trace.save(tmp_path / "t.json")
    chrome = trace.to_chrome()
    spans = [e for e in chrome["traceEvents"] if e.get("cat") == "user_annotation"]
    assert spans and all(e["name"].split()[0] in ("forward", "backward", "step") for e in spans)
    tid = spans[0]["tid"]
    order = [e for e in chrome["traceEvents"]
             if e.get("name") == "thread_sort_index" and e["tid"] == tid]
    assert order[0]["args"]["sort_index"] == 0  # the train row on top
    again = Trace.load(path)
    assert _spans(again) == _spans(trace)


def _figure(trace: Trace) -> Any:
    pytest.importorskip("matplotlib")
    from pipeoff.trace._plot import MIN_WIDTH_FRACTION, figure

    fig = figure(trace)
    return fig, MIN_WIDTH_FRACTION


def test_the_plot_has_the_train_row_on_top_step_lines_and_min_widths(
        recorded: tuple[str, Trace, Any]) -> None:
    kind, trace, _ = recorded
    fig, frac = _figure(trace)
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels[0] == "train" and len(labels) > 1
    assert ax.yaxis_inverted()  # row 0 on top
    # One dashed line per step() (where it returned), on the Gantt chart.
    dashed = [ln for ln in ax.lines if ln.get_linestyle() == "--"]
    assert len(dashed) == 3
    steps = sorted(t.end_ns / 1e6 for t in trace.tasks
                   if (train_step(t) or ("", 0))[0] == "step")
    assert sorted(ln.get_xdata()[0] for ln in dashed) == pytest.approx(steps)
    # The axis starts at the first event; no bar is narrower than the minimum width.
    first = min(t.start_ns for t in trace.tasks if t.status != "cancelled") / 1e6
    lo, hi = ax.get_xlim()
    assert lo == pytest.approx(first)
    bars = [p for p in ax.patches if p.get_width() > 0]
    assert bars and min(p.get_width() for p in bars) >= (hi - lo) / 1.01 * frac * 0.999
    # A legend entry for every colour drawn, the train kinds and the gates among them.
    legend = {t.get_text() for t in ax.get_legend().get_texts()}
    assert {"train: forward", "train: backward", "train: step"} <= legend
    if kind == "full_offload":
        assert "waiting for gradients (gate)" in legend
    drawn = {p.get_facecolor() for p in bars}
    shown = {h.get_facecolor() for h in ax.get_legend().legend_handles}
    assert drawn <= shown
    assert "makespan" in ax.get_title() and "first task's start" in ax.get_title()


def test_many_short_tasks_merge_into_one_bar_with_their_count() -> None:
    from pipeoff.trace._records import TaskRecord

    tasks = [TaskRecord(name=f"d2h:{k}", kind="d2h", lane="d2h", start_ns=k * 1000,
                        end_ns=k * 1000 + 10) for k in range(50)]
    tasks.append(TaskRecord(name="opt", kind="optimizer_chunk", lane="compute",
                            start_ns=0, end_ns=100_000_000))
    fig, _ = _figure(Trace(tasks=tuple(tasks)))
    ax = fig.axes[0]
    counts = [t.get_text() for t in ax.texts if t.get_text().startswith("x")]
    assert counts == ["x50"]


def test_the_summary_says_what_each_figure_is_of(recorded: tuple[str, Trace, Any]) -> None:
    kind, trace, _ = recorded
    text = trace.summary().format()
    assert "of pipeoff's own work (not the training step)" in text
    assert "training loop     3 steps" in text
    if kind == "full_offload":
        assert "full offload" in text and "of gradients to the host per micro-step" in text
        assert "(full offload stages on the host)" in text
        assert "not a fault" in text


@pytest.mark.parametrize("make", [_overlap, _full], ids=["overlap", "full_offload"])
def test_step_stats_match_the_trace_and_reach_a_hook_for_every_step(make: Any) -> None:
    model, opt = make()
    got: list[StepStats] = []
    handle = opt.register_step_stats_hook(got.append)
    _train(model, opt, 3)
    opt.wait_for_step()  # the last step's figures go out once it is waited for
    assert [s.step for s in got] == [0, 1, 2]
    assert got[-1] == opt.last_step_stats
    for s in got:
        assert s.what == "step" and s.exposed_ms >= 0 and s.makespan_ms > 0
        # (under full offload an unmarked backward's gradients travel in its own
        # execution: the step's record has the weights' copies only)
        assert s.d2h_bytes + s.h2d_bytes > 0 and s.chunks > 0
        d = s.as_dict()
        assert d["pipeoff/step"] == s.step and all(k.startswith("pipeoff/") for k in d)
        assert all(isinstance(v, (int, float, bool)) or v is None for v in d.values())
    handle.remove()
    _train(model, opt, 1)
    opt.wait_for_step()
    assert len(got) == 3


def test_step_stats_of_a_step_equal_its_traces_figures() -> None:
    model, opt = _full()
    _train(model, opt, 2)
    opt.wait_for_step()
    stats = opt.last_step_stats
    trace = opt.last_trace
    assert stats.step == 1
    # What moved: every gradient down (in the backward's micro-step execution, which is
    # the step's too) and every weight back (the final one's, last_trace).
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert stats.d2h_bytes == weights
    assert stats.h2d_bytes == weights == sum(t.nbytes for t in trace.tasks if t.kind == "h2d")
    assert stats.chunks == sum(t.name.rsplit("/", 1)[-1].startswith("step:")
                               for t in trace.tasks)
    assert stats.makespan_ms >= trace.summary().makespan_us / 1e3 * (1 - 1e-6)


def test_a_hook_must_be_callable() -> None:
    _, opt = _full()
    with pytest.raises(pipeoff.ConfigError, match="hook must be callable"):
        opt.register_step_stats_hook(3)


def test_steps_are_ranges_in_a_torch_profiler_session() -> None:
    model, opt = _full()
    with torch.profiler.profile() as prof:
        _train(model, opt, 2)
        opt.wait_for_step()
    names = {e.name for e in prof.events()}
    assert {"pipeoff::train::step 0", "pipeoff::train::step 1"} <= names


class _LoggerDown(Exception):
    pass


def test_a_step_hook_that_raises_leaves_grad_norm_updated() -> None:
    """The hooks run last in wait_for_step: a raising logger cannot leave the
    finished step's bookkeeping (grad_norm) undone."""
    model, opt = _full()
    _train(model, opt, 1)
    opt.wait_for_step()
    first = opt.grad_norm

    def hook(stats: StepStats) -> None:
        raise _LoggerDown

    opt.register_step_stats_hook(hook)
    model(torch.randn(8, 32) * 100).pow(2).mean().backward()
    opt.step()
    with pytest.raises(_LoggerDown):
        opt.wait_for_step()
    assert opt.grad_norm != first and opt.last_step_stats.step == 1


@pytest.mark.parametrize("mode", ["single_pass", "chunked", "overlap"])
def test_a_step_that_raises_before_launching_sends_no_stats(mode: str) -> None:
    model = _net()
    opt = OffloadOptimizer(torch.optim.AdamW(model.parameters()), mode=mode, chunk_bytes=4096)
    got: list[StepStats] = []
    opt.register_step_stats_hook(got.append)
    _train(model, opt, 1)
    opt.wait_for_step()

    def closure() -> float:
        raise _LoggerDown

    with pytest.raises(_LoggerDown):
        opt.step(closure)
    opt.wait_for_step()
    assert [s.step for s in got] == [0] and opt.last_step_stats.step == 0


def test_as_dict_is_numbers_only() -> None:
    """No None (TensorBoard's add_scalars refuses it): a step has no committed key, a
    sync's is 1 or 0."""
    base = {"d2h_bytes": 1, "h2d_bytes": 2, "copy_ms": 0.5, "host_ms": 0.5,
            "collective_ms": 0.0, "wait_ms": 0.0, "chunks": 1, "exposed_ms": 1.0,
            "makespan_ms": 1.0}
    step = StepStats(step=3, what="step", **base).as_dict()
    sync = StepStats(step=3, what="sync", committed=True, **base).as_dict()
    assert "pipeoff/committed" not in step and sync["pipeoff/committed"] == 1
    assert all(type(v) in (int, float) for d in (step, sync) for v in d.values())


def test_full_offload_wait_ms_counts_the_forward_hooks_waits() -> None:
    """The next forward waits for the held weight copies: that wait is in the step's
    trace and its wait_ms, as it is for OffloadOptimizer."""
    import threading

    import pipeoff.testing

    model, opt = _full()
    _train(model, opt, 1)
    opt.wait_for_step()
    waits: dict[int, list[int]] = {}

    def hook(stats: StepStats) -> None:
        waits[stats.step] = [t.duration_ns for t in opt.last_trace.tasks
                             if t.kind == "hook_wait"]
        assert stats.wait_ms >= sum(waits[stats.step]) / 1e6

    opt.register_step_stats_hook(hook)
    with pipeoff.testing.hold_task(r"h2d.*") as release:
        model(torch.randn(8, 32)).pow(2).mean().backward()
        opt.step()
        # Released only once the next forward has begun (before pipeoff's own hooks):
        # its read of the weights must wait for the held copies.
        handle = model.register_forward_pre_hook(
            lambda *_: threading.Timer(0.2, release.set).start(), prepend=True)
        model(torch.randn(8, 32)).pow(2).mean().backward()
        handle.remove()
        opt.step()  # the previous step's figures go to the hook first
    opt.wait_for_step()
    assert sorted(waits) == [1, 2]
    assert waits[1] and not waits[2]  # (no forward came after the last step)


def test_a_forward_that_returns_a_parameter_gains_no_hooks() -> None:
    class Prompt(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.prompt = nn.Parameter(torch.randn(4, 16))

        def forward(self) -> torch.Tensor:
            return self.prompt

    model = Prompt()
    opt = OffloadOptimizer(torch.optim.SGD(model.parameters(), lr=1e-2), mode="overlap",
                           chunk_bytes=8192)
    opt.attach(model)
    with pipeoff.trace.record():
        for _ in range(5):
            model().pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        opt.wait_for_step()
    assert not model.prompt._backward_hooks


def test_failed_copies_move_no_bytes() -> None:
    from pipeoff._lowlevel import step_stats
    from pipeoff.trace import TaskRecord

    tasks = (TaskRecord(name="d2h:0", kind="d2h", lane="d2h", start_ns=0, end_ns=10,
                        enqueue_ns=0, nbytes=100),
             TaskRecord(name="d2h:1", kind="d2h", lane="d2h", start_ns=10, end_ns=20,
                        enqueue_ns=0, nbytes=100, status="failed"))
    stats = step_stats(Trace(tasks=tasks), step=0, what="step", exposed_ns=0)
    assert stats.d2h_bytes == 100 and stats.failed == 1


def test_one_model_has_one_set_of_train_spans() -> None:
    """A second optimizer attached to the model replaces the first one's spans (one
    forward is one span); detach() removes them."""
    model = _net()
    first = OffloadOptimizer(torch.optim.AdamW(model.parameters()), mode="overlap",
                             chunk_bytes=4096)
    first.attach(model)
    first.detach()
    second = OffloadOptimizer(torch.optim.AdamW(model.parameters()), mode="overlap",
                              chunk_bytes=4096)
    second.attach(model)
    with pipeoff.trace.record() as rec:
        _train(model, second, 2)
        second.wait_for_step()
    assert _spans(rec.trace)["forward"] == [0, 1]
    second.detach()
    assert not model._forward_hooks and not model._forward_pre_hooks


def test_a_profiler_trace_shows_the_steps_on_the_train_row(tmp_path: Path) -> None:
    model, opt = _full()
    with torch.profiler.profile() as prof:
        _train(model, opt, 2)
        opt.wait_for_step()
    path = tmp_path / "prof.json"
    prof.export_chrome_trace(str(path))
    trace = Trace.load(path)
    assert _spans(trace)["step"] == [0, 1]
    assert "training loop" in trace.summary().format()


def test_a_copy_with_no_gradient_to_ship_moves_no_bytes() -> None:
    """Without no_sync() the backward's gradients go in a micro-step of their own, and
    the final micro-step that step() launches has none: its copies say they moved
    nothing, so a region counts each gradient once."""
    model, opt = _full()
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    with pipeoff.trace.record() as rec:
        _train(model, opt, 2)
        opt.wait_for_step()
    d2h = [t for t in rec.trace.tasks if t.kind == "d2h"]
    assert sum(t.nbytes for t in d2h) == 2 * grad_bytes
    # The final micro-step's own copies moved nothing; the step's figures count the
    # backward's micro-step, once.
    assert sum(t.nbytes for t in opt.last_trace.tasks if t.kind == "d2h") == 0
    assert opt.last_step_stats.d2h_bytes == grad_bytes
    assert sum(t.nbytes for t in opt.last_trace.tasks if t.kind == "h2d") == grad_bytes
