"""Simulation: run pipeoff graphs and schedules against a cost model.

``pipeoff.execute(graph, schedule, backend="sim", cost_model=CostModel.h200_pcie5())``
returns an ordinary :class:`~pipeoff.Execution` whose trace holds predicted
times, so every trace tool works on predictions too; each marks them as
predicted (the trace's ``backend: "sim"`` metadata, kept through save and
load). :func:`model_shape` and the features' shape-only graphs
(:func:`optimizer_graph`, ...) build what to simulate at model scale, and
:func:`compare` predicts a feature's schedules side by side; :func:`train_step` a whole
training step (compute from FLOPs, the optimizer's graphs beside it) per design.
"""

from __future__ import annotations

from typing import Any

from pipeoff.executor import register_backend
from pipeoff.sim._backend import SimBackend
from pipeoff.sim._compare import FEATURE_SCHEDULES, Prediction, compare
from pipeoff.sim._compute import DeviceCompute, forward_flops
from pipeoff.sim._costmodel import CostModel
from pipeoff.sim._hostnode import HOST_OP_BYTES, ONE_PASS_DESIGNS, HostCosts, HostNode
from pipeoff.sim._train_step import TRAIN_STEP_SCHEDULES, TrainStep, TrainStepRow, train_step
from pipeoff.sim._workloads import (
    MODEL_PRESETS,
    ModelShape,
    diloco_graph_shape,
    full_offload_graph,
    full_offload_schedule,
    local_sgd_graph,
    model_shape,
    optimizer_graph,
    optimizer_schedule,
    transfer_graph_shape,
)

__all__ = [
    # cost models
    "CostModel",
    "DeviceCompute",
    "HOST_OP_BYTES",
    "HostCosts",
    "HostNode",
    "ONE_PASS_DESIGNS",
    # model shapes
    "MODEL_PRESETS",
    "ModelShape",
    "model_shape",
    "forward_flops",
    # the features' graphs, shape only
    "diloco_graph_shape",
    "full_offload_graph",
    "full_offload_schedule",
    "local_sgd_graph",
    "optimizer_graph",
    "optimizer_schedule",
    "transfer_graph_shape",
    # side-by-side predictions (``pipeoff simulate``)
    "FEATURE_SCHEDULES",
    "Prediction",
    "compare",
    # a whole training step (``pipeoff simulate --feature train-step``)
    "TRAIN_STEP_SCHEDULES",
    "TrainStep",
    "TrainStepRow",
    "train_step",
]


def _sim_backend(cost_model: Any) -> SimBackend:
    return SimBackend(cost_model if cost_model is not None else CostModel.h200_pcie5())


register_backend("sim", _sim_backend)
