"""Side-by-side predictions of schedules for a feature at a model scale (``pipeoff simulate``)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from pipeoff._errors import ConfigError
from pipeoff._validate import check_int
from pipeoff.schedule import Schedule
from pipeoff.sim._costmodel import CostModel
from pipeoff.sim._workloads import (
    ModelShape,
    diloco_graph_shape,
    full_offload_graph,
    full_offload_schedule,
    local_sgd_graph,
    optimizer_graph,
    transfer_graph_shape,
)
from pipeoff.trace import Trace

__all__ = ["FEATURE_SCHEDULES", "Prediction", "compare", "critical_lane", "parse_bytes"]

FEATURE_SCHEDULES = {
    "optimizer": ("single_pass", "sync_chunks", "pipelined"),
    "local-sgd": ("original", "rfc", "pipelined"),
    "full-offload": ("none", "pipelined"),
    "transfer": ("synchronous", "pipelined"),
    "diloco": ("original", "synchronous", "pipelined"),
}
_LANE_BOUND = {"h2d": "link", "d2h": "link", "compute": "compute", "comm": "comm",
               "host": "host", "main": "serial", "accumulate": "host", "host_step": "host",
               "d2d": "hbm"}
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20,
          "gib": 2**30}


def parse_bytes(text: str) -> int:
    """``"256MiB"`` -> 268435456; also plain ints and ``1e9``.

    Raises:
        ConfigError: not a positive size.
    """
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([kKmMgG]?i?[bB]?)\s*", str(text))
    if not m:
        raise ConfigError(f"not a byte size: {text!r} (use e.g. 4096, 256MiB, 1GiB, 2e9)")
    try:
        value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    except (KeyError, ValueError):
        raise ConfigError(f"not a byte size: {text!r} (use e.g. 4096, 256MiB, 1GiB)") from None
    if not value < 2**62:  # also inf and nan
        raise ConfigError(f"byte size too large: {text!r}")
    if value < 1:
        raise ConfigError(f"byte size must be at least 1, got {text!r}")
    return int(value)


MAX_SIM_TASKS = 200_000  # beyond this a graph takes minutes to build and simulate


def _check_pieces(name: str, size: int, shape: ModelShape) -> None:
    """Refuse a chunk or bucket size that would cut the model into too many tasks."""
    pieces = shape.params * 4 // size  # at least fp32 parameters' worth of bytes
    if pieces * 3 > MAX_SIM_TASKS:
        least = shape.params * 4 * 3 // MAX_SIM_TASKS + 1
        raise ConfigError(
            f"{name}={size} cuts {shape.name} into about {pieces} pieces, more than the "
            f"simulator takes; use at least {least} bytes")


@dataclass(frozen=True, kw_only=True, slots=True)
class Prediction:
    """One schedule's predicted figures."""

    schedule: str
    time_ms: float
    peak_device_bytes: int
    peak_host_bytes: int
    efficiency: float
    bound: str
    """What limits it: ``link``, ``compute``, ``comm``, ``host`` or ``serial``."""
    trace: Trace


def critical_lane(trace: Trace) -> str:
    """The bound that limits a trace: the kind of its busiest lane."""
    busy = trace.lane_busy_ns()
    if not busy:
        return "none"
    lane = max(busy, key=lambda k: busy[k])
    return _LANE_BOUND.get(lane, lane)


def compare(
    shape: ModelShape,
    feature: str,
    schedules: tuple[str, ...],
    cost: CostModel,
    *,
    chunk_bytes: int = 1 << 30,
    prefetch: int = 2,
    bucket_bytes: int = 256 << 20,
    device_budget_bytes: int | None = None,
) -> list[Prediction]:
    """Predict each of ``schedules`` for ``feature`` on ``shape`` with ``cost``.

    Raises:
        ConfigError: an unknown feature or schedule, no schedule, a prefetch
            below 1, or a chunk or bucket size that makes too many tasks.
    """
    import pipeoff

    if feature not in FEATURE_SCHEDULES:
        raise ConfigError(f"feature must be one of {sorted(FEATURE_SCHEDULES)}, got {feature!r}")
    known = FEATURE_SCHEDULES[feature]
    if not schedules:
        raise ConfigError(f"no schedule given; known for {feature}: {', '.join(known)}")
    check_int("prefetch", prefetch, as_bound=True)
    if feature == "optimizer" and set(schedules) - {"single_pass"}:
        _check_pieces("chunk_bytes", chunk_bytes, shape)
    if feature in ("local-sgd", "diloco") and set(schedules) - {"original"}:
        _check_pieces("bucket_bytes", bucket_bytes, shape)
    for requested in schedules:
        if requested not in known:
            raise ConfigError(
                f"unknown schedule {requested!r} for {feature}; known: {', '.join(known)}")
    out = []
    for name in schedules:
        if feature == "optimizer":
            if name == "single_pass":
                graph, sched = optimizer_graph(shape, chunk_bytes=None), Schedule.pipelined()
            elif name == "sync_chunks":
                graph = optimizer_graph(shape, chunk_bytes=chunk_bytes)
                sched = Schedule.synchronous()
            else:
                graph = optimizer_graph(shape, chunk_bytes=chunk_bytes)
                budget = device_budget_bytes or (prefetch + 1) * chunk_bytes
                sched = Schedule.pipelined(device_budget_bytes=budget)
        elif feature == "full-offload":
            graph = full_offload_graph(shape)
            sched = full_offload_schedule(shape, pipelined=name == "pipelined")
        elif feature == "diloco":
            graph = diloco_graph_shape(shape, variant=name,  # type: ignore[arg-type]
                                       bucket_bytes=bucket_bytes)
            sched = (Schedule.pipelined() if name == "original" else
                     Schedule.synchronous() if name == "synchronous" else
                     Schedule.pipelined(device_budget_bytes=device_budget_bytes
                                        or 2 * bucket_bytes))
        elif feature == "transfer":
            budget = device_budget_bytes or bucket_bytes
            graph = transfer_graph_shape(shape, budget_bytes=budget)
            sched = (Schedule.synchronous() if name == "synchronous" else
                     Schedule.pipelined(device_budget_bytes=budget, host_budget_bytes=budget))
        else:
            if name == "original":
                graph, sched = local_sgd_graph(shape, variant="original"), Schedule.pipelined()
            elif name == "rfc":
                graph, sched = local_sgd_graph(shape, variant="rfc"), Schedule.synchronous()
            else:
                graph = local_sgd_graph(shape, variant="pipelined", bucket_bytes=bucket_bytes)
                sched = Schedule.pipelined(
                    device_budget_bytes=device_budget_bytes or 2 * bucket_bytes)
        trace = pipeoff.execute(graph, sched, backend="sim", cost_model=cost).trace
        s = trace.summary()
        out.append(Prediction(
            schedule=name, time_ms=s.makespan_us / 1e3,
            peak_device_bytes=s.peak_device_staging_bytes,
            peak_host_bytes=s.peak_host_staging_bytes, efficiency=s.efficiency,
            bound=critical_lane(trace), trace=trace,
        ))
    return out
