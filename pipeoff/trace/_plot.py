"""A Gantt chart of a trace: the training loop's row on top, one row per lane below, coloured
by kind, step boundaries as vertical lines, staging bytes underneath."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeoff._errors import ConfigError
from pipeoff.trace._format import predicted_line
from pipeoff.trace._records import GATE, HOOK_WAIT, TRAIN, TaskRecord, gate_meaning, train_step
from pipeoff.trace._trace import Trace

__all__ = ["MIN_WIDTH_FRACTION", "plot"]

_COLORS = {
    "h2d": "#4C78A8",
    "d2h": "#72B7B2",
    "allreduce": "#F58518",
    "optimizer_chunk": "#54A24B",
    "host": "#B279A2",
    HOOK_WAIT: "#E45756",
}
_TRAIN_COLORS = {
    "forward": "#9ECAE1",
    "backward": "#FDAE6B",
    "step": "#A1D99B",
    "sync": "#BCBDDC",
    "prepare": "#DADAEB",
}
_GATE_COLOR = "#D9D9D9"
_GATE_HATCHES = ("///", "\\\\\\", "xxx", "...", "|||", "---")
"""One hatch per kind of gate on a plot, so that each legend entry is told apart."""
_LABELS = {
    "h2d": "host to device copy",
    "d2h": "device to host copy",
    "allreduce": "all-reduce",
    "optimizer_chunk": "optimizer chunk",
    "host": "host work (fold, step, norm)",
    HOOK_WAIT: "forward hook waiting for a step",
}
MIN_WIDTH_FRACTION = 0.003
"""The narrowest a bar is drawn, as a fraction of the time axis: shorter tasks are
widened to it, and a run of them that would overlap is drawn as one bar with
their count."""


@dataclass
class _Bar:
    start_ms: float
    end_ms: float
    kind: str
    count: int
    failed: bool


def _bars(records: list[TaskRecord], min_ms: float, key: Any) -> list[_Bar]:
    """Bars of one row: each record at least ``min_ms`` wide; consecutive short records
    of the same colour that would overlap at that width merge into one bar."""
    out: list[_Bar] = []
    for t in sorted(records, key=lambda r: r.start_ns):
        s, e = t.start_ns / 1e6, t.end_ns / 1e6
        kind = key(t)
        last = out[-1] if out else None
        short = e - s < min_ms
        if (last is not None and short and last.kind == kind and not t.status == "failed"
                and s <= max(last.end_ms, last.start_ms + min_ms)):
            last.end_ms = max(last.end_ms, e)
            last.count += 1
            continue
        out.append(_Bar(s, e, kind, 1, t.status == "failed"))
    return out


class _OwnFigures:
    """The two pyplot calls the plot makes, on a figure of its own with the Agg canvas:
    pyplot's global backend and figure list are left alone (``matplotlib.use("Agg")``
    would switch a notebook's backend)."""

    @staticmethod
    def subplots(*args: Any, figsize: Any = None, **kwargs: Any) -> tuple[Any, Any]:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=figsize)
        FigureCanvasAgg(fig)
        return fig, fig.subplots(*args, **kwargs)

    @staticmethod
    def close(fig: Any) -> None:
        """Nothing to close: no pyplot figure was made."""


def plot(trace: Trace, out: str | Path, *, arrows: bool = False, width: float = 12.0,
         dpi: int = 100) -> Path:
    """Draw ``trace`` as a Gantt chart PNG at ``out``.

    Rows, top to bottom: ``train`` (the training thread's forward, backward,
    ``step()`` and syncs, when a recorded region captured them), then each of
    pipeoff's lanes. A gate (a lane waiting for an input from outside its
    execution: a gradient the backward has not produced yet) is drawn in grey
    on the row of the lane it held. Step boundaries (the end of each ``step()``)
    are dashed vertical lines. The axis starts at the first event.

    Raises:
        ConfigError: matplotlib is not installed (``pip install 'pipeoff[plot]'``).
    """
    try:
        from matplotlib.patches import Patch
    except ImportError:
        raise ConfigError(
            "plotting needs matplotlib: pip install 'pipeoff[plot]'"
        ) from None
    plt = _OwnFigures()
    fig = figure(trace, arrows=arrows, width=width, plt=plt, patch=Patch)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return out


