"""A Gantt chart of a trace: one row per lane, coloured by kind, staging bytes below."""

from __future__ import annotations

from pathlib import Path

from pipeoff._errors import ConfigError
from pipeoff.trace._trace import HOOK_WAIT, Trace

_COLORS = {
    "h2d": "#4C78A8",
    "d2h": "#72B7B2",
    "allreduce": "#F58518",
    "optimizer_chunk": "#54A24B",
    "host": "#B279A2",
    HOOK_WAIT: "#E45756",
}


def plot(trace: Trace, out: str | Path, *, arrows: bool = False, width: float = 12.0,
         dpi: int = 100) -> Path:
    """Draw ``trace`` as a Gantt chart PNG at ``out``.

    Raises:
        ConfigError: matplotlib is not installed (``pip install 'pipeoff[plot]'``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        raise ConfigError(
            "plotting needs matplotlib: pip install 'pipeoff[plot]'"
        ) from None
    ran = [t for t in trace.tasks if t.status != "cancelled"]
    lanes: list[tuple[int, str]] = []
    for t in ran:
        if (t.rank, t.lane) not in lanes:
            lanes.append((t.rank, t.lane))
    multi_rank = len({r for r, _ in lanes}) > 1
    row = {key: i for i, key in enumerate(lanes)}
    fig, (ax, ax2) = plt.subplots(
        2, 1, figsize=(width, 1.0 + 0.45 * max(len(lanes), 1) + 1.6), sharex=True,
        gridspec_kw={"height_ratios": [max(len(lanes), 1), 1.6]},
    )
    for t in ran:
        y = row[(t.rank, t.lane)]
        ax.barh(y, (t.end_ns - t.start_ns) / 1e6, left=t.start_ns / 1e6, height=0.7,
                color=_COLORS.get(t.kind, "#9D755D"),
                edgecolor="#D62728" if t.status == "failed" else "none")
    if arrows:
        by_name = {(t.rank, t.name): t for t in ran}
        for t in ran:
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
    s = trace.summary()
    ax.set_title(f"makespan {s.makespan_us / 1e3:.2f} ms, efficiency {s.efficiency:.2f}")
    kinds = sorted({t.kind for t in ran})
    ax.legend(handles=[Patch(color=_COLORS.get(k, "#9D755D"), label=k) for k in kinds],
              loc="upper right", fontsize="small")
    timeline = trace.staging_timeline()
    if timeline:
        xs = [0.0] + [time_ns / 1e6 for time_ns, _, _ in timeline]
        dev = [0.0] + [d / 2**20 for _, d, _ in timeline]
        host = [0.0] + [h / 2**20 for _, _, h in timeline]
        ax2.step(xs, dev, where="post", label="device staging")
        ax2.step(xs, host, where="post", label="host staging")
        if trace.device_budget_bytes:
            ax2.axhline(trace.device_budget_bytes / 2**20, ls="--", color="C0", lw=0.8,
                        label="device budget")
        ax2.legend(loc="upper right", fontsize="small")
    ax2.set_ylabel("MiB live")
    ax2.set_xlabel("ms")
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return out
