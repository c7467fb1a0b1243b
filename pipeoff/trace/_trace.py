"""Trace records of executions and their analysis (makespan, critical path, staging)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

__all__ = ["HOOK_WAIT", "BufferRecord", "TaskRecord", "Trace", "TraceSummary", "fmt_bytes"]

Status = Literal["ok", "failed", "cancelled"]


@dataclass(frozen=True, kw_only=True, slots=True)
class TaskRecord:
    """What one task did. Times are nanoseconds from the trace's origin."""

    name: str
    """The task's name."""
    kind: str
    """The :class:`~pipeoff.TaskKind` value, e.g. ``"d2h"``."""
    lane: str
    """The lane it ran on."""
    start_ns: int
    """When it started (a CUDA event on GPU lanes, a monotonic clock on host)."""
    end_ns: int
    """When it ended; equal to ``start_ns`` for a cancelled task."""
    enqueue_ns: int = 0
    """When the host issued it."""
    nbytes: int = 0
    """Bytes moved or computed on."""
    deps: tuple[str, ...] = ()
    """The tasks it depended on."""
    buffers: tuple[str, ...] = ()
    """The staging buffers it used."""
    status: Status = "ok"
    """``"ok"``, ``"failed"`` (it raised), or ``"cancelled"`` (it never ran)."""
    rank: int = 0
    """The process's rank when recorded."""

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


@dataclass(frozen=True, kw_only=True, slots=True)
class BufferRecord:
    """A staging buffer of a traced execution."""

    name: str
    nbytes: int
    where: str
    """``"device"`` or ``"host"``."""
    rank: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class TraceSummary:
    """The headline figures of a trace. Times are microseconds."""

    makespan_us: float
    """From the first task's start to the last task's end."""
    critical_path_us: float
    """A lower bound on the makespan for these task durations: the longer of the
    longest dependency chain and the busiest lane's total busy time."""
    efficiency: float
    """``critical_path_us / makespan_us``; 1.0 means nothing could go faster."""
    lane_busy_us: tuple[tuple[str, float], ...]
    """Per lane, the time some task of it was running."""
    peak_device_staging_bytes: int
    """The high-water mark of live device staging."""
    peak_host_staging_bytes: int
    """The high-water mark of live host staging."""
    device_budget_bytes: int | None
    host_budget_bytes: int | None
    tasks: int
    """Tasks recorded."""
    failed: int
    """Tasks that raised."""
    cancelled: int
    """Tasks that never ran because another one failed."""
    comm_overlap_pct: float | None = None
    """Share of the time collectives ran during which a copy or compute task ran
    too (HTA's communication/computation overlap); ``None`` without collectives."""
    copy_overlap_pct: float | None = None
    """Share of the time copies ran during which compute or a collective ran too."""
    hook_waits: int = 0
    """How many times a forward hook blocked on the step in flight."""
    hook_wait_total_us: float = 0.0
    """Their total blocked time."""
    hook_wait_max_us: float = 0.0
    """The longest single blocked time."""
    longest: tuple[tuple[str, str, float], ...] = ()
    """The 10 longest tasks as ``(name, lane, duration_us)``."""

    @property
    def lane_busy_pct(self) -> tuple[tuple[str, float], ...]:
        m = self.makespan_us
        return tuple((lane, 100.0 * b / m if m else 0.0) for lane, b in self.lane_busy_us)

    def to_dict(self) -> dict[str, Any]:
        return {
            "makespan_us": self.makespan_us,
            "critical_path_us": self.critical_path_us,
            "efficiency": self.efficiency,
            "lane_busy_us": dict(self.lane_busy_us),
            "lane_busy_pct": dict(self.lane_busy_pct),
            "peak_device_staging_bytes": self.peak_device_staging_bytes,
            "peak_host_staging_bytes": self.peak_host_staging_bytes,
            "device_budget_bytes": self.device_budget_bytes,
            "host_budget_bytes": self.host_budget_bytes,
            "tasks": self.tasks,
            "failed": self.failed,
            "cancelled": self.cancelled,
            "comm_overlap_pct": self.comm_overlap_pct,
            "copy_overlap_pct": self.copy_overlap_pct,
            "hook_waits": self.hook_waits,
            "hook_wait_total_us": self.hook_wait_total_us,
            "hook_wait_max_us": self.hook_wait_max_us,
            "longest": [list(x) for x in self.longest],
        }

    def format(self) -> str:
        """A plain-text table of the summary."""

        def pct(x: float | None) -> str:
            return "n/a" if x is None else f"{x:.1f} %"

        lines = [
            f"tasks             {self.tasks} ({self.failed} failed, {self.cancelled} cancelled)",
            f"makespan          {self.makespan_us / 1e3:.3f} ms",
            f"critical path     {self.critical_path_us / 1e3:.3f} ms (lower bound)",
            f"efficiency        {self.efficiency:.2f}",
            f"comm overlap      {pct(self.comm_overlap_pct)} of collective time under copies"
            " or compute",
            f"copy overlap      {pct(self.copy_overlap_pct)} of copy time under compute or"
            " collectives",
            f"device staging    peak {fmt_bytes(self.peak_device_staging_bytes)}"
            f" / budget {fmt_bytes(self.device_budget_bytes)}",
            f"host staging      peak {fmt_bytes(self.peak_host_staging_bytes)}"
            f" / budget {fmt_bytes(self.host_budget_bytes)}",
            f"hook waits        {self.hook_waits}, total {self.hook_wait_total_us / 1e3:.3f} ms,"
            f" worst {self.hook_wait_max_us / 1e3:.3f} ms",
            "lane busy",
        ]
        for lane, busy_pct in self.lane_busy_pct:
            lines.append(f"  {lane:<15} {busy_pct:6.1f} %")
        if self.longest:
            lines.append("longest tasks")
            for name, lane, dur in self.longest:
                lines.append(f"  {dur / 1e3:9.3f} ms  {lane:<10} {name}")
        return "\n".join(lines)


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


