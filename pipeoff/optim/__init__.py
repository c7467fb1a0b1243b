"""pipeoff.optim: an optimizer whose state lives in host memory, stepped in pipelined chunks."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeoff.optim._full_offload._grads import HostGrad
from pipeoff.optim._full_offload._host_kernel import host_step_status
from pipeoff.optim._offload._auto import FractionChoice
from pipeoff.optim._offload._check import OverlapReport, check_overlap
from pipeoff.optim._plan import Chunk, ChunkPlan, ParamMeta, Segment, plan_chunks, planned_numel
from pipeoff.optim._update import ELEMENTWISE
from pipeoff.optim.full_offload import FullOffloadOptimizer
from pipeoff.optim.offload import OffloadOptimizer

if TYPE_CHECKING:
    from pipeoff._contract import MasterCopy, OffloadedOptimizer

    def _implements(a: OffloadOptimizer, b: FullOffloadOptimizer
                    ) -> tuple[OffloadedOptimizer, OffloadedOptimizer, MasterCopy]:
        """mypy checks that both optimizers implement the contract."""
        return a, b, b

__all__ = [
    # the optimizer
    "OffloadOptimizer",
    "FullOffloadOptimizer",
    "HostGrad",
    "ELEMENTWISE",
    "host_step_status",
    "FractionChoice",  # what offload_fraction="auto" chose (opt.offload_choice)
    # checking a model for overlap mode
    "OverlapReport",
    "check_overlap",
    # chunk plans
    "Chunk",
    "ChunkPlan",
    "ParamMeta",
    "Segment",
    "plan_chunks",
    "planned_numel",
]
