"""Recording every execution in a region of code into one trace."""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeoff import _dist
from pipeoff._errors import ConfigError
from pipeoff._validate import check_int
from pipeoff.trace._records import hook_wait_record, train_record
from pipeoff.trace._trace import BufferRecord, TaskRecord, Trace
from pipeoff.trace._window import RecordWindow, keeps_step

if TYPE_CHECKING:
    from pipeoff.execution import Execution

__all__ = ["Recorder", "active", "enter_step", "record", "record_hook_wait",
           "record_train_span"]

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

    Steps: the region numbers the steps it sees from 0. A step is the step number
    the training-loop spans carry (``forward N``, ``step N``, ``sync N``: one
    optimizer ``step()`` and the forwards, backwards and syncs that go with it; the
    syncs alone where only they are seen, LocalSGD over a plain torch optimizer). A
    new number starts the next step, when its first span begins; executions, hook
    waits and spans belong to the step under way. :meth:`step` counts by hand
    instead, as ``torch.profiler.profile.step()``.
    """

    def __init__(self, metadata: dict[str, Any] | None = None, *,
                 window: RecordWindow | Callable[[int], Any] | None = None,
                 max_steps: int | None = None) -> None:
        if window is not None and not callable(window) and not isinstance(
                window, RecordWindow):
            raise ConfigError("window must be a pipeoff.trace.RecordWindow or a "
                              f"torch.profiler.schedule(...), got {window!r}")
        self.max_steps = check_int("max_steps", max_steps, optional=True)
        self.window = window
        """Which steps are kept (``None``: all)."""
        self.origin_ns = time.perf_counter_ns()
        self.origin_unix_ns = time.time_ns()
        self.metadata = dict(metadata or {})
        # Kept items, each with its step (the region's number): (step, number, execution)
        # and (step, record). Written under _lock by the threads that launch and wait.
        self._executions: list[tuple[int, int, Execution]] = []
        self._spans: list[tuple[int, TaskRecord]] = []
        self._launched = 0  # executions seen, kept or not (their numbers)
        # Step counting (the training thread's): the step under way, the span number
        # that started it, recent span numbers' steps, and the steps kept so far.
        self._step = 0
        self._label: int | None = None
        self._label_step: dict[int, int] = {}
        self._manual = False
        self._recorded: list[int] = [0] if keeps_step(window, 0) else []
        """The steps kept so far, in order (with a window or ``max_steps`` only)."""
        self._trace: Trace | None = None
        self._lock = threading.Lock()

    @property
    def steps_seen(self) -> int:
        """Steps the region has seen so far (the one under way included)."""
        return self._step + 1

    def step(self) -> None:
        """Start the next step by hand (``torch.profiler.profile.step()``): call it at the
        end of each iteration. Once it is called the spans' numbers count nothing:
        everything before the first call is step 0."""
        with self._lock:
            if not self._manual:
                # Everything before the first call is step 0, whatever the spans said.
                self._manual = True
                self._step = 0
                self._recorded = [0] if keeps_step(self.window, 0) else []
                keep = keeps_step(self.window, 0)
                self._executions = [(0, n, ex) for _, n, ex in self._executions if keep]
                self._spans = [(0, sp) for _, sp in self._spans if keep]
            self._advance()

    def enter_step(self, label: int) -> None:
        """A training-loop span of step number ``label`` begins (see the class docstring)."""
        with self._lock:
            if self._manual or label == self._label:
                return
            if self._label is not None:
                self._advance()
            self._label = label
            self._label_step[label] = self._step
            if len(self._label_step) > 8:  # only recent numbers are looked up
                del self._label_step[next(iter(self._label_step))]

    def _advance(self) -> None:
        self._step += 1
        if (self.window is None and self.max_steps is None) or not keeps_step(
                self.window, self._step):
            return  # (without a window nothing is dropped: no list of steps kept)
        self._recorded.append(self._step)
        if self.max_steps is not None and len(self._recorded) > self.max_steps:
            gone = self._recorded.pop(0)  # the oldest kept step: memory stays bounded
            self._executions = [e for e in self._executions if e[0] != gone]
            self._spans = [sp for sp in self._spans if sp[0] != gone]

    def _kept(self, step: int) -> bool:
        """Whether step ``step``'s items are kept: the window records it and
        ``max_steps`` has not dropped it."""
        return keeps_step(self.window, step) and (
            self.max_steps is None or not self._recorded or step >= self._recorded[0])

    def add_execution(self, execution: Execution) -> None:
        with self._lock:
            number = self._launched
            self._launched += 1
            if self._kept(self._step):
                self._executions.append((self._step, number, execution))

    def add_hook_wait(self, name: str, start_ns: int, end_ns: int, rank: int = 0) -> None:
        """Record that a forward hook blocked from ``start_ns`` to ``end_ns`` (perf_counter_ns)."""
        with self._lock:
            if self._kept(self._step):
                self._spans.append((self._step, hook_wait_record(
                    name, start_ns, end_ns, origin_ns=self.origin_ns, rank=rank)))

    def add_train_span(self, what: str, step: int, start_ns: int, end_ns: int,
                       rank: int = 0) -> None:
        """Record the training thread's ``what`` for step ``step`` (perf_counter_ns)."""
        with self._lock:
            at = self._step if self._manual else self._label_step.get(step, self._step)
            if self._kept(at):
                self._spans.append((at, train_record(what, step, start_ns, end_ns,
                                                     origin_ns=self.origin_ns, rank=rank)))

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
        backends: set[str] = set()
        deadline = time.monotonic() + RECORD_WAIT_S
        for _, k, ex in self._executions:
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
            backends.add(str(tr.metadata.get("backend")))
            tasks.extend(tr.tasks)
            buffers.extend(tr.buffers)
            for w in ("device", "host"):
                cap = tr.device_budget_bytes if w == "device" else tr.host_budget_bytes
                if cap is not None:
                    budgets[w] = max(budgets[w] or 0, cap)
        tasks.extend(sp for _, sp in self._spans)
        meta: dict[str, Any] = {"rank": rank, "origin_unix_ns": self.origin_unix_ns,
                                "executions": len(self._executions)}
        if backends:  # a recorded simulation stays marked as a prediction
            if backends == {"sim"}:
                meta["backend"] = "sim"
            elif "sim" in backends:
                meta["predicted"] = True
        if self.window is not None or self.max_steps is not None:
            meta["steps_seen"] = self.steps_seen
            meta["steps_recorded"] = list(self._recorded)
        meta.update(self.metadata)
        return Trace(tasks=tuple(tasks), buffers=tuple(buffers),
                     device_budget_bytes=budgets["device"], host_budget_bytes=budgets["host"],
                     metadata=meta)


