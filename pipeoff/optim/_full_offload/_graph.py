"""The task graph of one full-offload micro-step: gradients in, and on the final one, the step.

One builder, :class:`MicroStepPlan`, serves :class:`~pipeoff.optim.FullOffloadOptimizer`
(with work) and the simulator (shape-only, ``work=None``), so what the simulator
predicts is the graph that runs.

Per parameter, in the order a backward produces gradients (last parameter
first), each piece of at most ``slot_bytes``:

* ``d2h:{i}.{j}``: waits for the gate ``grad:{name}`` (opened by the
  parameter's post-accumulate-grad hook) and copies the piece into a host slot;
* ``acc:{i}.{j}``: on the ``accumulate`` host lane, folds the slot into the
  FP32 accumulator (a widening copy for the first contribution, an add after).
  It also waits for the gate ``prev``: the previous micro-step's execution
  has finished (its accumulations, and a step still writing the masters).

On the final micro-step, per chunk of whole parameters:

* ``norm``: the global gradient norm (``norm_allreduce`` over ranks, when the
  parameters are sharded, after the gate ``reduce``);
* ``step:{k}`` on the ``host_step`` lane: after its parameters' last
  accumulation (and the norm, and the gate ``step``, when the step waits for
  ``step()``), scales and steps the masters and casts them to the compute
  dtype into a host buffer;
* ``h2d:{k}``: copies that buffer into the device weights.

``done`` (a null task) finishes after everything: the next micro-step's
``prev`` gate opens on its completion.

A final micro-step known to be final when it began may **hold** the BF16
gradients of some parameters (``held``, see ``_one_pass.py``): their
``d2h:{i}.{j}`` copies into the optimizer's held buffer (after the gate
``held``: the last step that read it is done), not into a slot, and
``acc:{i}.{j}`` folds nothing (it records that the gradient is held, after its
copy). The gate ``path`` says how the held gradients reach the step: ``norm``
folds them first (the sums and the norm were needed before ``step()``), or each
``step:{k}`` folds them inside its pass and ``norm_pass`` (after every chunk)
adds up the norm the passes took.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from pipeoff import _faults
from pipeoff.graph import TaskContext, TaskGraph, TaskKind
from pipeoff.optim._plan import whole_chunks
from pipeoff.schedule import Schedule

__all__ = ["DONE", "HELD", "NORM", "NORM_ALLREDUCE", "NORM_PASS", "PATH", "PREV", "REDUCE",
           "STEP", "FullWork",
           "MicroStepPlan", "ParamSizes", "grad_gate", "h2d_task", "host_budget",
           "micro_step_graph", "micro_step_schedule", "norm_task", "pieces", "slot_buffer",
           "step_task", "weight_buffer"]

ACCUMULATE_LANE = "accumulate"
STEP_LANE = "host_step"

# The names of a micro-step's gates and tasks: spelled here only.
PREV = "prev"
"""Gate: the previous execution that writes accumulators or masters is done."""
STEP = "step"
"""Gate: ``step()``'s hyperparameters, clipping norm and gradient edits."""
REDUCE = "reduce"
"""Gate: the caller's thread lets the norm's all-reduce go."""
HELD = "held"
"""Gate: the held buffer's last reader (the previous step that held gradients) is done."""
PATH = "path"
"""Gate: how the held gradients reach the step (``_one_pass.FOLD`` or ``ONE_PASS``)."""
NORM = "norm"
NORM_ALLREDUCE = "norm_allreduce"
NORM_PASS = "norm_pass"
DONE = "done"


def grad_gate(name: str) -> str:
    """The gate parameter ``name``'s gradient opens."""
    return f"grad:{name}"


def step_task(k: int) -> str:
    """The task that steps chunk ``k``'s masters."""
    return f"step:{k}"


def h2d_task(k: int) -> str:
    """The task that copies chunk ``k``'s weights to the device."""
    return f"h2d:{k}"


def slot_buffer(i: int, j: int) -> str:
    """The host slot piece ``j`` of parameter ``i``'s gradient lands in."""
    return f"slot:{i}.{j}"


