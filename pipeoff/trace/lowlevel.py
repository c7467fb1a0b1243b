"""What pipeoff's features use of the trace recorder beyond its public names (in the
spirit of :mod:`pipeoff._lowlevel`, the runtime's front door): the training
thread's spans and the per-step figures.

* :func:`train_span`: a block of the training thread (``step()``, a sync) as a
  ``"{what} {step}"`` span on the ``train`` row while a region is recorded, and
  a ``pipeoff::train::{what} {step}`` range while ``torch.profiler`` profiles;
* :func:`install_train_hooks`: a model's forward and backward on that row;
* :func:`step_stats`, :class:`StatsHooks`, :class:`SyncStats`: the
  :class:`pipeoff.trace.StepStats` of a step or a sync, and the hooks that get
  every one.
"""

from __future__ import annotations

from pipeoff.trace._stats import StatsHooks, SyncStats, step_stats
from pipeoff.trace._train import install_train_hooks, train_span

__all__ = ["StatsHooks", "SyncStats", "install_train_hooks", "step_stats", "train_span"]
