"""A whole training step, predicted: forward and backward compute beside the optimizer's.

The simulator prices one step of one rank of an FSDP group: the forward and the
backward as compute from FLOPs at an MFU (:class:`~pipeoff.sim.DeviceCompute`;
a mixture of experts' FLOPs from its active parameters), cut into the model's
units (the embedding, each layer, the head) on the ``forward`` and ``backward``
lanes, and the optimizer's work beside it as the feature builds it:

- ``no-offload``: every master and moment on the device, the device's fused
  AdamW after the backward (HBM-bound, the cost model's ``optimizer_elems_per_s``);
- ``full-offload-backward``: prime-rl's design (``full_offload``, PR #3234): the
  full-offload graph (:func:`~pipeoff.sim.full_offload_graph`), each gradient
  copied to the host once its unit's backward produced it, each chunk stepped
  on the host as soon as its gradients are in (fold then step, 40 B per
  parameter), the step over when the last chunk's weights land;
- ``full-offload-forward``: pipeoff's ``FullOffloadOptimizer(overlap="forward")``:
  the host step after the backward (in one pass with the native design, 32 B),
  its chunks in the order the next forward needs them (``MicroStepPlan.build``,
  ``forward_order``), each unit of the next forward waiting only for its own
  chunks' weights; the step costs what the forward waits for (``exposed_ms``);
- ``full-offload-forward-last-first``: the same with the chunks stepped last
  parameter first (the backward's order, as the optimizer did before
  2026-12-05): the next forward's first unit waits for the whole host step;
- ``full-offload-backward-attach``: pipeoff's ``overlap="backward"`` with
  ``attach()``: the chunks step during the final backward as prime-rl's do (fold
  then step), but ``step()`` returns at once and each unit of the next forward
  waits only for its own chunks' weights;
- ``fraction-F`` and ``auto``: a share ``1 - F`` of the state kept on the
  device and stepped there before the next forward (the units that run first),
  the rest as ``full-offload-forward``; ``auto`` picks the fastest fraction whose
  device bytes fit a budget; ``backward-fraction-F`` and ``auto-backward``: the
  same under ``full-offload-backward-attach`` (the offloaded units are the last,
  whose gradients the backward produces first).

Device bytes per local parameter (activations, the same in every row, are not
counted): 16 with its state on the device (FP32 master and gradient, two FP32
moments), 4 offloaded (BF16 compute weight and gradient); plus device staging.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from pipeoff._errors import BudgetError, ConfigError
from pipeoff._validate import check_int
from pipeoff.graph import TaskGraph, TaskKind
from pipeoff.schedule import Schedule
from pipeoff.sim._compute import BACKWARD_LANE, FORWARD_LANE
from pipeoff.sim._costmodel import CostModel
from pipeoff.sim._hostnode import HostCosts
from pipeoff.sim._workloads import (
    EXPERTS,
    ModelShape,
    _full_offload_plan,
    full_offload_graph,
)
from pipeoff.trace import Trace

__all__ = ["DEVICE_BYTES_OFFLOADED", "DEVICE_BYTES_RESIDENT", "FRACTIONS", "PRIME_RL_DESIGN",
           "TRAIN_STEP_SCHEDULES", "TrainStep", "TrainStepRow", "train_step"]

DEVICE_BYTES_RESIDENT = 16
"""Device bytes per local parameter whose state stays there: FP32 master (FSDP's sharded
parameter) and gradient, two FP32 AdamW moments."""
DEVICE_BYTES_OFFLOADED = 4
"""Device bytes per local parameter under full offload: BF16 compute weight and gradient."""
FRACTIONS = tuple(k / 10 for k in range(11))
"""The offload fractions ``auto`` chooses from."""
PRIME_RL_DESIGN = "native-fold"
"""The host design prime-rl's rows are priced with: its native AdamW reads the FP32
gradient sum the fold wrote (fold at arrival, then step and cast: 40 B per parameter)."""
TRAIN_STEP_SCHEDULES = ("no-offload", "full-offload-backward", "full-offload-forward",
                        "full-offload-forward-last-first", "full-offload-backward-attach")
"""The rows every train-step prediction has (fraction and ``auto`` rows on request)."""

SLOT_BYTES = 64 << 20
"""Bytes of one host slot of the gradients' ring (full_offload_graph's default)."""
SLOTS = 4
"""Host slots in the ring."""

_LAYER = re.compile(r"^layers\.(\d+)\.")


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainStep:
    """What one training step computes and how its optimizer is placed.

    Raises:
        ConfigError: a ``seq_len`` or ``micro_batch`` below 1, an ``offload_fraction``
            outside [0, 1], a ``device_budget_bytes`` below 1.
    """

    seq_len: int
    """Tokens per sequence."""
    micro_batch: int = 1
    """Sequences per rank per step (one micro-step)."""
    offload_fraction: float | None = None
    """Add the row ``fraction-F``: this share of the state offloaded (0 to 1)."""
    auto: bool = False
    """Add the row ``auto``: the fastest fraction whose device bytes fit the budget."""
    device_budget_bytes: int | None = None
    """Device memory ``auto`` must fit the model's weights, gradients and state in
    (``None``: the device's, ``DeviceCompute.memory_bytes``)."""
    chunk_numel: int = 16 << 20
    """Elements per optimizer chunk (prime-rl's and pipeoff's default: 16M)."""

    def __post_init__(self) -> None:
        check_int("seq_len", self.seq_len, as_bound=True)
        check_int("micro_batch", self.micro_batch, as_bound=True)
        check_int("chunk_numel", self.chunk_numel, as_bound=True)
        f = self.offload_fraction
        if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float))
                              or not 0 <= f <= 1):
            raise ConfigError(f"offload_fraction must be a number in [0, 1] (the share of "
                              f"the optimizer state kept on the host), got {f!r}")
        if self.device_budget_bytes is not None:
            check_int("device_budget_bytes", self.device_budget_bytes, as_bound=True)

    @property
    def tokens(self) -> int:
        """Tokens per rank per step."""
        return self.seq_len * self.micro_batch


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainStepRow:
    """One design's predicted training step (times in ms, bytes per rank)."""

    schedule: str
    time_ms: float
    """The step: forward, backward and what the optimizer adds to them."""
    compute_ms: float
    """Forward and backward alone."""
    exposed_ms: float
    """What the optimizer adds: ``time_ms - compute_ms``."""
    vs_no_offload: float = 1.0
    """``time_ms`` over the ``no-offload`` row's."""
    peak_device_bytes: int
    """Weights, gradients and optimizer state on the device, plus device staging."""
    offload_fraction: float
    """The share of the optimizer state on the host."""
    host_bytes_per_param: float
    """Host memory traffic of the final micro-step's step, bytes per offloaded parameter."""
    note: str = ""
    """How the row is built (and for ``auto``, what it chose and why)."""
    trace: Trace | None = None
    """The predicted trace."""


