"""Side-by-side predictions of schedules for a feature at a model scale (``pipeoff simulate``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from pipeoff._errors import BudgetError, ConfigError
from pipeoff._validate import check_int
from pipeoff._validate import parse_bytes as parse_bytes  # (its old home: one parser now)
from pipeoff.graph import TaskGraph
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
from pipeoff.trace._format import fmt_bytes
from pipeoff.trace._records import MARKERS

__all__ = ["FEATURE_SCHEDULES", "SCHEDULE_NOTES", "Prediction", "compare", "critical_lane",
           "host_state", "parse_bytes"]

FEATURE_SCHEDULES = {
    "optimizer": ("single_pass", "sync_chunks", "pipelined"),
    "local-sgd": ("original", "rfc", "pipelined"),
    "full-offload": ("none", "pipelined"),
    "transfer": ("synchronous", "pipelined"),
    "diloco": ("original", "synchronous", "pipelined"),
}
SCHEDULE_NOTES = {
    "optimizer": "single_pass: all the state to the device at once; sync_chunks: one chunk "
                 "at a time, each waited for; pipelined: pipeoff's chunks, prefetched",
    "local-sgd": "original: torchft's own sync, everything on the device (no offload: the "
                 "fast baseline, at the most device memory); rfc: RFC 0003's sequential "
                 "offload; pipelined: pipeoff's bucketed offload",
    "full-offload": "none: the host step after the backward, nothing overlapped; "
                    "pipelined: the host step and the weights' copies under the next forward",
    "transfer": "synchronous: one round at a time; pipelined: pipeoff's overlapped rounds",
    "diloco": "original: torchft's DiLoCo (outer state on the device); synchronous and "
              "pipelined: pipeoff's DiLoCo(offload_to_cpu=True)",
}
"""What each feature's schedules are, for the table's readers."""
_LANE_BOUND = {"h2d": "link", "d2h": "link", "compute": "compute", "comm": "comm",
               "host": "host", "main": "serial", "accumulate": "host", "host_step": "host",
               "d2d": "hbm"}
_NAMES = {"chunk_bytes": "chunk_bytes", "bucket_bytes": "bucket_bytes",
          "device_budget_bytes": "device_budget_bytes"}
"""How errors name the size arguments (the CLI passes its option names)."""
_SIZE_OF = {"optimizer": "chunk_bytes", "local-sgd": "bucket_bytes", "diloco": "bucket_bytes"}
"""The size each feature's staging buffers are made of, which a budget must hold."""


def host_state(feature: str, schedule: str, shape: ModelShape) -> tuple[int, str]:
    """The host memory ``feature`` keeps for a rank under ``schedule`` besides its staging:
    ``(bytes, what)``, with S the rank's local parameters in FP32 (4 bytes each).

    - ``optimizer``: the optimizer state (AdamW: two FP32 tensors, 2S);
    - ``full-offload``: FP32 masters, AdamW state and FP32 gradient sums (4S);
    - ``diloco``: the backup of the global parameters (S; torchft keeps it there too),
      with ``offload_to_cpu`` also the pseudo-gradients and the outer SGD momentum (3S);
    - ``local-sgd`` and ``transfer``: none (LocalSGD's host copy of the averages is its
      host staging; a transfer's source masters are full offload's, not counted).
    """
    s = 4 * sum(n for _, n in shape.local_numels)
    if feature == "optimizer":
        return 2 * s, "AdamW state (2 x FP32)"
    if feature == "full-offload":
        return 4 * s, "FP32 masters, AdamW state, FP32 gradient sums (4 x FP32)"
    if feature == "diloco":
        if schedule == "original":
            return s, "backup of the global parameters (FP32)"
        return 3 * s, "backup, pseudo-gradients, outer SGD momentum (3 x FP32)"
    if feature == "transfer":
        return 0, "the FP32 masters it reads are full offload's, not counted"
    return 0, "LocalSGD keeps nothing else there: its host copy of the averages is staging"


MAX_SIM_TASKS = 200_000  # beyond this a graph takes minutes to build and simulate


