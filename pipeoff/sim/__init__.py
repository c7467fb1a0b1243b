"""Simulation: run pipeoff graphs and schedules against a cost model.

``pipeoff.execute(graph, schedule, backend="sim", cost_model=CostModel.h200_pcie5())``
returns an ordinary :class:`~pipeoff.Execution` whose trace holds predicted
times, so every trace tool works on predictions too.
"""

from __future__ import annotations

from pipeoff.sim._costmodel import CostModel

__all__ = ["CostModel"]
