"""A step's figures from its trace (:func:`step_stats`), and the hooks that get them.

The figures are a value (:class:`pipeoff.trace.StepStats`); this room computes
them from the executions a step ran and hands them to the user's hooks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pipeoff.trace._records import GATE, HOOK_WAIT, MARKERS
from pipeoff.trace._stats import StepStats
from pipeoff.trace._trace import Trace

__all__ = ["StatsHooks", "SyncStats", "step_stats"]


def step_stats(trace: Trace, *, step: int, what: str, exposed_ns: int,
               committed: bool | None = None, also: Sequence[Trace] = ()) -> StepStats:
    """The :class:`StepStats` of ``trace`` (one step's or one sync's executions), with the
    tasks of ``also`` (the step's other executions: full offload's earlier micro-steps,
    whose gradient copies are the step's too)."""
    d2h = h2d = chunks = failed = 0
    copy = host = coll = wait = 0
    starts, ends = [], []
    for t in [t for tr in (*also, trace) for t in tr.tasks]:
        if t.kind == GATE or t.kind == HOOK_WAIT:
            wait += t.duration_ns
            continue
        if t.kind in MARKERS or t.status == "cancelled":
            continue
        starts.append(t.start_ns)
        ends.append(t.end_ns)
        failed += t.status == "failed"
        moved = t.nbytes if t.status == "ok" else 0  # a failed copy's bytes did not arrive
        base = t.name.rsplit("/", 1)[-1]
        if t.kind == "d2h":
            d2h += moved
            copy += t.duration_ns
        elif t.kind == "h2d":
            h2d += moved
            copy += t.duration_ns
        elif t.kind == "allreduce":
            coll += t.duration_ns
            chunks += what == "sync"
        else:
            host += t.duration_ns
            if what == "step" and (t.kind == "optimizer_chunk" or base.startswith("step:")):
                chunks += 1
    return StepStats(
        step=step, what=what, d2h_bytes=d2h, h2d_bytes=h2d, copy_ms=copy / 1e6,
        host_ms=host / 1e6, collective_ms=coll / 1e6, wait_ms=wait / 1e6, chunks=chunks,
        exposed_ms=exposed_ns / 1e6,
        makespan_ms=(max(ends) - min(starts)) / 1e6 if starts else 0.0,
        committed=committed, failed=failed,
        offload_fraction=trace.metadata.get("offload_fraction"))


class StatsHooks:
    """The callbacks that get every step's :class:`StepStats`."""

    def __init__(self) -> None:
        self._hooks: dict[int, Callable[[StepStats], None]] = {}
        self._next = 0

    def add(self, hook: Callable[[StepStats], None]) -> Any:
        """Register ``hook``; returns a handle whose ``remove()`` unregisters it."""
        if not callable(hook):
            from pipeoff._errors import ConfigError

            raise ConfigError(f"hook must be callable (it takes a StepStats), got {hook!r}")
        key = self._next
        self._next += 1
        self._hooks[key] = hook
        hooks = self._hooks

        class _Handle:
            def remove(self) -> None:
                hooks.pop(key, None)

        return _Handle()

    def __bool__(self) -> bool:
        return bool(self._hooks)

    def __call__(self, stats: StepStats) -> None:
        for hook in list(self._hooks.values()):
            hook(stats)


class SyncStats:
    """A sync's figures for LocalSGD and DiLoCo: ``last_sync_stats`` and the hooks that
    get every sync's."""

    def __init__(self) -> None:
        self.hooks = StatsHooks()
        self.last: StepStats | None = None
        self._pending: StepStats | None = None

    def done(self, trace: Trace | None, *, step: int, exposed_ns: int,
             committed: bool | None) -> None:
        """Record a finished sync (``trace`` ``None`` on torchft's own path: copies and
        collectives are not traced there); :meth:`emit` hands it to the hooks."""
        self.last = step_stats(trace if trace is not None else Trace(tasks=()), step=step,
                               what="sync", exposed_ns=exposed_ns, committed=committed)
        self._pending = self.last

    def emit(self) -> None:
        """Hand the recorded sync's figures to the hooks, once. Called when the sync's
        bookkeeping is over (torchft's step counter reset, the masters refreshed), so
        that a hook that raises reaches the caller without leaving that undone."""
        stats, self._pending = self._pending, None
        if stats is not None and self.hooks:
            self.hooks(stats)
