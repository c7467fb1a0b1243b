"""Full offload's step traces: the trace of the last step that ended, with the forward
hooks' waits for its weights, and its earlier micro-steps' traces (their gradient
copies and folds are the step's too, for its per-step figures).

:class:`StepTraces` is their one owner. It takes a step the lifecycle ended through
``Lifecycle.take_ended`` (calling down), whoever waited for it: the optimizer, or
the model sync before it adopts an outside write.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from pipeoff._lowlevel import hook_wait_records
from pipeoff.optim._full_offload._common import Accumulation
from pipeoff.optim._full_offload._lifecycle import Lifecycle
from pipeoff.optim._waits import ForwardWaits

__all__ = ["StepTraces"]


class StepTraces:
    """The traces of the last step that ended.

    Args:
        lifecycle: ends the steps (read: the step that ended, once).
        waits: the forward hooks' waits for the step in flight's weights.
    """

    def __init__(self, lifecycle: Lifecycle, waits: ForwardWaits, choice: Any = None) -> None:
        self.lifecycle = lifecycle
        self.choice = choice
        """``offload_fraction="auto"``'s :class:`FractionChoice` (the metadata's), or ``None``."""
        self.waits = waits
        self.last: Any = None
        """The last ended step's :class:`pipeoff.trace.Trace`, with the hooks' waits."""
        self.micro: list[Any] = []
        """The traces of its earlier (non-final) micro-steps' executions."""
        self._hook_waits: list[tuple[str, int, int]] = []

    def begin(self, acc: Accumulation, device: torch.device) -> None:
        """A step in flight whose weights the forward hooks wait for."""
        self._hook_waits = self.waits.begin(acc.writes(device))

    def take_ended(self) -> bool:
        """Take the traces of a step the lifecycle ended since; whether there was one."""
        acc = self.lifecycle.take_ended()
        if acc is None:
            return False
        # The earlier micro-steps' executions: done, as the final one waited for them.
        self.micro = [ms.execution.trace for ms in acc.micro
                      if not ms.final and ms.execution is not None and ms.execution.done()]
        self.waits.end()
        ex = acc.execution
        trace = ex.trace
        # The forward hooks' waits for this step's weights, as OffloadOptimizer's trace has.
        waits = hook_wait_records(self._hook_waits, ex.origin_ns, trace.metadata.get("rank", 0))
        self._hook_waits = []
        part: Any = getattr(self.lifecycle, "part", None)
        meta = {**trace.metadata, "offload_fraction": 1.0 if part is None else part.fraction,
                **({} if self.choice is None else {"offload_choice": self.choice.as_dict()})}
        self.last = dataclasses.replace(trace, tasks=trace.tasks + waits, metadata=meta)
        return True
