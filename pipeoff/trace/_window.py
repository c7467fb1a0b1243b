"""Which steps of a recorded region its trace keeps: torch.profiler's schedule, for pipeoff."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipeoff._validate import check_int

__all__ = ["RecordWindow", "keeps_step"]


@dataclass(frozen=True, kw_only=True, slots=True)
class RecordWindow:
    """The steps a recorded region keeps (``record(window=...)``), with
    ``torch.profiler.schedule``'s semantics.

    Steps are numbered from 0, the first step the region sees. The first
    ``skip_first`` are skipped; then cycles of ``wait`` steps skipped, ``warmup``
    steps skipped too (they warm the run up: native builds, pools, caches) and
    ``active`` steps recorded, ``repeat`` times (0: until the region ends).
    Only the recorded steps' executions, forward-hook waits and training-loop
    spans are kept, so a region's memory grows with the steps it records, not
    with those it runs (``pipeoff.trace.record(max_steps=...)`` bounds that too).

    Example: ``RecordWindow(wait=1, warmup=1, active=2, repeat=1)`` keeps steps 2
    and 3 and nothing after them.
    """

    wait: int = 0
    """Steps skipped at the start of each cycle."""
    warmup: int = 0
    """Steps skipped after the wait, before the recorded ones (as torch.profiler's
    warm-up steps, whose events it discards)."""
    active: int
    """Steps recorded in each cycle (at least 1)."""
    repeat: int = 0
    """Cycles; 0 repeats them until the region ends."""
    skip_first: int = 0
    """Steps skipped once, before the first cycle."""

    def __post_init__(self) -> None:
        for name in ("wait", "warmup", "repeat", "skip_first"):
            check_int(f"RecordWindow.{name}", getattr(self, name), minimum=0)
        check_int("RecordWindow.active", self.active)

    @property
    def cycle(self) -> int:
        """Steps in one cycle: ``wait + warmup + active``."""
        return self.wait + self.warmup + self.active

    def records(self, step: int) -> bool:
        """Whether step ``step`` (from 0) is recorded."""
        if step < self.skip_first:
            return False
        step -= self.skip_first
        if self.repeat and step // self.cycle >= self.repeat:
            return False
        return step % self.cycle >= self.wait + self.warmup

    def finished(self, step: int) -> bool:
        """Whether no step from ``step`` on is recorded."""
        return bool(self.repeat) and step >= self.skip_first + self.repeat * self.cycle


def keeps_step(schedule: RecordWindow | Callable[[int], Any] | None, step: int) -> bool:
    """Whether ``schedule`` records step ``step``: a :class:`RecordWindow`, a
    ``torch.profiler.schedule(...)`` (its ``RECORD`` and ``RECORD_AND_SAVE``
    actions record), or ``None`` (every step)."""
    if schedule is None:
        return True
    if isinstance(schedule, RecordWindow):
        return schedule.records(step)
    action = schedule(step)
    return getattr(action, "name", action) in ("RECORD", "RECORD_AND_SAVE")