def _check_pieces(name: str, size: int, shape: ModelShape,
                  names: Mapping[str, str] = _NAMES, per: int = 1) -> None:
    """Refuse a chunk or bucket size that would cut the model into too many tasks
    (``per``: pieces planned per ``size`` of fp32 bytes, a transfer's for every rank
    in pieces of half its budget)."""
    pieces = shape.params * 4 * per // size  # at least fp32 parameters' worth of bytes
    if pieces * 3 > MAX_SIM_TASKS:
        least = shape.params * 4 * per * 3 // MAX_SIM_TASKS + 1
        raise ConfigError(
            f"{names.get(name, name)}={size} cuts {shape.name} into about {pieces} pieces, "
            f"more than the simulator takes; raise it to at least {least} bytes "
            f"({fmt_bytes(least)})")


def _typeable(n: int) -> str:
    """``n`` bytes as a size string that parses back to at least ``n``."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def _check_budget(graph: TaskGraph, sched: Schedule, feature: str, sizes: Mapping[str, int],
                  names: Mapping[str, str]) -> None:
    """Refuse a budget below the largest staging buffer it must hold, saying how big it
    must be at least and what to change."""
    for where in ("device", "host"):
        cap = sched.device_budget_bytes if where == "device" else sched.host_budget_bytes
        big = max((b for b in graph.buffers.values() if b.where == where),
                  key=lambda b: b.nbytes, default=None)
        if cap is None or big is None or big.nbytes <= cap:
            continue
        budget = names.get("device_budget_bytes", "device_budget_bytes")
        size = _SIZE_OF.get(feature)
        hint = (f", or lower {names.get(size, size)} (now {sizes[size]} bytes, "
                f"{fmt_bytes(sizes[size])}), which sets that buffer's size" if size else "")
        units = (" (KB, MB, GB are powers of 10, KiB, MiB, GiB powers of 2)"
                 if cap % 1000 == 0 and cap % 1024 else "")
        raise BudgetError(
            f"{budget}={cap} bytes ({fmt_bytes(cap)}) is less than {where} staging buffer "
            f"{big.name!r} needs, {big.nbytes} bytes ({fmt_bytes(big.nbytes)}): raise "
            f"{budget} to at least {_typeable(big.nbytes)}{hint}{units}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Prediction:
    """One schedule's predicted figures."""

    schedule: str
    time_ms: float
    peak_device_bytes: int
    """The high-water mark of device staging."""
    peak_host_bytes: int
    """Host memory: :attr:`host_state_bytes` plus the high-water mark of host staging."""
    efficiency: float
    bound: str
    """What limits it: ``link``, ``compute``, ``comm``, ``host`` or ``serial``."""
    trace: Trace
    """The predicted trace (its metadata names the cost model)."""
    host_state_bytes: int = 0
    """The host memory the feature keeps besides staging (:func:`host_state`)."""
    host_state: str = ""
    """What that memory is."""
    peak_host_staging_bytes: int = 0
    """The high-water mark of host staging."""
    exposed_ms: float | None = None
    """With the next forward modelled: how much later it ends than it would alone,
    which is what the training loop loses to the sync (``None``: not modelled)."""


