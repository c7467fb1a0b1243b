"""Instruments: what records a run while it happens.

The recorder (:func:`record`, a region whose executions become one
:class:`pipeoff.trace.Trace`), the training thread's spans on the trace's
``train`` row (:func:`train_span`, :func:`install_train_hooks`) and the
per-step figures (:func:`step_stats`, :class:`StatsHooks`, :class:`SyncStats`).
These touch the runtime (every execution reports here) and the user's model
(hooks); the values they produce (records, traces, their summary, Chrome I/O,
plots, :class:`~pipeoff.trace.StepStats`) live in :mod:`pipeoff.trace`, which
imports nothing from here.

Users reach the recorder as ``pipeoff.trace.record``; features reach all of
this through the runtime's front door, :mod:`pipeoff._lowlevel`.
"""

from __future__ import annotations

from pipeoff.recording._recorder import Recorder, record, record_hook_wait
from pipeoff.recording._stats import StatsHooks, SyncStats, step_stats
from pipeoff.recording._train import install_train_hooks, train_span

__all__ = ["Recorder", "StatsHooks", "SyncStats", "install_train_hooks", "record",
           "record_hook_wait", "step_stats", "train_span"]