def weight_buffer(k: int) -> str:
    """The host buffer chunk ``k``'s weights are cast into before their copy."""
    return f"w:{k}"


def norm_task(order: Sequence[str], *, one_pass: bool = False) -> str:
    """The task whose end makes the total norm known, in a graph of task ``order``
    (``one_pass``: its held gradients are folded inside the step)."""
    if one_pass:
        return NORM_PASS
    return NORM_ALLREDUCE if NORM_ALLREDUCE in order else NORM


@dataclass(frozen=True, slots=True)
class ParamSizes:
    """What the graph needs of one parameter: its name and sizes."""

    name: str
    """The parameter's name (gate names and errors)."""
    numel: int
    """Elements of its local shard."""
    grad_itemsize: int
    """Bytes per element of the gradient shipped to the host."""
    weight_itemsize: int
    """Bytes per element of the compute weights (the H2D copy)."""


@dataclass(frozen=True, slots=True)
class FullWork:
    """The work of each task kind; the graph binds the indices."""

    d2h: Callable[[int, int, TaskContext], None]
    accumulate: Callable[[int, int, TaskContext], None]
    step: Callable[[int, TaskContext], None]
    h2d: Callable[[int, TaskContext], None]
    norm: Callable[[TaskContext], None]
    allreduce: Callable[[TaskContext], None]
    norm_pass: Callable[[TaskContext], None] | None = None


def host_budget(params: Sequence[ParamSizes], chunks: Sequence[Sequence[int]], *,
                slot_bytes: int, slots: int) -> int:
    """Host staging bytes a micro-step may hold: ``slots`` slots of at most
    ``slot_bytes`` (or of the largest FP32 gradient, if smaller) and two chunks'
    weight buffers."""
    wmax = max((sum(_aligned(params[i].numel * params[i].weight_itemsize) for i in c)
                for c in chunks), default=0)
    slot = min(slot_bytes, max((p.numel * 4 for p in params), default=16))
    return max(16, slots * max(slot, 16) + 2 * wmax)