def _units(shape: ModelShape) -> list[list[int]]:
    """The model's units in forward order (what comes before the layers, each layer,
    what comes after), each its parameters' indices."""
    pre: list[int] = []
    layers: dict[int, list[int]] = {}
    post: list[int] = []
    for i, (name, _) in enumerate(shape.global_shapes):
        m = _LAYER.match(name)
        if m:
            layers.setdefault(int(m.group(1)), []).append(i)
        elif layers:
            post.append(i)
        else:
            pre.append(i)
    return [u for u in ([pre] + [layers[k] for k in sorted(layers)] + [post]) if u]


def _unit_flops(shape: ModelShape, units: list[list[int]], step: TrainStep) -> list[float]:
    """Each unit's share of one forward's FLOPs: its active parameters (an expert tensor
    at the expert share), and each layer its attention."""
    weights = []
    for unit in units:
        w = 0.0
        for i in unit:
            name, gshape = shape.global_shapes[i]
            w += math.prod(gshape) * (shape.expert_share if EXPERTS in name else 1.0)
        weights.append(w)
    total = shape.forward_flops(step.tokens, step.seq_len)
    attn = step.tokens * 2.0 * shape.layers * step.seq_len * shape.hidden
    nlayers = sum(1 for u in units if _LAYER.match(shape.global_shapes[u[0]][0]))
    dense = total - (attn if nlayers else 0.0)
    wsum = sum(weights) or 1.0
    out = []
    for unit, w in zip(units, weights, strict=True):
        f = dense * w / wsum
        if nlayers and _LAYER.match(shape.global_shapes[unit[0]][0]):
            f += attn / nlayers
        out.append(f)
    return out


