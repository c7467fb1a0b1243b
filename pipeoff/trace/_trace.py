"""Trace records of executions and their analysis (makespan, critical path, staging)."""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeoff.trace import _chrome
from pipeoff.trace._format import fmt_bytes
from pipeoff.trace._records import (
    COMM_KINDS,
    COMPUTE_KINDS,
    COPY_KINDS,
    GATE,
    HOOK_WAIT,
    MARKERS,
    TRAIN,
    BufferRecord,
    TaskRecord,
    gate_meaning,
    staging_timeline,
    train_step,
)

__all__ = ["GATE", "HOOK_WAIT", "TRAIN", "BufferRecord", "TaskRecord", "Trace", "TraceSummary",
           "fmt_bytes", "gate_meaning"]


@dataclass(frozen=True, kw_only=True, slots=True)
class TraceSummary:
    """The headline figures of a trace. Times are microseconds."""

    makespan_us: float
    """From the first task's start to the last task's end."""
    critical_path_us: float
    """A lower bound on the makespan for these task durations: the longer of the
    longest dependency chain and the busiest lane's total busy time."""
    efficiency: float
    """``critical_path_us / makespan_us``, of pipeoff's lanes (not the training step): 1.0
    means no schedule of these tasks, given their dependencies, gates and issue times,
    finishes sooner. Lanes that mostly wait for their inputs (gates) can be at 1.0 while
    :attr:`busy_pct` is low: the inputs, not the schedule, set the pace."""
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
    """Share of the time collectives ran during which an optimizer (compute) task
    ran too: HTA's communication/computation overlap (``get_comm_comp_overlap``,
    which counts copies as memory kernels, not computation); ``None`` without
    collectives."""
    copy_overlap_pct: float | None = None
    """Share of the time copies ran during which compute or a collective ran too."""
    comm_hidden_pct: float | None = None
    """Share of the time collectives ran during which a copy *or* compute task ran:
    how much of the collectives other work hides (LocalSGD's all-reduces overlap
    copies, not compute); ``None`` without collectives."""
    hook_waits: int = 0
    """How many times a forward hook blocked on the step in flight."""
    hook_wait_total_us: float = 0.0
    """Their total blocked time."""
    hook_wait_max_us: float = 0.0
    """The longest single blocked time."""
    executions: int = 1
    """Executions in the trace (a recorded region has one per step or sync)."""
    execution_efficiency: tuple[float, float, float] | None = None
    """Min, median and max of the executions' own efficiencies (several only)."""
    execution_makespan_us: tuple[float, float, float] | None = None
    """Min, median and max of the executions' makespans (several only)."""
    busy_pct: float = 100.0
    """Share of the makespan during which some task ran on any of pipeoff's lanes; the
    rest is every lane idle: waiting for gates or for the host to issue work, and in a
    recorded region the training loop's own time between executions."""
    gates: int = 0
    """Gates (inputs from outside the executions) recorded."""
    gate_wait_total_us: float = 0.0
    """The time lanes waited for gates to open, summed over the gates."""
    gate_waits_by: tuple[tuple[str, int, float], ...] = ()
    """Per kind of input the gates stand for (:func:`gate_meaning`, named by the feature
    that built them: ``"gradients from the backward"``, ``"the quorum's commit decision
    (should_commit)"``), ``(meaning, gates, wait_us)``, longest wait first."""
    predicted_by: str | None = None
    """What predicted the trace's times when a simulation made it (``"pipeoff's simulator
    (h200_pcie5 cost model)"``); ``None`` for a measured trace."""
    longest: tuple[tuple[str, str, float], ...] = ()
    """The 10 longest tasks as ``(name, lane, duration_us)``."""
    train_steps: int = 0
    """Optimizer steps whose ``step()`` the training loop's spans recorded."""
    train_median_us: tuple[tuple[str, float], ...] = ()
    """Per kind of training-loop span (``forward``, ``backward``, ``step``, ``sync``),
    its median duration on the training thread."""
    offload_d2h_bytes: int | None = None
    """Full offload: bytes of gradients shipped to the host per execution (median);
    ``None`` for other traces."""
    offload_fold_us: float = 0.0
    """Full offload: time the host spent folding gradients into the sums (total)."""
    offload_step_us: float = 0.0
    """Full offload: time of the host step, chunks and norm (total)."""
    from_profiler: bool = False
    """The trace was read from a torch.profiler trace's ``pipeoff::`` ranges: it has no
    dependencies, issue times, executions or staging, so the figures built on them
    (critical path, efficiency, staging) are not known (``format()`` says n/a)."""
    offload_drain_us: float | None = None
    """Full offload with the training loop recorded: from the end of a step's final
    backward to the end of the last fold of its gradients (median over the steps): the
    gradient traffic the backward did not hide."""

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
            "comm_hidden_pct": self.comm_hidden_pct,
            "hook_waits": self.hook_waits,
            "hook_wait_total_us": self.hook_wait_total_us,
            "hook_wait_max_us": self.hook_wait_max_us,
            "executions": self.executions,
            "execution_efficiency": self.execution_efficiency,
            "execution_makespan_us": self.execution_makespan_us,
            "busy_pct": self.busy_pct,
            "gates": self.gates,
            "gate_wait_total_us": self.gate_wait_total_us,
            "gate_waits_by": [list(x) for x in self.gate_waits_by],
            "predicted": self.predicted_by is not None,
            "predicted_by": self.predicted_by,
            "longest": [list(x) for x in self.longest],
            "train_steps": self.train_steps,
            "train_median_us": dict(self.train_median_us),
            "offload_d2h_bytes": self.offload_d2h_bytes,
            "offload_fold_us": self.offload_fold_us,
            "offload_step_us": self.offload_step_us,
            "offload_drain_us": self.offload_drain_us,
        }

    def format(self) -> str:
        """A plain-text table of the summary: each line says what its figure is of, and a
        predicted trace's first line says so."""
        from pipeoff.trace._format import format_summary

        return format_summary(self)


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
    """Free-form facts: backend, schedule, rank, wall-clock origin (``origin_unix_ns``).
    ``backend: "sim"`` (or ``predicted: True``, for a recorded region with simulated
    executions) marks a prediction, and ``cost_model`` names its cost model; they
    survive :meth:`save` and :meth:`load` (see :attr:`predicted_by`)."""

    @property
    def predicted_by(self) -> str | None:
        """What predicted this trace's times (``"pipeoff's simulator (h200_pcie5 cost
        model)"``), or ``None`` when they were measured."""
        meta = self.metadata
        if meta.get("backend") != "sim" and meta.get("predicted") is not True:
            return None
        model = meta.get("cost_model")
        return "pipeoff's simulator" + (f" ({model} cost model)" if model else "")

    # -- analysis -----------------------------------------------------------
    def _ran(self) -> list[TaskRecord]:
        return [t for t in self.tasks if t.status != "cancelled" and t.kind not in MARKERS]

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
        opened = {(t.rank, t.name): t.end_ns - origin for t in self.tasks
                  if t.kind == GATE and t.status == "ok"}
        for t in self.tasks:  # records are in issue order, a topological order
            if t.kind in MARKERS:
                continue
            before = max((finish.get((t.rank, d), 0) for d in t.deps), default=0)
            if t.status == "cancelled":
                finish[(t.rank, t.name)] = before  # never ran: bounds nothing after it
                continue
            # A task cannot start before the host issued it, nor before its
            # gates opened (inputs from outside the execution).
            release = max([t.enqueue_ns - origin, 0,
                           *(opened.get((t.rank, g), 0) for g in t.gates)])
            finish[(t.rank, t.name)] = max(release, before) + t.duration_ns
        chain = max(finish.values(), default=0)
        return max(chain, max(self.lane_busy_ns().values(), default=0))

    def staging_timeline(self) -> list[tuple[int, int, int]]:
        """``(time_ns, device_bytes, host_bytes)`` after each change of live staging.

        A buffer is live from its first user's start to its last user's end.
        """
        return staging_timeline(self.tasks, self.buffers)

    def peak_staging_bytes(self) -> dict[str, int]:
        peak = {"device": 0, "host": 0}
        for _, dev, host in self.staging_timeline():
            peak["device"] = max(peak["device"], dev)
            peak["host"] = max(peak["host"], host)
        return peak

    def executions(self) -> dict[int, Trace]:
        """The trace of each execution in it, by index (one, 0, unless recorded)."""
        by: dict[int, list[TaskRecord]] = {}
        for t in self.tasks:
            by.setdefault(t.execution, []).append(t)
        return {k: Trace(tasks=tuple(ts), buffers=self.buffers,
                         device_budget_bytes=self.device_budget_bytes,
                         host_budget_bytes=self.host_budget_bytes, metadata=self.metadata)
                for k, ts in sorted(by.items())}

    def summary(self) -> TraceSummary:
        """The headline figures of this trace.

        For a trace of several executions (a recorded region), ``critical_path_us``
        is the sum of each execution's own bound and ``efficiency`` the sum of
        bounds over the sum of the executions' makespans: how close each came to
        its bound, time-weighted. Host time between executions counts in neither;
        ``busy_pct`` shows it, and ``execution_efficiency`` the spread.
        """
        makespan = self.makespan_ns()
        parts = [p for p in self.executions().values() if p._ran()]
        per = [(p.makespan_ns(), p.critical_path_ns()) for p in parts] if len(parts) > 1 else []
        if per:
            crit = sum(c for _, c in per)
            efficiency = min(1.0, crit / max(1, sum(m for m, _ in per)))
        else:
            crit = self.critical_path_ns()
            efficiency = min(1.0, crit / makespan) if makespan else 1.0
        ran_all = self._ran()
        busy_all = _union_length([(t.start_ns, t.end_ns) for t in ran_all])
        peak = self.peak_staging_bytes()
        busy = self.lane_busy_ns()
        waits = [t.duration_ns for t in self.tasks if t.kind == HOOK_WAIT]
        gates = [t.duration_ns for t in self.tasks if t.kind == GATE]
        by_meaning: dict[str, list[int]] = {}
        for t in self.tasks:
            if t.kind == GATE:
                by_meaning.setdefault(gate_meaning(t.name), []).append(t.duration_ns)
        ran = sorted(self._ran(), key=lambda t: -t.duration_ns)[:10]
        return TraceSummary(
            makespan_us=makespan / 1e3,
            critical_path_us=crit / 1e3,
            efficiency=efficiency,
            executions=max(1, len(parts)),
            execution_efficiency=_spread([min(1.0, c / m) if m else 1.0 for m, c in per]),
            execution_makespan_us=_spread([m / 1e3 for m, _ in per]),
            busy_pct=100.0 * busy_all / makespan if makespan else 100.0,
            lane_busy_us=tuple((lane, b / 1e3) for lane, b in busy.items()),
            peak_device_staging_bytes=peak["device"],
            peak_host_staging_bytes=peak["host"],
            device_budget_bytes=self.device_budget_bytes,
            host_budget_bytes=self.host_budget_bytes,
            tasks=sum(t.kind not in MARKERS for t in self.tasks),
            failed=sum(t.status == "failed" for t in self.tasks if t.kind not in MARKERS),
            cancelled=sum(t.status == "cancelled" for t in self.tasks
                          if t.kind not in MARKERS),
            comm_overlap_pct=self.overlap_pct(COMM_KINDS, COMPUTE_KINDS),
            comm_hidden_pct=self.overlap_pct(COMM_KINDS, COPY_KINDS + COMPUTE_KINDS),
            copy_overlap_pct=self.overlap_pct(COPY_KINDS, COMPUTE_KINDS + COMM_KINDS),
            hook_waits=len(waits),
            hook_wait_total_us=sum(waits) / 1e3,
            hook_wait_max_us=max(waits, default=0) / 1e3,
            longest=tuple((t.name, t.lane, t.duration_ns / 1e3) for t in ran),
            gates=len(gates),
            gate_wait_total_us=sum(gates) / 1e3,
            gate_waits_by=tuple(sorted(((m, len(w), sum(w) / 1e3) for m, w in by_meaning.items()),
                                       key=lambda x: (-x[2], x[0]))),
            predicted_by=self.predicted_by,
            from_profiler=self.metadata.get("source") == "torch.profiler",
            **self._train_figures(),
            **self._offload_figures(),
        )

    def _train_figures(self) -> dict[str, Any]:
        """The training loop's spans: steps, and the median of each kind."""
        by_kind: dict[str, list[int]] = {}
        steps: set[int] = set()
        for t in self.tasks:
            ts = train_step(t)
            if ts is None:
                continue
            by_kind.setdefault(ts[0], []).append(t.duration_ns)
            if ts[0] == "step":
                steps.add(ts[1])
        order = ["forward", "backward", "step", "prepare", "sync"]
        return {"train_steps": len(steps), "train_median_us": tuple(
            (k, statistics.median(by_kind[k]) / 1e3)
            for k in sorted(by_kind, key=lambda k: (order.index(k) if k in order else 9, k)))}

    def _offload_figures(self) -> dict[str, Any]:
        """Full offload's tasks (``d2h:i.j``, ``acc:i.j``, ``step:k``, ``norm``), when the
        trace has them: gradient bytes per execution, fold and host-step time."""
        d2h: dict[int, int] = {}
        fold = step = 0
        seen = False
        for t in self._ran():
            base = t.name.rsplit("/", 1)[-1]
            if base.startswith("acc:"):
                seen = True
                fold += t.duration_ns
            elif base.startswith("step:") or base in ("norm", "norm_allreduce"):
                step += t.duration_ns
            elif base.startswith("d2h:") and "." in base:
                d2h[t.execution] = d2h.get(t.execution, 0) + t.nbytes
        if not seen:
            return {}
        return {"offload_d2h_bytes": int(statistics.median(d2h.values())) if d2h else 0,
                "offload_fold_us": fold / 1e3, "offload_step_us": step / 1e3,
                "offload_drain_us": self._drain_us()}

    def _drain_us(self) -> float | None:
        """Median over the recorded steps of: the end of the last fold that ends after the
        step's final backward, minus that backward's end (``None`` without the
        training loop's spans)."""
        last_backward: dict[int, int] = {}
        forwards: list[int] = []
        for t in self.tasks:
            ts = train_step(t)
            if ts is not None and ts[0] == "backward":
                last_backward[ts[1]] = max(last_backward.get(ts[1], 0), t.end_ns)
            elif ts is not None and ts[0] == "forward":
                forwards.append(t.start_ns)
        if not last_backward:
            return None
        folds = [t.end_ns for t in self._ran() if t.name.rsplit("/", 1)[-1].startswith("acc:")]
        drains = []
        for b_end in sorted(last_backward.values()):
            # Up to the next forward: the folds after it are the next step's.
            nxt = min((f for f in forwards if f > b_end), default=None)
            after = [f for f in folds if f >= b_end and (nxt is None or f < nxt)]
            drains.append(max(after) - b_end if after else 0)
        return statistics.median(drains) / 1e3

    # -- files --------------------------------------------------------------
    def to_chrome(self) -> dict[str, Any]:
        """This trace as a Chrome trace JSON object (what :meth:`save` writes)."""
        return _chrome.to_chrome(self)

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
        source = str(path)
        fields = _chrome.from_chrome(_chrome.read_json(path), source=source)
        trace = cls(**fields)
        _chrome.check_readable(trace, source)
        return trace

    @classmethod
    def merge(cls, traces: Iterable[Trace], metadata: Mapping[str, Any] | None = None) -> Trace:
        """One trace holding the tasks and buffers of several (times must share an origin)."""
        traces = list(traces)
        if not traces:
            return cls(tasks=(), metadata=dict(metadata or {}))
        meta = dict(metadata or traces[0].metadata)
        if any(t.predicted_by is not None for t in traces) and not _marked(meta):
            meta["predicted"] = True  # a prediction stays marked as one
        return cls(
            tasks=tuple(t for tr in traces for t in tr.tasks),
            buffers=tuple(b for tr in traces for b in tr.buffers),
            device_budget_bytes=traces[0].device_budget_bytes,
            host_budget_bytes=traces[0].host_budget_bytes,
            metadata=meta,
        )


def _marked(meta: Mapping[str, Any]) -> bool:
    return meta.get("backend") == "sim" or meta.get("predicted") is True


def _spread(values: list[float]) -> tuple[float, float, float] | None:
    """Min, median and max, or ``None`` for no values."""
    if not values:
        return None
    s = sorted(values)
    return s[0], statistics.median(s), s[-1]


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
