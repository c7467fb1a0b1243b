"""The runtime's front door for pipeoff's own features (in the spirit of ``trio.lowlevel``).

Features (``optim``, ``ft``, ``transfer``, the trace recorder) build graphs
and launch them with :func:`pipeoff.execute`; what they need of an execution
beyond its public surface goes through the functions here, which are the only
code outside ``execution.py`` and ``executor/`` that reads an execution's run.

It is also the features' one way to the instruments (:mod:`pipeoff.recording`):
the training thread's spans (:func:`train_span`, :func:`install_train_hooks`),
the per-step figures (:func:`step_stats`, :class:`StatsHooks`,
:class:`SyncStats`) and a forward hook's wait on the trace
(:func:`record_hook_wait`).
"""

from __future__ import annotations

from pipeoff._lowlevel._execution import (
    completions,
    hook_wait_records,
    is_failure_of,
    on_complete,
    pending,
    settle,
    shifted_trace,
    translate_failures,
)
from pipeoff.executor._exit import watch as report_unraised_at_exit
from pipeoff.recording import (
    StatsHooks,
    SyncStats,
    install_train_hooks,
    record_hook_wait,
    step_stats,
    train_span,
)

__all__ = ["StatsHooks", "SyncStats", "completions", "hook_wait_records", "install_train_hooks",
           "is_failure_of", "on_complete", "pending", "record_hook_wait",
           "report_unraised_at_exit", "settle", "shifted_trace", "step_stats", "train_span",
           "translate_failures"]