def _chain(g: TaskGraph, prefix: str, lane: str, flops: Sequence[float],
           deps: Sequence[Sequence[str]]) -> list[str]:
    """Compute tasks ``{prefix}:{k}`` one after another on ``lane``, task ``k`` also
    after ``deps[k]``."""
    names: list[str] = []
    for k, f in enumerate(flops):
        d = list(deps[k]) + (names[-1:] if names else [])
        names.append(g.add_task(f"{prefix}:{k}", TaskKind.HOST, lane=lane, deps=d,
                                nbytes=int(f)))
    return names


def _copy(g: TaskGraph, src: TaskGraph, extra: dict[str, list[str]]) -> None:
    """Every buffer, gate and task of ``src`` into ``g``, task ``t`` also after
    ``extra[t]``."""
    for b in src.buffers.values():
        g.add_buffer(b.name, b.nbytes, where=b.where)
    for gate in src.gates:
        g.add_gate(gate)
    for t in src.tasks.values():
        g.add_task(t.name, t.kind, deps=[*t.deps, *extra.get(t.name, ())], nbytes=t.nbytes,
                   buffers=t.buffers, lane=t.lane, gates=t.gates)


def _grad_deps(src: TaskGraph, shape: ModelShape, unit_of: dict[int, int], bwd: list[str],
               index: Sequence[int]) -> dict[str, list[str]]:
    """Each task that waits for a gradient's gate (its copy to the host, its fold) after
    the backward of that parameter's unit; ``index`` maps the offload graph's parameters
    to the model's."""
    from pipeoff.optim._full_offload._graph import grad_gate

    unit = {grad_gate(shape.global_shapes[i][0]): unit_of[i] for i in index}
    out = {}
    for t in src.tasks.values():
        units = [unit[gate] for gate in t.gates if gate in unit]
        if units:
            out[t.name] = [bwd[len(bwd) - 1 - min(units)]]
    return out


def _ends(trace: Trace) -> dict[str, int]:
    return {t.name: t.end_ns for t in trace.tasks}


def _run(g: TaskGraph, sched: Schedule, cost: CostModel) -> Trace:
    from pipeoff.executor import execute

    trace = execute(g, sched, backend="sim", cost_model=cost).trace
    return dataclasses.replace(trace, metadata={**trace.metadata, "cost_model": cost.name})


def _with_design(cost: CostModel, design: str) -> CostModel:
    if cost.host is None:
        return cost
    return dataclasses.replace(cost, host=HostCosts(node=cost.host.node, design=design))


def _step_bytes(cost: CostModel, one_pass: bool) -> float:
    """Host bytes per parameter of the final micro-step's step under ``cost``."""
    if cost.host is None:
        return float("nan")
    b = cost.host.bytes_per_elem
    return b["host_step"] + (0.0 if one_pass else b["accumulate"])


