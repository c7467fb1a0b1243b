"""Per-step figures for loggers: a small frozen record of one optimizer step or sync.

pipeoff prints nothing while training. What a step cost is in its trace; a
:class:`StepStats` is the handful of numbers from it that W&B, TensorBoard or
the HF Trainer's logs take as they are (:meth:`StepStats.as_dict`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["StepStats"]


@dataclass(frozen=True, kw_only=True, slots=True)
class StepStats:
    """What one optimizer step (or one LocalSGD/DiLoCo sync) moved and cost.

    Times are milliseconds, sizes bytes. Durations of a kind are summed over its
    tasks (they may overlap each other and the training loop).
    """

    step: int
    """The step's number: ``step()`` calls before it (a sync: the step it follows)."""
    what: str
    """``"step"`` (an optimizer step) or ``"sync"`` (a LocalSGD or DiLoCo sync)."""
    d2h_bytes: int
    """Bytes copied device to host (gradients, state, averages), by copies that
    finished."""
    h2d_bytes: int
    """Bytes copied host to device (weights, state), by copies that finished."""
    copy_ms: float
    """Time the copies took, summed."""
    host_ms: float
    """Time of host and optimizer work (folds, chunk steps, an outer step), summed."""
    collective_ms: float
    """Time of all-reduces, summed."""
    wait_ms: float
    """Time lanes waited for their inputs (gates) and forward hooks for the step."""
    chunks: int
    """Optimizer chunks stepped (buckets all-reduced, for a sync)."""
    exposed_ms: float
    """Time the training thread spent inside ``step()`` (or the sync), its wait for the
    step before it included: what the step cost the loop, before any forward-hook wait.
    Not counted: the stats hooks' own time, and torch's wrapper around ``step()`` (its
    profiler range, whose exit on CPU can wait for the GIL while lanes run Python)."""
    makespan_ms: float
    """From the step's first task's start to its last task's end."""
    committed: bool | None = None
    """For a sync: whether the quorum committed; ``None`` for a step."""
    failed: int = 0
    """Tasks that raised."""
    offload_fraction: float | None = None
    """The optimizer's share of the state in host memory at this step (the one
    ``offload_fraction="auto"`` chose, too); ``None`` for a sync."""

    def as_dict(self, prefix: str = "pipeoff/") -> dict[str, Any]:
        """The figures as a flat dict of numbers, keys prefixed (``"pipeoff/d2h_bytes"``):
        what ``wandb.log``, TensorBoard's ``add_scalars`` and the HF Trainer's ``log``
        take as they are. ``committed`` is 1 or 0, and absent for a step (no
        ``None``: TensorBoard refuses it)."""
        out: dict[str, Any] = {}
        for k, v in asdict(self).items():
            if k == "what" or v is None:
                continue
            out[f"{prefix}{k}"] = int(v) if isinstance(v, bool) else v
        return out
