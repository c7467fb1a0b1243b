"""The training loop on the trace (issue 24): train spans, the plot's structure, the
summary's clauses, and per-step figures for loggers that match the trace."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import pipeoff
import pipeoff.testing
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
        assert "waiting for gradients from the backward (gate)" in legend
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
    assert "lanes busy" in text and "of the makespan has a task running on some" in text
    assert "training loop     3 steps" in text
    if kind == "full_offload":
        assert "full offload" in text and "of gradients to the host per micro-step" in text
        assert "(full offload stages on the host)" in text
        assert "not a fault" in text and "for gradients from the backward (" in text


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


@pytest.mark.parametrize(("make", "last"), [(_overlap, r"d2h\d+"), (_full, "done")],
                         ids=["overlap", "full_offload"])
def test_a_steps_wait_for_the_one_before_is_exposed_time_with_a_hook_too(
        make: Any, last: str) -> None:
    """step() first waits for the step before it: that wait is what the loop pays, in
    ``exposed_ms``, with a stats hook registered as without one (with one, it was waited
    for before the clock started: a tester's find, full offload's ``exposed_ms`` read
    0.4 of step()'s wall time). The step before is held by a delay of its last tasks;
    no forward runs in between (it would wait for them instead), the gradients are set
    by hand."""
    import time

    model, opt = make()
    got: list[StepStats] = []
    opt.register_step_stats_hook(got.append)
    _train(model, opt, 1)
    opt.wait_for_step()
    delay = 0.4
    with pipeoff.testing.delay_task(last, delay):
        _train(model, opt, 1)  # step 1: in flight, its last tasks held
        launched = time.perf_counter_ns()
        for p in model.parameters():
            p.grad = torch.ones(p.shape)
        waited = time.perf_counter_ns()
        opt.step()  # step 2 waits for step 1
        opt.wait_for_step()
    assert [s.step for s in got] == [0, 1, 2]
    # (at least the delay's rest once step 2 began; a busy machine only lengthens it)
    assert got[2].exposed_ms >= (delay * 1e9 - (waited - launched)) / 1e6 - 1, got[2]


@pytest.mark.parametrize("make", [_overlap, _full], ids=["overlap", "full_offload"])
def test_the_stats_hooks_own_time_is_not_exposed_time(make: Any) -> None:
    """A stats hook runs inside the next step() (the figures of a step in flight go out
    once it is waited for): its time is the logger's, not the step's (a tester's find:
    a 200 ms hook read as 200 ms of exposed time under overlap). Exact, whatever the
    machine's load: exposed_ms is at most step()'s wall time less the hook's."""
    import time

    model, opt = make()
    took: list[int] = []

    def hook(stats: StepStats) -> None:
        start = time.perf_counter_ns()
        time.sleep(0.2)
        took.append(time.perf_counter_ns() - start)

    got: list[StepStats] = []
    opt.register_step_stats_hook(got.append)
    opt.register_step_stats_hook(hook)
    _train(model, opt, 1)
    model(torch.randn(8, 32)).pow(2).mean().backward()
    before = len(took)
    start = time.perf_counter_ns()
    opt.step()  # step 1: step 0's figures go to the hooks inside it
    wall = time.perf_counter_ns() - start
    hooks = sum(took[before:])
    opt.wait_for_step()
    assert hooks >= 0.2e9 and [s.step for s in got] == [0, 1]
    assert got[1].exposed_ms * 1e6 <= wall - hooks + 1e5, (got[1], wall, hooks)


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


# -- issue 34: a recorded window of steps ---------------------------------------------------

def _recorded_steps(trace: Trace) -> list[int]:
    return sorted(set(_spans(trace).get("step", [])))


@pytest.mark.parametrize("make", [_overlap, _full], ids=["overlap", "full_offload"])
def test_a_window_keeps_only_its_steps(make: Any) -> None:
    model, opt = make()
    window = pipeoff.trace.RecordWindow(wait=1, warmup=1, active=2, repeat=1)
    with pipeoff.trace.record(window=window, replica=1) as rec:
        _train(model, opt, 7, micro=2 if make is _full else 1)
        opt.wait_for_step()
    trace = rec.trace
    assert _recorded_steps(trace) == [2, 3]
    assert sorted(set(_spans(trace)["forward"])) == [2, 3]  # their forwards and backwards too
    assert sorted(set(_spans(trace)["backward"])) == [2, 3]
    per_step = 3 if make is _full else 1  # full offload: 2 micro-steps and the host step
    assert trace.summary().executions == 2 * per_step
    assert rec.steps_seen == 7
    assert trace.metadata["steps_recorded"] == [2, 3] and trace.metadata["replica"] == 1


def test_a_torch_profiler_schedule_is_a_window_too() -> None:
    model, opt = _overlap()
    with pipeoff.trace.record(window=torch.profiler.schedule(
            wait=0, warmup=1, active=1, repeat=2)) as rec:
        _train(model, opt, 6)
        opt.wait_for_step()
    assert _recorded_steps(rec.trace) == [1, 3]


def test_max_steps_bounds_what_a_long_region_keeps() -> None:
    model, opt = _overlap()
    with pipeoff.trace.record(max_steps=2) as rec:
        _train(model, opt, 6)
        opt.wait_for_step()
        # Dropped as the run goes, not when the trace is built: memory stays bounded.
        assert len(rec._executions) <= 2
    assert _recorded_steps(rec.trace) == [4, 5]
    assert rec.trace.metadata["steps_recorded"] == [4, 5]


def test_steps_counted_by_hand_as_with_the_profiler() -> None:
    model, opt = _overlap()
    with pipeoff.trace.record(window=pipeoff.trace.RecordWindow(active=1, skip_first=2)) as rec:
        for _ in range(4):
            _train(model, opt, 2)  # two optimizer steps per "step" of the region
            rec.step()
        opt.wait_for_step()
    assert _recorded_steps(rec.trace) == [4, 5, 6, 7]  # region steps 2 and 3


def test_window_arguments_are_checked() -> None:
    with pytest.raises(pipeoff.ConfigError, match="RecordWindow.active"):
        pipeoff.trace.RecordWindow(active=0)
    with pytest.raises(pipeoff.ConfigError, match="max_steps"):
        with pipeoff.trace.record(max_steps=0):
            pass
    with pytest.raises(pipeoff.ConfigError, match="window must be"):
        with pipeoff.trace.record(window=3):  # type: ignore[arg-type]
            pass


@pytest.mark.filterwarnings("ignore:Profiler won't be using warmup")
def test_record_window_matches_torch_profiler_schedule() -> None:
    from torch.profiler import ProfilerAction

    for kw in ({"wait": 1, "warmup": 1, "active": 2, "repeat": 1},
               {"wait": 0, "warmup": 2, "active": 1, "repeat": 0, "skip_first": 3},
               {"wait": 2, "warmup": 0, "active": 3, "repeat": 2, "skip_first": 1}):
        ours = pipeoff.trace.RecordWindow(**kw)
        theirs = torch.profiler.schedule(**kw)
        for step in range(40):
            recorded = theirs(step) in (ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE)
            assert ours.records(step) == recorded, (kw, step)


# -- issue 34: plots that never overlap their labels, gates named by their feature -------

def test_step_labels_never_overlap_on_a_trace_of_many_short_steps() -> None:
    from pipeoff.trace import TaskRecord

    tasks = []
    for k in range(80):  # steps 1 ms apart, unevenly: labels would run into each other
        t0 = k * 1_000_000 + (k % 7) * 40_000
        tasks.append(TaskRecord(name=f"step {k}", kind="train", lane="train", start_ns=t0,
                                end_ns=t0 + 100_000))
        tasks.append(TaskRecord(name=f"opt{k}", kind="optimizer_chunk", lane="compute",
                                start_ns=t0 + 100_000, end_ns=t0 + 600_000))
    fig, _ = _figure(Trace(tasks=tuple(tasks)))
    ax = fig.axes[0]
    labels = [t for t in ax.texts if t.get_text().startswith("step ")]
    assert len(labels) == 80  # one per step, the overlapping ones hidden
    shown = [t for t in labels if t.get_visible()]
    assert 2 <= len(shown) < 80 and shown[0].get_text() == "step 0"
    renderer = fig.canvas.get_renderer()
    boxes = sorted((t.get_window_extent(renderer) for t in shown), key=lambda b: b.x0)
    assert all(a.x1 < b.x0 for a, b in zip(boxes, boxes[1:]))
    dashed = [ln for ln in ax.lines if ln.get_linestyle() == "--"]
    assert len(dashed) == 80  # every boundary still drawn
    title = ax.title.get_window_extent(renderer)
    assert all(b.y1 <= title.y0 for b in boxes)  # nor the title


def test_gates_are_named_by_what_they_wait_for_in_their_feature() -> None:
    from pipeoff.trace import TaskRecord

    def gate(name: str, end: int) -> TaskRecord:
        return TaskRecord(name=name, kind="gate", lane="gates", start_ns=0, end_ns=end)

    tasks = (gate("x0/commit", 5_000), gate("x1/grad:w", 2_000), gate("x1/prev", 1_000),
             TaskRecord(name="x0/outer:c0", kind="host", lane="outer_step", start_ns=5_000,
                        end_ns=9_000, gates=("x0/commit",)),
             TaskRecord(name="x1/d2h:w", kind="d2h", lane="d2h", start_ns=2_000,
                        end_ns=3_000, gates=("x1/grad:w", "x1/prev")))
    text = Trace(tasks=tasks).summary().format()
    gate_line = next(ln for ln in text.splitlines() if ln.startswith("gate waits"))
    assert "the quorum's commit decision (should_commit) (1 gate, 0.005 ms)" in gate_line
    assert "gradients from the backward (1 gate" in gate_line
    diloco = Trace(tasks=tasks[:1] + tasks[3:4]).summary().format()
    assert "gradients from the backward" not in diloco  # not a fixed wording
    fig, _ = _figure(Trace(tasks=tasks))
    handles = {h.get_label(): h.get_hatch() for h in fig.axes[0].get_legend().legend_handles}
    gates = {k: v for k, v in handles.items() if k.endswith("(gate)")}
    assert "waiting for the quorum's commit decision (should_commit) (gate)" in gates
    assert len(set(gates.values())) == len(gates) == 3  # told apart, not one grey hatch


def test_one_step_summary_explains_a_high_efficiency_beside_idle_lanes() -> None:
    """Issue 34: ``efficiency 1.00`` beside ``busy 1.6 %`` read as a contradiction: the
    summary now says the lanes were idle waiting for their inputs."""
    from pipeoff.trace import TaskRecord

    tasks = (TaskRecord(name="grad:w", kind="gate", lane="gates", start_ns=0,
                        end_ns=98_000),
             TaskRecord(name="d2h:w", kind="d2h", lane="d2h", start_ns=0, end_ns=1_000),
             TaskRecord(name="acc:w", kind="host", lane="accumulate", start_ns=98_000,
                        end_ns=100_000, gates=("grad:w",), deps=("d2h:w",)))
    s = Trace(tasks=tasks).summary()
    assert s.efficiency == 1.0 and s.busy_pct < 5
    text = s.format()
    eff = next(ln for ln in text.splitlines() if ln.startswith("efficiency"))
    assert "the lanes were idle 97 % of the makespan, waiting for their inputs" in eff
    assert "lanes busy        3.0 % of the makespan has a task running on some pipeoff lane" \
        in text