class _Model:
    """One shape and step, the pieces every row is built from."""

    def __init__(self, shape: ModelShape, step: TrainStep, cost: CostModel) -> None:
        if cost.compute is None:
            raise ConfigError(f"the cost model {cost.name!r} has no training compute "
                              "(CostModel.compute): a training step cannot be priced")
        self.shape, self.step, self.cost = shape, step, cost
        self.units = _units(shape)
        self.unit_of = {i: k for k, u in enumerate(self.units) for i in u}
        self.fwd = _unit_flops(shape, self.units, step)
        self.bwd = [2 * f for f in reversed(self.fwd)]
        self.compute_s = cost.compute.seconds(sum(self.fwd) + sum(self.bwd))
        self.numels = [n for _, n in shape.local_numels]

    def device_bytes(self, kept: int) -> int:
        total = sum(self.numels)
        return kept * DEVICE_BYTES_RESIDENT + (total - kept) * DEVICE_BYTES_OFFLOADED

    def no_offload(self) -> tuple[float, Trace]:
        g = TaskGraph()
        fwd = _chain(g, "fwd", FORWARD_LANE, self.fwd, [[]] * len(self.fwd))
        bwd = _chain(g, "bwd", BACKWARD_LANE, self.bwd, [[fwd[-1]]] + [[]] * (len(self.bwd) - 1))
        g.add_task("device_step", TaskKind.OPTIMIZER_CHUNK, deps=[bwd[-1]],
                   nbytes=4 * sum(self.numels))
        trace = _run(g, Schedule.pipelined(), self.cost)
        return trace.summary().makespan_us / 1e3, trace

    def backward_overlap(self, *, budgeted: bool = False) -> tuple[float, Trace, CostModel]:
        """prime-rl's design: (ms, trace, the cost model it is priced with)."""
        cost = _with_design(self.cost, PRIME_RL_DESIGN)
        src = full_offload_graph(self.shape, chunk_numel=self.step.chunk_numel)
        plan = _full_offload_plan(self.shape, chunk_numel=self.step.chunk_numel,
                                  slot_bytes=SLOT_BYTES, slots=SLOTS, compute_itemsize=2)
        g = TaskGraph()
        fwd = _chain(g, "fwd", FORWARD_LANE, self.fwd, [[]] * len(self.fwd))
        bwd = _chain(g, "bwd", BACKWARD_LANE, self.bwd, [[fwd[-1]]] + [[]] * (len(self.bwd) - 1))
        _copy(g, src, _grad_deps(src, self.shape, self.unit_of, bwd, range(len(self.numels))))
        # Unbounded: prime-rl's rings bound its staging without holding a chunk back;
        # pipeoff's plan budget, issued in plan order, would make the first chunks wait
        # for later gradients' slots (``budgeted``, kept for comparison).
        sched = plan.schedule("forward") if budgeted else Schedule.pipelined()
        trace = _run(g, sched, cost)
        return trace.summary().makespan_us / 1e3, trace, cost

    def _split(self, fraction: float) -> tuple[set[int], list[int], int]:
        """The parameters kept on the device at ``fraction`` (the units the forward runs
        first), the offloaded ones, and the kept elements."""
        total = sum(self.numels)
        kept_idx: list[int] = []
        kept = 0
        for unit in self.units:  # forward order: the first units stay
            for i in unit:
                if kept + self.numels[i] > (1 - fraction) * total + 0.5:
                    break
                kept_idx.append(i)
                kept += self.numels[i]
            else:
                continue
            break
        keep = set(kept_idx)
        return keep, [i for i in range(len(self.numels)) if i not in keep], kept

    def backward_attached(self, fraction: float) -> tuple[float, Trace, int, CostModel]:
        """pipeoff's ``overlap="backward"`` with ``attach()`` and ``fraction`` offloaded: the
        host part's chunks step during the backward as their gradients land (prime-rl's
        graph, fold then step), the device part after the backward, and ``step()``
        returns at once: each unit of the next forward waits only for its own chunks'
        weights. (ms, trace, kept elements, the cost model it is priced with)."""
        from pipeoff.optim._full_offload._graph import h2d_task

        cost = _with_design(self.cost, PRIME_RL_DESIGN)
        keep, off, kept = self._split(fraction)
        g = TaskGraph()
        bwd0 = _chain(g, "bwd0", BACKWARD_LANE, self.bwd, [[]] * len(self.bwd))
        waits: list[list[str]] = [[] for _ in self.units]
        sched = Schedule.pipelined()  # (unbounded rings, as backward_overlap's)
        if off:
            sub = dataclasses.replace(self.shape, global_shapes=tuple(
                self.shape.global_shapes[i] for i in off))
            plan = _full_offload_plan(sub, chunk_numel=self.step.chunk_numel,
                                      slot_bytes=SLOT_BYTES, slots=SLOTS, compute_itemsize=2)
            src = plan.graph(None, final=True, norm_first=False)
            _copy(g, src, _grad_deps(src, self.shape, self.unit_of, bwd0, off))
            for k, chunk in enumerate(plan.chunks):
                for j in chunk:
                    waits[self.unit_of[off[j]]].append(h2d_task(k))
        if keep:
            g.add_task("device_step", TaskKind.OPTIMIZER_CHUNK, deps=[bwd0[-1]],
                       nbytes=4 * kept)
            waits[0].append("device_step")  # at step(), on the caller's stream
        waits[0].append(bwd0[-1])
        fwd = _chain(g, "fwd", FORWARD_LANE, self.fwd, waits)
        bwd = _chain(g, "bwd", BACKWARD_LANE, self.bwd, [[fwd[-1]]] + [[]] * (len(self.bwd) - 1))
        trace = _run(g, sched, cost)
        ends = _ends(trace)
        return (ends[bwd[-1]] - ends[bwd0[-1]]) / 1e6, trace, kept, cost

    def forward_overlap(self, fraction: float, *,
                        forward_order: bool = True) -> tuple[float, Trace, int, bool]:
        """The step with ``fraction`` of the state offloaded (the units the next forward
        runs last), the rest kept and stepped on the device: (ms, trace, kept elements,
        one pass). ``forward_order``: the host steps its chunks in the order the next
        forward needs them (as the optimizer does under ``overlap="forward"``), else
        last parameter first."""
        from pipeoff.optim._full_offload._graph import h2d_task, step_task

        keep, off, kept = self._split(fraction)
        one_pass = self.cost.host is not None and self.cost.host.one_pass
        g = TaskGraph()
        # Step k's backward, its offloaded part's host step, step k+1's forward and backward.
        bwd0 = _chain(g, "bwd0", BACKWARD_LANE, self.bwd, [[]] * len(self.bwd))
        waits: list[list[str]] = [[] for _ in self.units]
        sched = Schedule.pipelined()
        if off:
            sub = dataclasses.replace(self.shape, global_shapes=tuple(
                self.shape.global_shapes[i] for i in off))
            src = full_offload_graph(sub, chunk_numel=self.step.chunk_numel,
                                     one_pass=one_pass)
            plan = _full_offload_plan(sub, chunk_numel=self.step.chunk_numel,
                                      slot_bytes=SLOT_BYTES, slots=SLOTS, compute_itemsize=2,
                                      forward_order=forward_order)
            if forward_order:  # (the optimizer's plan under overlap="forward")
                src = plan.graph(None, final=True, norm_first=one_pass, held=frozenset(
                    range(len(plan.params))) if one_pass else frozenset())
            extra = _grad_deps(src, self.shape, self.unit_of, bwd0, off)
            for k in range(len(plan.chunks)):  # the host step starts at step(): after
                extra[step_task(k)] = [bwd0[-1]]  # the backward, the gradients all in
            _copy(g, src, extra)
            for k, chunk in enumerate(plan.chunks):
                for j in chunk:
                    waits[self.unit_of[off[j]]].append(h2d_task(k))
            sched = plan.schedule("forward")
        if keep:
            g.add_task("device_step", TaskKind.OPTIMIZER_CHUNK, deps=[bwd0[-1]],
                       nbytes=4 * kept)
            waits[0].append("device_step")  # torch's step runs before the next forward
        waits[0].append(bwd0[-1])
        fwd = _chain(g, "fwd", FORWARD_LANE, self.fwd, waits)
        bwd = _chain(g, "bwd", BACKWARD_LANE, self.bwd, [[fwd[-1]]] + [[]] * (len(self.bwd) - 1))
        trace = _run(g, sched, self.cost)
        ends = _ends(trace)
        ms = (ends[bwd[-1]] - ends[bwd0[-1]]) / 1e6
        return ms, trace, kept, one_pass