HOOK_WAIT = "hook_wait"
"""The ``kind`` of records that time a forward hook blocked on a step in flight."""
_COPIES = ("d2h", "h2d")
_COMPUTE = ("optimizer_chunk",)
_COMM = ("allreduce",)


@dataclass(frozen=True, kw_only=True, slots=True)
class Trace:
    """The record of one or more executions: tasks, staging buffers and budgets."""

    tasks: tuple[TaskRecord, ...]
    """One record per task, in issue order."""
    buffers: tuple[BufferRecord, ...] = ()
    """The staging buffers the tasks used."""
    device_budget_bytes: int | None = None
    host_budget_bytes: int | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)
    """Free-form facts: backend, schedule, rank, wall-clock origin (``origin_unix_ns``)."""

    # -- analysis -----------------------------------------------------------
    def _ran(self) -> list[TaskRecord]:
        return [t for t in self.tasks if t.status != "cancelled" and t.kind != HOOK_WAIT]

    def _union(self, kinds: tuple[str, ...]) -> list[tuple[int, int]]:
        return _merge([(t.start_ns, t.end_ns) for t in self._ran() if t.kind in kinds])

    def overlap_pct(self, kinds: tuple[str, ...], others: tuple[str, ...]) -> float | None:
        """Share (%) of the time tasks of ``kinds`` ran during which ``others`` ran too."""
        mine = self._union(kinds)
        total = sum(e - s for s, e in mine)
        if not total:
            return None
        return 100.0 * _intersection(mine, self._union(others)) / total

    def makespan_ns(self) -> int:
        ran = self._ran()
        if not ran:
            return 0
        return max(t.end_ns for t in ran) - min(t.start_ns for t in ran)

    def lane_busy_ns(self) -> dict[str, int]:
        """Per lane, the union of its tasks' intervals.

        A trace of several ranks (:meth:`merge`) has a lane per rank, named
        ``"r<rank>:<lane>"``.
        """
        ran = self._ran()
        many = len({t.rank for t in ran}) > 1
        by_lane: dict[str, list[tuple[int, int]]] = {}
        for t in ran:
            lane = f"r{t.rank}:{t.lane}" if many else t.lane
            by_lane.setdefault(lane, []).append((t.start_ns, t.end_ns))
        return {lane: _union_length(iv) for lane, iv in by_lane.items()}

    def critical_path_ns(self) -> int:
        """A lower bound on the makespan for these task durations.

        The longer of: the longest dependency chain, where a task also cannot
        start before the host issued it (its ``enqueue_ns``, which orders
        executions launched one after another); and the busiest lane.
        """
        ran = self._ran()
        if not ran:
            return 0
        origin = min(t.start_ns for t in ran)
        # Keyed by rank too: the ranks of a merged trace run the same task names.
        finish: dict[tuple[int, str], int] = {}
        for t in self.tasks:  # records are in issue order, a topological order
            if t.kind == HOOK_WAIT:
                continue
            release = max(t.enqueue_ns - origin, 0)
            before = max((finish.get((t.rank, d), 0) for d in t.deps), default=0)
            finish[(t.rank, t.name)] = max(release, before) + (
                t.duration_ns if t.status != "cancelled" else 0)
        chain = max(finish.values(), default=0)
        return max(chain, max(self.lane_busy_ns().values(), default=0))

    def staging_timeline(self) -> list[tuple[int, int, int]]:
        """``(time_ns, device_bytes, host_bytes)`` after each change of live staging.

        A buffer is live from its first user's start to its last user's end.
        """
        spans: dict[tuple[int, str], list[int]] = {}
        for t in self.tasks:
            for b in t.buffers:
                span = spans.setdefault((t.rank, b), [t.start_ns, t.end_ns])
                span[0] = min(span[0], t.start_ns)
                span[1] = max(span[1], t.end_ns)
        sizes = {(b.rank, b.name): b for b in self.buffers}
        changes: list[tuple[int, int, str, int]] = []  # (time, order, where, delta)
        for key, (s, e) in spans.items():
            spec = sizes.get(key)
            if spec is None:
                continue
            changes.append((s, 1, spec.where, spec.nbytes))
            changes.append((e, 0, spec.where, -spec.nbytes))  # releases sort first
        changes.sort()
        live = {"device": 0, "host": 0}
        out: list[tuple[int, int, int]] = []
        for time_ns, _, where, delta in changes:
            live[where] += delta
            out.append((time_ns, live["device"], live["host"]))
        return out

    def peak_staging_bytes(self) -> dict[str, int]:
        peak = {"device": 0, "host": 0}
        for _, dev, host in self.staging_timeline():
            peak["device"] = max(peak["device"], dev)
            peak["host"] = max(peak["host"], host)
        return peak

    def summary(self) -> TraceSummary:
        """The headline figures of this trace."""
        makespan = self.makespan_ns()
        crit = self.critical_path_ns()
        peak = self.peak_staging_bytes()
        busy = self.lane_busy_ns()
        waits = [t.duration_ns for t in self.tasks if t.kind == HOOK_WAIT]
        ran = sorted(self._ran(), key=lambda t: -t.duration_ns)[:10]
        return TraceSummary(
            makespan_us=makespan / 1e3,
            critical_path_us=crit / 1e3,
            efficiency=min(1.0, crit / makespan) if makespan else 1.0,
            lane_busy_us=tuple((lane, b / 1e3) for lane, b in busy.items()),
            peak_device_staging_bytes=peak["device"],
            peak_host_staging_bytes=peak["host"],
            device_budget_bytes=self.device_budget_bytes,
            host_budget_bytes=self.host_budget_bytes,
            tasks=sum(t.kind != HOOK_WAIT for t in self.tasks),
            failed=sum(t.status == "failed" for t in self.tasks),
            cancelled=sum(t.status == "cancelled" for t in self.tasks),
            comm_overlap_pct=self.overlap_pct(_COMM, _COPIES + _COMPUTE),
            copy_overlap_pct=self.overlap_pct(_COPIES, _COMPUTE + _COMM),
            hook_waits=len(waits),
            hook_wait_total_us=sum(waits) / 1e3,
            hook_wait_max_us=max(waits, default=0) / 1e3,
            longest=tuple((t.name, t.lane, t.duration_ns / 1e3) for t in ran),
        )

    # -- files --------------------------------------------------------------
    def to_chrome(self) -> dict[str, Any]:
        """This trace as a Chrome trace JSON object (what :meth:`save` writes)."""
        from pipeoff.trace._chrome import to_chrome

        return to_chrome(self)

    def save(self, path: str | Path) -> Path:
        """Write Chrome trace JSON that Perfetto and ``chrome://tracing`` open."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_chrome()))
        return path

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        """Read a trace written by :meth:`save`.

        Raises:
            TraceFormatError: the file is not JSON or not a pipeoff trace.
            FileNotFoundError: the file does not exist.
        """
        from pipeoff.trace._chrome import from_chrome, read_json

        return from_chrome(read_json(path), source=str(path))

    @classmethod
    def merge(cls, traces: Iterable[Trace], metadata: Mapping[str, Any] | None = None) -> Trace:
        """One trace holding the tasks and buffers of several (times must share an origin)."""
        traces = list(traces)
        if not traces:
            return cls(tasks=(), metadata=dict(metadata or {}))
        return cls(
            tasks=tuple(t for tr in traces for t in tr.tasks),
            buffers=tuple(b for tr in traces for b in tr.buffers),
            device_budget_bytes=traces[0].device_budget_bytes,
            host_budget_bytes=traces[0].host_budget_bytes,
            metadata=dict(metadata or traces[0].metadata),
        )


def _merge(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, disjoint intervals covering the same time."""
    out: list[tuple[int, int]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def _union_length(intervals: list[tuple[int, int]]) -> int:
    return sum(e - s for s, e in _merge(intervals))


def _intersection(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> int:
    """Length of the intersection of two sorted disjoint interval lists."""
    i = j = total = 0
    while i < len(a) and j < len(b):
        lo = max(a[i][0], b[j][0])
        hi = min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total
