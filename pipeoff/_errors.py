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
    "TransferRefusedError",
    "TransferTornError",
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


class PeerSyncFailedError(PipeoffError, RuntimeError):
    """Reported to the torchft manager (never raised by ``sync()``) by a replica group
    whose peer failed a LocalSGD or DiLoCo sync after joining its all-reduces with
    values that are not its own to average (its error came first, or it was healing).

    This replica group rejects the sync too (``should_commit()`` is ``False``), as
    under torchft, whose failed peer skips its all-reduces and leaves the others to
    time out; ``manager.errored()`` holds this error.
    """


class TraceFormatError(PipeoffError, ValueError):
    """Raised when a file is not valid JSON or not a trace that pipeoff wrote."""


class TransferRefusedError(PipeoffError, RuntimeError):
    """Raised by :class:`~pipeoff.transfer.StateTransfer` on every rank, identically,
    when its preflight refuses the transfer: nothing has been written or staged.

    ``problems`` lists every ``(rank, key, reason)`` found, in rank order;
    ``rank``, ``key`` and ``reason`` are the first of them.
    """

    def __init__(self, problems: tuple[tuple[int, str, str], ...]) -> None:
        self.problems = tuple(problems)
        self.rank, self.key, self.reason = self.problems[0]
        shown = "; ".join(f"rank {r}, key {k!r}: {why}" for r, k, why in self.problems[:6])
        more = (f"; and {len(self.problems) - 6} more problem(s)"
                if len(self.problems) > 6 else "")
        super().__init__(f"state transfer refused before any target was written: {shown}{more}")

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.problems,))


class TransferTornError(PipeoffError, RuntimeError):
    """Raised by :class:`~pipeoff.transfer.StateTransfer` on every rank, identically,
    when a task failed after the preflight: some targets were written and others
    not. There is no rollback (write into scratch targets and swap on success).

    ``written`` maps each rank to the rounds whose targets it wrote in full,
    ``partial`` to the rounds it wrote in part, ``faults`` to the first failure
    it saw (``"task: error"``, only ranks that failed), and ``keys`` lists the
    keys whose targets may have changed on some rank.
    """

    def __init__(self, written: dict[int, tuple[int, ...]], partial: dict[int, tuple[int, ...]],
                 faults: dict[int, str], keys: tuple[str, ...], note: str = "") -> None:
        self.written = dict(written)
        self.partial = dict(partial)
        self.faults = dict(faults)
        self.keys = tuple(keys)
        where = "; ".join(f"rank {r}: {f}" for r, f in sorted(self.faults.items()))
        rounds = "; ".join(
            f"rank {r} wrote rounds {list(self.written.get(r, ()))}"
            + (f" and may have written part of {list(self.partial[r])}"
               if self.partial.get(r) else "")
            for r in sorted(set(self.written) | set(self.partial)))
        shown = ", ".join(repr(k) for k in self.keys[:8])
        more = f" and {len(self.keys) - 8} more" if len(self.keys) > 8 else ""
        changed = (f"Targets of {len(self.keys)} key(s) may have changed: {shown}{more}. "
                   "There is no rollback" if self.keys else "No target was written")
        super().__init__(f"state transfer torn: {where or 'a rank failed'}. "
                         f"{rounds + '. ' if rounds else ''}{changed}"
                         + (f". {note}" if note else ""))
        self._note = note

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.written, self.partial, self.faults, self.keys, self._note))