def train_step(shape: ModelShape, step: TrainStep, cost: CostModel, *,
               names: Mapping[str, str] | None = None) -> list[TrainStepRow]:
    """Predict one training step of ``shape`` under each design (module docstring).
    ``names`` maps ``device_budget_bytes`` to the name errors use for it (the CLI's
    option).

    Returns:
        The rows ``no-offload``, ``full-offload-backward``, ``full-offload-forward``,
        then ``fraction-F`` and ``auto`` when ``step`` asks for them.

    Raises:
        ConfigError: ``cost`` has no training compute (``CostModel.compute``).
        BudgetError: ``auto`` and no fraction's device bytes fit the budget (the
            message says the least that fits).
    """
    m = _Model(shape, step, cost)
    compute_ms = m.compute_s * 1e3
    total = sum(m.numels)
    rows: list[TrainStepRow] = []

    def row(name: str, ms: float, trace: Trace, kept: int, fraction: float,
            host_b: float, note: str) -> TrainStepRow:
        staging = trace.summary().peak_device_staging_bytes
        return TrainStepRow(schedule=name, time_ms=ms, compute_ms=compute_ms,
                            exposed_ms=ms - compute_ms, peak_device_bytes=m.device_bytes(kept)
                            + staging, offload_fraction=fraction, host_bytes_per_param=host_b,
                            note=note, trace=trace)

    ms, trace = m.no_offload()
    rows.append(row("no-offload", ms, trace, total, 0.0, float("nan"),
                    "state on the device, fused AdamW there after the backward"))
    ms, trace, pcost = m.backward_overlap()
    rows.append(row("full-offload-backward", ms, trace, 0, 1.0, _step_bytes(pcost, False),
                    "prime-rl: chunks step on the host during the final backward"))
    ms, trace, _, one_pass = m.forward_overlap(1.0)
    how = " (one pass)" if one_pass else ""
    rows.append(row("full-offload-forward", ms, trace, 0, 1.0, _step_bytes(cost, one_pass),
                    f"pipeoff: the host step{how} under the next forward, its chunks in the "
                    "order the forward needs them"))
    ms, trace, _, one_pass = m.forward_overlap(1.0, forward_order=False)
    rows.append(row("full-offload-forward-last-first", ms, trace, 0, 1.0,
                    _step_bytes(cost, one_pass),
                    f"as full-offload-forward, the chunks stepped{how} last parameter first "
                    "(before 2026-12-05: the first layer waits for all)"))
    ms, trace, _, bcost = m.backward_attached(1.0)
    rows.append(row("full-offload-backward-attach", ms, trace, 0, 1.0, _step_bytes(bcost, False),
                    "pipeoff overlap='backward' with attach(): chunks step during the final "
                    "backward, the next forward waits per unit"))
    if step.offload_fraction is not None:
        f = float(step.offload_fraction)
        ms, trace, kept, one_pass = m.forward_overlap(f)
        rows.append(row(f"fraction-{f:g}", ms, trace, kept, f, _step_bytes(cost, one_pass),
                        f"{1 - f:.0%} of the state on the device, stepped there"))
        ms, trace, kept, bcost = m.backward_attached(f)
        rows.append(row(f"backward-fraction-{f:g}", ms, trace, kept, f,
                        _step_bytes(bcost, False),
                        f"overlap='backward' with attach(), {1 - f:.0%} of the state on the "
                        "device, stepped there at step()"))
    if step.auto:
        option = (names or {}).get("device_budget_bytes", "device_budget_bytes")
        rows.append(_auto(m, step, cost, row, option))
        rows.append(_auto(m, step, cost, row, option, backward=True))
    base = rows[0].time_ms
    return [dataclasses.replace(r, vs_no_offload=r.time_ms / base) for r in rows]


