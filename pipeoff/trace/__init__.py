"""Traces: what each task did, on which lane, when, and the staging it held."""

from __future__ import annotations

from pipeoff.trace._record import Recorder, record, record_hook_wait
from pipeoff.trace._stats import StepStats
from pipeoff.trace._trace import BufferRecord, TaskRecord, Trace, TraceSummary

__all__ = [
    "BufferRecord",
    "Recorder",
    "StepStats",
    "TaskRecord",
    "Trace",
    "TraceSummary",
    "record",
    "record_hook_wait",
]
