"""Recording every execution in a region of code into one trace."""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeoff import _dist
from pipeoff.trace._records import hook_wait_record, train_record
from pipeoff.trace._trace import BufferRecord, TaskRecord, Trace

if TYPE_CHECKING:
    from pipeoff.execution import Execution

__all__ = ["Recorder", "active", "record", "record_hook_wait", "record_train_span"]

_lock = threading.Lock()
_active: list[Recorder] = []

RECORD_WAIT_S = 60.0
"""How long a recorder waits, in all, for the executions it saw to finish."""


def active() -> bool:
    """Whether any recorder is on (a plain list check: free when off)."""
    return bool(_active)


class Recorder:
    """Collects the executions launched while it is active, and hook waits.

    Use it through :func:`record`. Each execution keeps its own timestamps;
    the recorder shifts them onto its own origin when it builds :attr:`trace`.
    """

    def __init__(self, metadata: dict[str, Any] | None = None) -> None:
        self.origin_ns = time.perf_counter_ns()
        self.origin_unix_ns = time.time_ns()
        self.metadata = dict(metadata or {})
        self._executions: list[tuple[int, Execution]] = []
        self._spans: list[TaskRecord] = []
        self._trace: Trace | None = None
        self._lock = threading.Lock()

    def add_execution(self, execution: Execution) -> None:
        with self._lock:
            self._executions.append((len(self._executions), execution))

    def add_hook_wait(self, name: str, start_ns: int, end_ns: int, rank: int = 0) -> None:
        """Record that a forward hook blocked from ``start_ns`` to ``end_ns`` (perf_counter_ns)."""
        with self._lock:
            self._spans.append(hook_wait_record(name, start_ns, end_ns,
                                                origin_ns=self.origin_ns, rank=rank))

    def add_train_span(self, what: str, step: int, start_ns: int, end_ns: int,
                       rank: int = 0) -> None:
        """Record the training thread's ``what`` for step ``step`` (perf_counter_ns)."""
        with self._lock:
            self._spans.append(train_record(what, step, start_ns, end_ns,
                                            origin_ns=self.origin_ns, rank=rank))

    @property
    def trace(self) -> Trace:
        """All recorded executions (waited for) and hook waits, on one timeline."""
        if self._trace is None:
            self._trace = self._build()
        return self._trace

    def _build(self) -> Trace:
        # Imported here: the front door (pipeoff._lowlevel) re-exports this room's
        # instruments, and importing its execution readers at the top would import
        # the front door's package first, which imports this room.
        from pipeoff._lowlevel import _execution as _lowlevel

        tasks: list[TaskRecord] = []
        buffers: list[BufferRecord] = []
        budgets: dict[str, int | None] = {"device": None, "host": None}
        rank = 0
        deadline = time.monotonic() + RECORD_WAIT_S
        for k, ex in self._executions:
            # Waits for the execution; never raises a task's exception.
            # An execution waiting on a gate can only finish when code after the
            # region opens it: do not wait for that here.
            gated = bool(_lowlevel.pending(ex)[1])
            tr = _lowlevel.shifted_trace(ex, f"x{k}/", ex.origin_ns - self.origin_ns, k,
                                         deadline=time.monotonic() if gated else deadline)
            if tr is None:
                tasks_left, gates_left = _lowlevel.pending(ex)
                warnings.warn(
                    f"pipeoff.trace.record: execution {k} had not finished when the trace was "
                    f"built ({len(tasks_left)} task(s) pending"
                    + (f"; gate(s) never opened: {', '.join(map(repr, gates_left[:8]))}"
                       if gates_left else "")
                    + "); it is left out of the trace", RuntimeWarning, stacklevel=3)
                continue
            rank = tr.metadata.get("rank", rank)
            tasks.extend(tr.tasks)
            buffers.extend(tr.buffers)
            for w in ("device", "host"):
                cap = tr.device_budget_bytes if w == "device" else tr.host_budget_bytes
                if cap is not None:
                    budgets[w] = max(budgets[w] or 0, cap)
        tasks.extend(self._spans)
        meta = {"rank": rank, "origin_unix_ns": self.origin_unix_ns,
                "executions": len(self._executions), **self.metadata}
        return Trace(tasks=tuple(tasks), buffers=tuple(buffers),
                     device_budget_bytes=budgets["device"], host_budget_bytes=budgets["host"],
                     metadata=meta)


@contextmanager
def record(path: str | Path | None = None, **metadata: Any) -> Iterator[Recorder]:
    """Capture every execution launched inside the ``with`` block into one trace.

    Optimizer steps, LocalSGD syncs and forward-hook waits all land in it.
    On exit the recorder waits for the executions it saw (failed ones too,
    without raising) and, if ``path`` is given, saves the trace there.

    Args:
        path: where to write the Chrome trace JSON, or ``None`` to keep it in memory.
        **metadata: extra facts stored in the trace (``replica_id=...``).

    Example::

        with pipeoff.trace.record("run.json") as rec:
            train_steps()
        print(rec.trace.summary().format())
    """
    rec = Recorder(metadata)
    with _lock:
        _active.append(rec)
    try:
        yield rec
    finally:
        with _lock:
            _active.remove(rec)
    if path is not None:
        rec.trace.save(path)


def on_execution(execution: Execution) -> None:
    """Called by :func:`pipeoff.execute` for every launch while recording is on."""
    for rec in list(_active):
        rec.add_execution(execution)


def record_hook_wait(name: str, start_ns: int, end_ns: int) -> None:
    """Tell the active recorders that a forward hook blocked (``perf_counter_ns`` times)."""
    if not _active:
        return
    for rec in list(_active):
        rec.add_hook_wait(name, start_ns, end_ns, rank=_dist.rank())


def record_train_span(what: str, step: int, start_ns: int, end_ns: int) -> None:
    """Tell the active recorders about the training thread's ``what`` (``"forward"``,
    ``"backward"``, ``"step"``, ``"sync"``) of step ``step`` (``perf_counter_ns``)."""
    if not _active:
        return
    rank = _dist.rank()
    for rec in list(_active):
        rec.add_train_span(what, step, start_ns, end_ns, rank=rank)