def _auto(m: _Model, step: TrainStep, cost: CostModel, row: Callable[..., TrainStepRow],
          option: str, *, backward: bool = False) -> TrainStepRow:
    """The ``auto`` row (``backward``: ``auto-backward``, the fractions under
    ``overlap="backward"`` with ``attach()``)."""
    from pipeoff.trace._format import fmt_bytes

    assert cost.compute is not None
    budget = step.device_budget_bytes or cost.compute.memory_bytes
    if budget is None:
        raise ConfigError(f"{option} is needed for auto: the cost model's device "
                          "has no memory size (DeviceCompute.memory_bytes)")
    least = m.device_bytes(0)
    if least > budget:
        given = (f"{option}={budget}" if step.device_budget_bytes else
                 f"the device's memory ({option} not given), {budget} bytes")
        raise BudgetError(
            f"{given} ({fmt_bytes(budget)}) is less than the model "
            f"needs with all its state offloaded, {least} bytes ({fmt_bytes(least)}: "
            f"{DEVICE_BYTES_OFFLOADED} B per local parameter); "
            + ("raise it, or shard over more ranks" if step.device_budget_bytes else
               "shard over more ranks (--fsdp)"))
    tried = []
    for f in FRACTIONS:
        if backward:
            ms, trace, kept, bcost = m.backward_attached(f)
            host_b = _step_bytes(bcost, False)
        else:
            ms, trace, kept, one_pass = m.forward_overlap(f)
            host_b = _step_bytes(cost, one_pass)
        peak = m.device_bytes(kept) + trace.summary().peak_device_staging_bytes
        tried.append((ms, peak, f, trace, kept, host_b))
    fits = [t for t in tried if t[1] <= budget]
    ms, peak, f, trace, kept, host_b = min(fits, key=lambda t: (round(t[0], 6), t[1]))
    fit = sorted(t[2] for t in fits)
    why = (f"offload fraction {f:g}: the fastest predicted ({ms:.1f} ms) of the fractions "
           f"whose device bytes fit {fmt_bytes(budget)} ({fit[0]:g} to {fit[-1]:g}); "
           f"its device bytes {fmt_bytes(peak)}")
    if fit[0] > 0:
        why += f"; below {fit[0]:g} the state does not fit"
    return row("auto-backward" if backward else "auto", ms, trace, kept, f, host_b, why)
