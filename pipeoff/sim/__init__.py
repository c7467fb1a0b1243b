"""Simulation: run pipeoff graphs and schedules against a cost model.

``pipeoff.execute(graph, schedule, backend="sim", cost_model=CostModel.h200_pcie5())``
returns an ordinary :class:`~pipeoff.Execution` whose trace holds predicted
times, so every trace tool works on predictions too.
"""

from __future__ import annotations

from typing import Any

from pipeoff.executor import register_backend
from pipeoff.sim._backend import SimBackend
from pipeoff.sim._costmodel import CostModel

__all__ = ["CostModel"]


def _sim_backend(cost_model: Any) -> SimBackend:
    return SimBackend(cost_model if cost_model is not None else CostModel.h200_pcie5())


register_backend("sim", _sim_backend)