def pieces(numel: int, itemsize: int, slot_bytes: int) -> list[tuple[int, int]]:
    """``(start, end)`` element ranges of at most ``slot_bytes`` each (one empty
    range for an empty parameter)."""
    per = max(1, slot_bytes // max(1, itemsize))
    if numel == 0:
        return [(0, 0)]
    return [(s, min(s + per, numel)) for s in range(0, numel, per)]


def _bind2(fn: Callable[[int, int, TaskContext], None] | None, i: int,
           j: int) -> Callable[[TaskContext], None] | None:
    return None if fn is None else (lambda ctx: fn(i, j, ctx))


def _bind1(fn: Callable[[int, TaskContext], None] | None,
           k: int) -> Callable[[TaskContext], None] | None:
    return None if fn is None else (lambda ctx: fn(k, ctx))


def micro_step_graph(
    device: torch.device | str | None,
    params: Sequence[ParamSizes],
    chunks: Sequence[Sequence[int]],
    *,
    final: bool,
    slot_bytes: int,
    norm_first: bool = False,
    allreduce: bool = False,
    step_gate: bool = False,
    held: frozenset[int] = frozenset(),
    work: FullWork | None = None,
) -> TaskGraph:
    """The graph of one micro-step (see the module docstring).

    Args:
        device: the device of the compute weights.
        params: the parameters, in ``param_groups`` order.
        chunks: per optimizer chunk, the indices of its parameters.
        final: add the step (``norm``, ``step:{k}``, ``h2d:{k}``).
        slot_bytes: most bytes of one host slot (a larger gradient ships in pieces).
        norm_first: every chunk waits for the global gradient norm (clipping may
            need it); otherwise ``norm`` runs beside the chunks.
        allreduce: add ``norm_allreduce`` (the norm over ranks) after ``norm``; it
            waits for the gate ``reduce``, which the caller's thread opens (and then
            waits for it) so that the collective is issued in program order.
        step_gate: the chunks wait for the gate ``step`` (``step()`` opens it).
        held: the parameters whose gradient a final micro-step holds for its step
            (see the module docstring; needs ``norm_first``).
        work: the callables, or ``None`` for a shape-only graph.
    """
    g = TaskGraph(device)
    g.add_gate(PREV)
    if final and step_gate:
        g.add_gate(STEP)
    held = held if final else frozenset()
    assert not held or norm_first, "held gradients are folded in the norm task first"
    if held:
        g.add_gate(HELD)
        g.add_gate(PATH)
    last_acc: dict[int, str] = {}
    accs: list[str] = []
    copies: list[str] = []
    for i in reversed(range(len(params))):
        p = params[i]
        gate = g.add_gate(grad_gate(p.name))
        for j, (s, e) in enumerate(pieces(p.numel, p.grad_itemsize, slot_bytes)):
            nbytes = (e - s) * p.grad_itemsize
            bufs = ([g.add_buffer(slot_buffer(i, j), nbytes, where="host")]
                    if nbytes and i not in held else [])
            d2h = g.add_task(f"d2h:{i}.{j}", TaskKind.D2H,
                             _bind2(work.d2h if work else None, i, j),
                             gates=[gate, HELD] if i in held else [gate], buffers=bufs,
                             nbytes=nbytes)
            deps = [d2h]
            if i in held:
                copies.append(d2h)
                # Hazard: recording a held gradient as arrived (after which the
                # norm task folds it, or a step chunk steps on it) before its copy
                # into the held buffer has landed.
                deps = [] if _faults.disabled("held_copy_dep") else [d2h]
            if j > 0:
                deps.append(f"acc:{i}.{j - 1}")
            acc = g.add_task(f"acc:{i}.{j}", TaskKind.HOST,
                             _bind2(work.accumulate if work else None, i, j),
                             deps=deps, gates=[gate, PREV], buffers=bufs,
                             nbytes=0 if i in held else (e - s) * 4, lane=ACCUMULATE_LANE)
            accs.append(acc)
            last_acc[i] = acc
    ends = list(accs) + copies
    if final:
        norm = g.add_task(NORM, TaskKind.HOST, work.norm if work else None,
                          deps=accs, lane=STEP_LANE if norm_first else ACCUMULATE_LANE,
                          gates=[PATH] if held else [],
                          nbytes=4 * len(params))
        total = norm
        if allreduce:
            g.add_gate(REDUCE)
            total = g.add_task(NORM_ALLREDUCE, TaskKind.ALLREDUCE,
                               work.allreduce if work else None, deps=[norm],
                               gates=[REDUCE], nbytes=4)
        ends.append(total)
        before_step = [total] if norm_first else []
        for k, chunk in enumerate(chunks):
            wbytes = sum(_aligned(params[i].numel * params[i].weight_itemsize) for i in chunk)
            bufs = [g.add_buffer(weight_buffer(k), wbytes, where="host")] if wbytes else []
            deps = list(before_step)
            if not _faults.disabled("accumulate_dep"):
                # Hazard: stepping a parameter on a gradient sum its last
                # accumulation has not finished writing.
                deps += [last_acc[i] for i in chunk]
            step = g.add_task(step_task(k), TaskKind.HOST, _bind1(work.step if work else None, k),
                              deps=deps, gates=[STEP] if step_gate else [], buffers=bufs,
                              lane=STEP_LANE,
                              # One optimizer element per parameter (the cost
                              # model charges host tasks per 4 bytes).
                              nbytes=sum(params[i].numel for i in chunk) * 4)
            # The weights cross the link unpadded (the buffer's 64-byte alignment stays
            # on the host): what the lane reports moving when every parameter steps.
            moved = sum(params[i].numel * params[i].weight_itemsize for i in chunk)
            h2d = g.add_task(h2d_task(k), TaskKind.H2D, _bind1(work.h2d if work else None, k),
                             deps=[step], buffers=bufs, nbytes=moved)
            ends += [step, h2d]
        if held:
            ends.append(g.add_task(NORM_PASS, TaskKind.HOST,
                                   work.norm_pass if work else None,
                                   deps=[step_task(k) for k in range(len(chunks))] + [total],
                                   gates=[PATH], lane=STEP_LANE, nbytes=4 * len(params)))
    # Without parameters (every one in the device part, ``_device_part.py``) no task
    # waits on the gates the others do: ``done`` does, so that the order holds.
    idle = [] if params else [PREV] + ([STEP] if final and step_gate else [])
    g.add_task(DONE, TaskKind.HOST, None, deps=ends, gates=idle, lane=ACCUMULATE_LANE)
    return g


def _aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to 64, so that each parameter's slice of a buffer is aligned."""
    return -(-nbytes // 64) * 64


def micro_step_schedule(overlap: str, host_budget_bytes: int) -> Schedule:
    """``overlap="none"``: the synchronous schedule (the reference); otherwise every
    lane runs concurrently with host slots and weight buffers within the budget."""
    if overlap == "none":
        return Schedule.synchronous()
    return Schedule.pipelined(host_budget_bytes=host_budget_bytes)


@dataclass(frozen=True, kw_only=True, slots=True)
class MicroStepPlan:
    """The shape of every micro-step of one set of parameters: the one builder of
    their graphs and schedules, for the optimizer and the simulator alike."""

    params: tuple[ParamSizes, ...]
    """The parameters, in ``param_groups`` order."""
    chunks: tuple[tuple[int, ...], ...]
    """Per optimizer chunk in the order the host steps them, its parameters
    (``pipeoff.optim._plan.whole_chunks``, packed from the last parameter)."""
    slot_bytes: int
    """Most bytes of one host slot (a larger gradient ships in pieces)."""
    host_budget_bytes: int
    """Most bytes of host staging live at once (:func:`host_budget`)."""

    @classmethod
    def build(cls, params: Sequence[ParamSizes], *, chunk_numel: int, slot_bytes: int,
              slots: int, forward_order: bool = False) -> MicroStepPlan:
        """Chunks of at most ``chunk_numel`` elements, ``slots`` host slots of ``slot_bytes``.

        The chunks are packed from the last parameter (the backward finishes it
        first) and stepped in that order, or with ``forward_order`` the other way
        round: the first parameters' chunk first, so that the next forward's first
        modules wait for their own chunk only, not for the whole host step
        (``overlap="forward"`` and ``"none"``; ``overlap="backward"`` steps each chunk
        as its gradients arrive, last parameter first)."""
        chunks = whole_chunks([p.numel for p in params], chunk_numel, last_first=True)
        if forward_order:
            chunks = chunks[::-1]
        return cls(params=tuple(params), chunks=chunks,
                   slot_bytes=slot_bytes,
                   host_budget_bytes=host_budget(params, chunks, slot_bytes=slot_bytes,
                                                 slots=slots))

    def chunks_of(self) -> tuple[tuple[int, ...], ...]:
        """Per parameter, the chunk (one) that steps it."""
        out: list[tuple[int, ...]] = [(0,)] * len(self.params)
        for k, chunk in enumerate(self.chunks):
            for i in chunk:
                out[i] = (k,)
        return tuple(out)

    def graph(self, device: torch.device | str | None, *, final: bool, norm_first: bool = False,
              allreduce: bool = False, step_gate: bool = False,
              grad_itemsize: Mapping[int, int] | None = None,
              held: frozenset[int] = frozenset(),
              work: FullWork | None = None) -> TaskGraph:
        """The graph of one micro-step (:func:`micro_step_graph`); ``grad_itemsize``
        overrides the bytes per gradient element of some parameters (the FP32 sums a
        final micro-step ships under ``accumulate="gpu"``)."""
        params = self.params
        if grad_itemsize:
            params = tuple(
                dataclasses.replace(p, grad_itemsize=grad_itemsize.get(i, p.grad_itemsize))
                for i, p in enumerate(params))
        return micro_step_graph(device, params, self.chunks, final=final,
                                slot_bytes=self.slot_bytes, norm_first=norm_first,
                                allreduce=allreduce, step_gate=step_gate, held=held,
                                work=work)

    def schedule(self, overlap: str) -> Schedule:
        """The schedule of every micro-step (:func:`micro_step_schedule`)."""
        return micro_step_schedule(overlap, self.host_budget_bytes)
