"""pipeoff: stream-pipelined offload of optimizer state and averaged parameters.

Features build a :class:`TaskGraph` of copies, collectives and optimizer
chunks; a :class:`Schedule` orders it under staging budgets; :func:`execute`
runs it on CUDA streams or host threads and returns an :class:`Execution`
whose :attr:`~Execution.trace` shows where the time went.
"""

from __future__ import annotations

from pipeoff import _vml
from pipeoff import sim as sim  # registers the "sim" backend
from pipeoff._errors import (
    BudgetError,
    ConfigError,
    GradientError,
    GraphError,
    PeerSyncFailedError,
    PipeoffError,
    PlanMismatchError,
    StepFailedError,
    StepTimeoutError,
    TraceFormatError,
    TransferRefusedError,
    TransferTornError,
    UnsupportedOptimizerError,
)
from pipeoff.execution import Completion, Execution, Gate
from pipeoff.executor import execute
from pipeoff.graph import BufferSpec, Task, TaskContext, TaskGraph, TaskKind
from pipeoff.schedule import Plan, Schedule
from pipeoff.staging import StagingPool, pools_for
from pipeoff.trace import Trace, TraceSummary

__version__ = "0.1.0"

# Hazard: the process's first MKL vector-math call (a first AdamW step's sqrt) taken
# by several threads at once, one of them on a low-precision kernel (pipeoff/_vml.py).
_vml.warm_vector_math()

__all__ = [
    # graphs
    "BufferSpec",
    "Task",
    "TaskContext",
    "TaskGraph",
    "TaskKind",
    # schedules
    "Plan",
    "Schedule",
    # execution
    "Completion",
    "Execution",
    "Gate",
    "execute",
    # staging
    "StagingPool",
    "pools_for",
    # traces
    "Trace",
    "TraceSummary",
    # errors
    "BudgetError",
    "ConfigError",
    "GradientError",
    "GraphError",
    "PeerSyncFailedError",
    "PipeoffError",
    "PlanMismatchError",
    "StepFailedError",
    "StepTimeoutError",
    "TraceFormatError",
    "TransferRefusedError",
    "TransferTornError",
    "UnsupportedOptimizerError",
]
