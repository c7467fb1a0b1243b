"""The plain-text summary of a trace: each line names what its figure is of."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeoff.trace._trace import TraceSummary

__all__ = ["fmt_bytes", "format_summary", "predicted_line"]


def fmt_bytes(n: int | None) -> str:
    """``1536`` -> ``"1.50 KiB"``; ``None`` -> ``"unbounded"``."""
    if n is None:
        return "unbounded"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} GiB"


def predicted_line(predicted_by: str) -> str:
    """The line that heads every view of a predicted trace (summary, plot, diff)."""
    return f"PREDICTED by {predicted_by}, not measured"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f} %"


def _idle_clause(s: TraceSummary) -> str:
    """Why the lanes were idle, where they mostly were: said beside the efficiency, so
    that a high efficiency beside a low busy share does not read as a contradiction."""
    if s.busy_pct >= 50 or s.executions > 1:
        return ""  # (a region's efficiency leaves the time between executions out)
    waited = "their inputs (gate waits below)" if s.gates else "the host to issue their tasks"
    return (f"; the lanes were idle {100 - s.busy_pct:.0f} % of the makespan, waiting for "
            f"{waited}: those waits, not the schedule, set the pace")


def _gate_line(s: TraceSummary) -> str:
    if s.gate_waits_by:
        what = ", ".join(f"{meaning} ({n} gate{'s' if n != 1 else ''}, {us / 1e3:.3f} ms)"
                         for meaning, n, us in s.gate_waits_by)
    else:
        what = "their inputs"
    return (f"gate waits        {s.gates} gates, lanes waited {s.gate_wait_total_us / 1e3:.3f} ms"
            f" in total for {what}: lanes idle until their inputs came, not a fault")


def format_summary(s: TraceSummary) -> str:
    """:meth:`TraceSummary.format`."""
    several = s.executions > 1
    lines = [predicted_line(s.predicted_by) + ": every time below is the cost model's"] \
        if s.predicted_by is not None else []
    lines += [
        f"tasks             {s.tasks} ({s.failed} failed, {s.cancelled} cancelled):"
        " pipeoff's own tasks",
        f"makespan          {s.makespan_us / 1e3:.3f} ms: pipeoff's lanes, from the first"
        " task's start to the last task's end",
        f"critical path     {s.critical_path_us / 1e3:.3f} ms: a lower bound on that"
        " makespan for these task durations"
        + (" (the sum of each execution's own bound)" if several else ""),
        f"efficiency        {s.efficiency:.2f}: critical path / makespan, of pipeoff's own"
        " work (not the training step); 1.00: no schedule of these tasks finishes sooner"
        + (", time-weighted over the executions (see below)" if several else "")
        + _idle_clause(s),
        f"lanes busy        {s.busy_pct:.1f} % of the makespan has a task running on some"
        " pipeoff lane"
        + ("" if s.busy_pct >= 99.95 else
           " (the rest: the training loop's own time between executions, and waits)"
           if several else " (the rest: every lane idle, waiting)"),
        f"comm overlap      {_pct(s.comm_overlap_pct)} of collective time under compute"
        " (HTA's comm/comp overlap)",
        f"comm hidden       {_pct(s.comm_hidden_pct)} of collective time under copies or"
        " compute",
        f"copy overlap      {_pct(s.copy_overlap_pct)} of copy time under compute or"
        " collectives",
        f"device staging    peak {fmt_bytes(s.peak_device_staging_bytes)}"
        f" / budget {fmt_bytes(s.device_budget_bytes)}: pipeoff's device staging buffers"
        + (" (the budget bounds each execution alone; executions that overlap add up)"
           if several and s.device_budget_bytes is not None else "")
        + (" (full offload stages on the host)" if s.offload_d2h_bytes is not None
           else ""),
        f"host staging      peak {fmt_bytes(s.peak_host_staging_bytes)}"
        f" / budget {fmt_bytes(s.host_budget_bytes)}: pipeoff's host staging buffers, not"
        " the state it keeps in host memory (optimizer state, masters, backups)"
        + (" (the budget bounds each execution alone; executions that overlap add up)"
           if several and s.host_budget_bytes is not None else ""),
        f"hook waits        {s.hook_waits}, total {s.hook_wait_total_us / 1e3:.3f} ms,"
        f" worst {s.hook_wait_max_us / 1e3:.3f} ms",
    ]
    if s.from_profiler:
        # (a tester's find: "efficiency 1.00: no schedule ... finishes sooner" and "peak
        # 0 B" for a profiler trace, which has no dependencies, issue times or staging)
        unknown = "n/a: a torch.profiler trace has no dependencies, issue times or staging"
        for k, line in enumerate(lines):
            if line.startswith(("critical path", "efficiency", "device staging",
                                "host staging")):
                lines[k] = f"{line[:18]}{unknown}"
    if s.execution_efficiency is not None and s.execution_makespan_us is not None:
        lo, mid, hi = s.execution_efficiency
        mlo, mmid, mhi = (x / 1e3 for x in s.execution_makespan_us)
        lines.append(f"executions        {s.executions}: efficiency {lo:.2f} / {mid:.2f} / "
                     f"{hi:.2f}, makespan {mlo:.3f} / {mmid:.3f} / {mhi:.3f} ms "
                     "(min / median / max)")
    if s.gates:
        lines.append(_gate_line(s))
    if s.train_steps or s.train_median_us:
        parts = ", ".join(f"{'step()' if k == 'step' else k} {us / 1e3:.3f} ms"
                          for k, us in s.train_median_us)
        lines.append(f"training loop     {s.train_steps} steps; medians on the training"
                     f" thread: {parts}")
    if s.offload_d2h_bytes is not None:
        lines.append(f"full offload      {fmt_bytes(s.offload_d2h_bytes)} of gradients to"
                     f" the host per micro-step (median); host time: fold "
                     f"{s.offload_fold_us / 1e3:.3f} ms, step "
                     f"{s.offload_step_us / 1e3:.3f} ms (totals)")
    if s.offload_drain_us is not None:
        lines.append(f"exposed drain     {s.offload_drain_us / 1e3:.3f} ms (median): from a"
                     " step's final backward's end to its last fold's end")
    lines.append("lane busy (share of the makespan each lane ran a task)")
    for lane, busy_pct in s.lane_busy_pct:
        lines.append(f"  {lane:<15} {busy_pct:6.1f} %")
    if s.longest:
        lines.append("longest tasks")
        for name, lane, dur in s.longest:
            lines.append(f"  {dur / 1e3:9.3f} ms  {lane:<10} {name}")
    return "\n".join(lines)