def figure(trace: Trace, *, arrows: bool = False, width: float = 12.0, plt: Any = None,
           patch: Any = None) -> Any:
    """The matplotlib figure :func:`plot` saves (its axes: the Gantt chart, then staging)."""
    if plt is None or patch is None:
        from matplotlib.patches import Patch as patch

        plt = _OwnFigures()
    shown = [t for t in trace.tasks if t.status != "cancelled"]
    train = [t for t in shown if t.kind == TRAIN]
    tasks = [t for t in shown if t.kind not in (TRAIN, GATE)]
    gates = [t for t in shown if t.kind == GATE]
    lanes: list[tuple[int, str]] = []
    for t in train + tasks:
        if (t.rank, t.lane) not in lanes:
            lanes.append((t.rank, t.lane))
    multi_rank = len({r for r, _ in lanes}) > 1
    row = {key: i for i, key in enumerate(lanes)}
    events = [t for t in shown if t.end_ns >= t.start_ns]
    x0 = min((t.start_ns for t in events), default=0) / 1e6
    x1 = max((t.end_ns for t in events), default=0) / 1e6
    span = max(x1 - x0, 1e-6)
    min_ms = span * MIN_WIDTH_FRACTION
    fig, (ax, ax2) = plt.subplots(
        2, 1, figsize=(width, 1.2 + 0.45 * max(len(lanes), 1) + 1.6), sharex=True,
        gridspec_kw={"height_ratios": [max(len(lanes), 1), 1.6]},
    )
    # Gates under the tasks that waited on them, on those tasks' rows.
    waiting_lane: dict[tuple[int, str], str] = {}
    for t in tasks:
        for gate_name in t.gates:  # (prefixed like the gate's record in a recorded region)
            waiting_lane.setdefault((t.rank, gate_name), t.lane)
    gate_kinds: dict[str, str] = {}  # legend label -> hatch
    for g in gates:
        lane = waiting_lane.get((g.rank, g.name))
        if lane is None or (g.rank, lane) not in row:
            continue
        label = _gate_label(g.name)
        hatch = gate_kinds.setdefault(label, _GATE_HATCHES[len(gate_kinds) % len(_GATE_HATCHES)])
        ax.barh(row[(g.rank, lane)], max((g.end_ns - g.start_ns) / 1e6, min_ms),
                left=g.start_ns / 1e6, height=0.85, color=_GATE_COLOR, hatch=hatch,
                edgecolor="#BDBDBD", linewidth=0, zorder=1)
    merged = 0
    kinds: set[str] = set()
    for key in lanes:
        recs = [t for t in (train if key[1] == "train" else tasks)
                if (t.rank, t.lane) == key]
        colour_of = (lambda r: (train_step(r) or ("train", 0))[0]) if key[1] == "train" else (
            lambda r: r.kind)
        last_label = float("-inf")
        for b in _bars(recs, min_ms, colour_of):
            kinds.add(b.kind)
            ax.barh(row[key], max(b.end_ms - b.start_ms, min_ms), left=b.start_ms, height=0.6,
                    color=_TRAIN_COLORS.get(b.kind) or _COLORS.get(b.kind, "#9D755D"),
                    edgecolor="#D62728" if b.failed else "none", zorder=2)
            # The count of a merged run, where its label does not run into the last one.
            if b.count > 1 and b.start_ms - last_label > span * 0.025:
                merged += 1
                last_label = b.start_ms
                ax.text(b.start_ms, row[key] - 0.38, f"x{b.count}", fontsize=6,
                        va="bottom", ha="left", color="#333", zorder=3)
    # Step boundaries: where each step() returned.
    steps: list[tuple[float, int]] = []
    for t in train:
        ts = train_step(t)
        if ts is not None and ts[0] == "step":
            steps.append((t.end_ns / 1e6, ts[1]))
    steps.sort()
    step_labels = []
    for x, n in steps:
        for a in (ax, ax2):
            a.axvline(x, ls="--", lw=0.7, color="#636363", zorder=0)
        step_labels.append(ax.text(x, -0.55, f"step {n}", fontsize=7, ha="right", va="bottom",
                                   color="#636363"))
    if arrows:
        by_name = {(t.rank, t.name): t for t in tasks}
        for t in tasks:
            for d in t.deps:
                src = by_name.get((t.rank, d))
                if src is None or src.lane == t.lane:
                    continue
                ax.annotate("", xy=(t.start_ns / 1e6, row[(t.rank, t.lane)]),
                            xytext=(src.end_ns / 1e6, row[(src.rank, src.lane)]),
                            arrowprops={"arrowstyle": "->", "color": "#555", "lw": 0.6})
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([f"r{r} {lane}" if multi_rank else lane for r, lane in lanes])
    ax.invert_yaxis()
    ax.set_xlim(x0, x0 + span * 1.01)
    s = trace.summary()
    title = (f"pipeoff's lanes: makespan {s.makespan_us / 1e3:.2f} ms (first task's start to "
             f"last task's end)")
    if train:
        title += f"; axis from {x0:.2f} to {x1:.2f} ms, the training loop's spans on top"
    if s.predicted_by is not None:
        title = predicted_line(s.predicted_by) + "\n" + title
    ax.set_title(title, fontsize=9, color="#B22222" if s.predicted_by is not None else "black",
                 pad=22 if steps else 6)  # (above the step labels)
    handles = [patch(color=_TRAIN_COLORS.get(k) or _COLORS.get(k, "#9D755D"),
                     label=(f"train: {k}" if k in _TRAIN_COLORS else _LABELS.get(k, k)))
               for k in sorted(kinds, key=lambda k: (k not in _TRAIN_COLORS, k))]
    for label, hatch in gate_kinds.items():
        handles.append(patch(facecolor=_GATE_COLOR, hatch=hatch, edgecolor="#BDBDBD",
                             label=label))
    if any(t.status == "failed" for t in tasks):
        handles.append(patch(facecolor="white", edgecolor="#D62728", label="failed"))
    if merged:
        handles.append(patch(color="white", label="xN: N short tasks drawn as one"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    timeline = trace.staging_timeline()
    if timeline:
        xs = [x0] + [time_ns / 1e6 for time_ns, _, _ in timeline]
        dev = [0.0] + [d / 2**20 for _, d, _ in timeline]
        host = [0.0] + [h / 2**20 for _, _, h in timeline]
        ax2.step(xs, dev, where="post", label="device staging")
        ax2.step(xs, host, where="post", label="host staging")
        if trace.device_budget_bytes:
            ax2.axhline(trace.device_budget_bytes / 2**20, ls="--", color="C0", lw=0.8,
                        label="device budget")
        ax2.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    ax2.set_ylabel("MiB live")
    ax2.set_xlabel("ms")
    fig.tight_layout()
    _thin_labels(fig, step_labels)
    return fig


def _thin_labels(fig: Any, labels: list[Any], pad_px: float = 8.0) -> None:
    """Hide step labels that would overlap the last one shown, left to right: with many
    steps close together every few are labelled (each dashed line stays)."""
    if len(labels) < 2:
        return
    renderer = fig.canvas.get_renderer()
    right = float("-inf")
    for text in labels:  # in time order
        box = text.get_window_extent(renderer)
        if box.x0 < right + pad_px:
            text.set_visible(False)
        else:
            right = box.x1


def _gate_label(name: str) -> str:
    """The legend entry of a gate: what its lanes wait for, as its feature names it."""
    return f"waiting for {gate_meaning(name)} (gate)"
