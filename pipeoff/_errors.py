"""The exceptions pipeoff raises, all deriving from :class:`PipeoffError`."""

from __future__ import annotations

__all__ = [
    "BudgetError",
    "ConfigError",
    "GradientError",
    "GraphError",
    "PipeoffError",
    "PlanMismatchError",
    "StepTimeoutError",
    "TraceFormatError",
    "UnsupportedOptimizerError",
]


class PipeoffError(Exception):
    """Base class of every error pipeoff raises on purpose."""


class ConfigError(PipeoffError, ValueError):
    """Raised when a user-facing argument is out of range or of the wrong kind.

    The message names the argument, the value given and what is accepted.
    """


class GraphError(PipeoffError, ValueError):
    """Raised when a task graph is malformed: a duplicate task or buffer name,
    an unknown dependency or buffer, or a dependency cycle (which is printed).
    """


class BudgetError(PipeoffError, ValueError):
    """Raised when a schedule cannot keep live staging within its budget.

    Either a single staging buffer is larger than the budget of its memory
    kind (the buffer is named), or no issue order of the graph keeps the live
    bytes under the budget (the blocking buffers are named).
    """


class StepTimeoutError(PipeoffError, TimeoutError):
    """Raised when a wait with a timeout expires; names the tasks still pending
    and the gates not yet opened."""

    def __init__(self, message: str, pending: tuple[str, ...] = (),
                 pending_gates: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.pending = pending
        self.pending_gates = pending_gates


class UnsupportedOptimizerError(PipeoffError, TypeError):
    """Raised when an optimizer cannot be stepped in chunks (it is not element-wise)."""


class StepFailedError(PipeoffError, RuntimeError):
    """Raised by an optimizer whose previous step failed after writing some parameters.

    The parameters and optimizer state are partly stepped; stepping again would
    compound that silently. Load a checkpoint (the model's and the optimizer's
    ``load_state_dict``) to go on.
    """


class GradientError(PipeoffError, RuntimeError):
    """Raised when a gradient reaches :class:`~pipeoff.optim.FullOffloadOptimizer` in a
    form it cannot take: the wrong dtype or device, twice for one parameter in one
    backward, or outside a backward."""


class PlanMismatchError(PipeoffError, RuntimeError):
    """Raised on every rank when ranks disagree on a plan that must be identical."""


class TraceFormatError(PipeoffError, ValueError):
    """Raised when a file is not valid JSON or not a trace that pipeoff wrote."""