@contextmanager
def record(path: str | Path | None = None, *,
           window: RecordWindow | Callable[[int], Any] | None = None,
           max_steps: int | None = None, **metadata: Any) -> Iterator[Recorder]:
    """Capture every execution launched inside the ``with`` block into one trace.

    Optimizer steps, LocalSGD syncs and forward-hook waits all land in it.
    On exit the recorder waits for the executions it saw (failed ones too,
    without raising) and, if ``path`` is given, saves the trace there.

    Memory: the region keeps every execution it records (its task records and
    bookkeeping, a few hundred bytes a task) until the trace is built, so an
    unbounded region over a long run grows with it. ``window`` keeps only some
    steps, as ``torch.profiler.schedule`` does, and ``max_steps`` only the latest
    ones; what neither keeps is dropped as it happens. Steps are the region's own,
    from 0 (see :class:`Recorder`: a pipeoff optimizer's ``step()`` and its forward,
    backward and syncs; or :meth:`Recorder.step`, called by hand).

    Args:
        path: where to write the Chrome trace JSON, or ``None`` to keep it in memory.
        window: which steps to keep: a :class:`~pipeoff.trace.RecordWindow`
            (``wait``, ``warmup``, ``active``, ``repeat``, ``skip_first``) or a
            ``torch.profiler.schedule(...)``; ``None`` keeps every step. (Not
            ``schedule=``: that keyword is metadata, as every other one.)
        max_steps: keep at most this many recorded steps, the latest (``None``: all).
        **metadata: extra facts stored in the trace (``replica_id=...``).

    Raises:
        ConfigError: ``window`` is not a schedule, or ``max_steps`` not a positive int.

    Example::

        with pipeoff.trace.record("run.json") as rec:
            train_steps()
        print(rec.trace.summary().format())

        # Steps 2 and 3 only (after one step of wait and one of warm-up):
        window = pipeoff.trace.RecordWindow(wait=1, warmup=1, active=2, repeat=1)
        with pipeoff.trace.record(window=window) as rec:
            train_steps()
    """
    rec = Recorder(metadata, window=window, max_steps=max_steps)
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


def enter_step(step: int) -> None:
    """Tell the active recorders that a training-loop span of step ``step`` begins (a
    forward, ``step()``, a sync): a new number starts a recorded region's next step."""
    if not _active:
        return
    for rec in list(_active):
        rec.enter_step(step)


def record_train_span(what: str, step: int, start_ns: int, end_ns: int) -> None:
    """Tell the active recorders about the training thread's ``what`` (``"forward"``,
    ``"backward"``, ``"step"``, ``"sync"``) of step ``step`` (``perf_counter_ns``)."""
    if not _active:
        return
    rank = _dist.rank()
    for rec in list(_active):
        rec.add_train_span(what, step, start_ns, end_ns, rank=rank)
