"""Traces: what each task did, on which lane, when, and the staging it held.

This package holds values (task and buffer records, :class:`Trace`, its summary,
Chrome I/O, plots, :class:`StepStats`). The instruments that record them live
in :mod:`pipeoff.recording`; :class:`Recorder`, :func:`record` and
:func:`record_hook_wait` are re-exported here, loaded on first use, so that
importing the values imports no instrument.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipeoff.trace._stats import StepStats
from pipeoff.trace._trace import BufferRecord, TaskRecord, Trace, TraceSummary
from pipeoff.trace._window import RecordWindow

if TYPE_CHECKING:
    from pipeoff.recording import Recorder, record, record_hook_wait

__all__ = [
    "BufferRecord",
    "RecordWindow",
    "Recorder",
    "StepStats",
    "TaskRecord",
    "Trace",
    "TraceSummary",
    "record",
    "record_hook_wait",
]

_INSTRUMENTS = ("Recorder", "record", "record_hook_wait")


def __getattr__(name: str) -> Any:
    if name in _INSTRUMENTS:
        from pipeoff import recording

        return getattr(recording, name)
    raise AttributeError(f"module 'pipeoff.trace' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_INSTRUMENTS})