def critical_lane(trace: Trace) -> str:
    """The bound that limits a trace: the kind of its busiest lane."""
    from pipeoff.sim._compute import TRAIN_LANES

    busy = {k: v for k, v in trace.lane_busy_ns().items() if k not in TRAIN_LANES}
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
    names: Mapping[str, str] | None = None,
    tokens: int | None = None,
    seq_len: int | None = None,
    fragment_sync_delay: int = 0,
) -> list[Prediction]:
    """Predict each of ``schedules`` for ``feature`` on ``shape`` with ``cost``.

    ``names`` maps the size arguments (``chunk_bytes``, ``bucket_bytes``,
    ``device_budget_bytes``) to the names errors use for them (the CLI's options).
    For ``diloco``, ``tokens`` (per rank, in contexts of ``seq_len``) adds the next
    forward to each sync (``cost.compute`` prices it): ``exposed_ms`` is then what
    the loop loses to the sync, ``time_ms`` the sync's own tasks still; with
    ``fragment_sync_delay`` inner steps between the sync's preparation and its
    decision.

    Raises:
        ConfigError: an unknown feature or schedule, no schedule, a prefetch
            below 1, or a chunk, bucket or budget size that makes too many tasks.
        BudgetError: a budget smaller than a staging buffer it must hold (the message
            says how big it must be at least, and what else to lower).
    """
    from pipeoff.executor import execute

    if feature not in FEATURE_SCHEDULES:
        raise ConfigError(f"feature must be one of {sorted(FEATURE_SCHEDULES)}, got {feature!r}")
    known = FEATURE_SCHEDULES[feature]
    if not schedules:
        raise ConfigError(f"no schedule given; known for {feature}: {', '.join(known)}")
    twice = sorted({s for s in schedules if list(schedules).count(s) > 1})
    if twice:
        raise ConfigError(f"schedules names {', '.join(twice)} more than once (one row each); "
                          "give each schedule once")
    check_int("prefetch", prefetch, as_bound=True)
    names = {**_NAMES, **(names or {})}
    if feature == "optimizer" and set(schedules) - {"single_pass"}:
        _check_pieces("chunk_bytes", chunk_bytes, shape, names)
    if feature in ("local-sgd", "diloco") and set(schedules) - {"original"}:
        _check_pieces("bucket_bytes", bucket_bytes, shape, names)
    if feature == "transfer":  # (its staging: the budget, else a bucket's bytes)
        _check_pieces("bucket_bytes" if device_budget_bytes is None else "device_budget_bytes",
                      device_budget_bytes or bucket_bytes, shape, names, per=2 * shape.fsdp)
    if feature == "full-offload" and device_budget_bytes is not None:
        # a budget silently ignored would print figures for another configuration
        raise ConfigError(
            f"{names.get('device_budget_bytes', 'device_budget_bytes')} does not apply to "
            "full-offload: its device staging is set by the optimizer's host slots "
            "(slots x slot bytes), not by a budget; leave it out")
    sizes = {"chunk_bytes": chunk_bytes, "bucket_bytes": bucket_bytes}
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
            graph = full_offload_graph(shape, one_pass=cost.host is not None
                                       and cost.host.one_pass)
            sched = full_offload_schedule(shape, pipelined=name == "pipelined")
        elif feature == "diloco":
            fwd = (shape.forward_flops(tokens, seq_len or tokens)
                   if tokens is not None and cost.compute is not None else None)
            graph = diloco_graph_shape(shape, variant=name,  # type: ignore[arg-type]
                                       bucket_bytes=bucket_bytes, next_forward_flops=fwd,
                                       fragment_sync_delay=fragment_sync_delay)
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
        _check_budget(graph, sched, feature, sizes, names)
        trace = execute(graph, sched, backend="sim", cost_model=cost).trace
        trace = dataclasses.replace(trace, metadata={**trace.metadata, "cost_model": cost.name})
        s = trace.summary()
        state, what = host_state(feature, name, shape)
        time_ms, exposed = _without_training(trace, graph, cost)
        out.append(Prediction(
            schedule=name, time_ms=time_ms, exposed_ms=exposed,
            peak_device_bytes=s.peak_device_staging_bytes,
            peak_host_bytes=state + s.peak_host_staging_bytes, efficiency=s.efficiency,
            bound=critical_lane(trace), trace=trace, host_state_bytes=state, host_state=what,
            peak_host_staging_bytes=s.peak_host_staging_bytes,
        ))
    return out


def _without_training(trace: Trace, graph: TaskGraph,
                      cost: CostModel) -> tuple[float, float | None]:
    """The makespan of the feature's own tasks (ms), and with training compute in the
    graph how much later that compute ends than it would alone (ms; else ``None``)."""
    from pipeoff.sim._compute import TRAIN_LANES

    train = {t.name for t in graph.tasks.values() if t.lane in TRAIN_LANES}
    if not train or cost.compute is None:
        return trace.summary().makespan_us / 1e3, None
    own = [t for t in trace.tasks if t.name not in train and t.kind not in MARKERS]
    time_ms = ((max(t.end_ns for t in own) - min(t.start_ns for t in own)) / 1e6
               if own else 0.0)
    alone = sum(cost.compute.seconds(graph.tasks[n].nbytes) for n in train) * 1e3
    end = max(t.end_ns for t in trace.tasks if t.name in train) / 1e6
    start = min(t.start_ns for t in trace.tasks) / 1e6
    return time_ms, end - start - alone
