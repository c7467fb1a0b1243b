"""The shape of an offload-optimizer step's task graph, with or without the work.

One builder serves the optimizer (with each task's work) and the simulator
(shape only, ``work=None``: a 70B model is a list of sizes), so a simulated
step has exactly the tasks, bytes, buffers and dependencies of a real one.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pipeoff.graph import TaskContext, TaskGraph, TaskKind
from pipeoff.optim._plan import ChunkPlan, Segment
from pipeoff.schedule import Schedule

__all__ = ["ChunkTasks", "chunk_tasks", "offload_step", "step_graph", "step_schedule"]

Work = Callable[[TaskContext], Any]


@dataclass(frozen=True, kw_only=True, slots=True)
class ChunkTasks:
    """The sizes of one chunk's ``h2d{k}`` -> ``opt{k}`` -> ``d2h{k}`` tasks."""

    index: int
    staging_bytes: int
    """Device staging for the chunk's state; 0: no buffer, so no copies either."""
    h2d_bytes: int
    """State bytes staged in (the keys that exist; none on a first step)."""
    update_bytes: int
    """Parameter bytes the update reads and writes."""
    d2h_bytes: int
    """State bytes copied back (every key)."""
    segments: tuple[tuple[Segment, int, int], ...]
    """``(segment, lo, hi)``: the slices updated, clipped to the local shard."""


def chunk_tasks(plan: ChunkPlan, *, itemsize: Sequence[int], nkeys: Sequence[int],
                local_numel: Sequence[int], present: Sequence[int],
                updated: Container[int]) -> list[ChunkTasks]:
    """The chunks' task sizes for one step.

    Args:
        plan: the step's chunk plan.
        itemsize: per parameter, bytes per element.
        nkeys: per parameter, the per-element state tensors (2 for AdamW).
        local_numel: per parameter, the elements of its local shard (segments are
            planned for the largest shard and clipped to it).
        present: per parameter, the state tensors that exist already.
        updated: the parameters with a gradient this step.
    """
    out = []
    for chunk in plan.chunks:
        segs = []
        for s in chunk.segments:
            if s.param not in updated:
                continue
            n = local_numel[s.param]
            segs.append((s, min(s.lo, n), min(s.hi, n)))
        size = [(hi - lo) * itemsize[s.param] for s, lo, hi in segs]
        out.append(ChunkTasks(
            index=chunk.index,
            staging_bytes=chunk.nbytes if chunk.nbytes and segs else 0,
            h2d_bytes=sum(present[s.param] * b for (s, _, _), b in zip(segs, size)),
            update_bytes=sum(size),
            d2h_bytes=sum(nkeys[s.param] * b for (s, _, _), b in zip(segs, size)),
            segments=tuple(segs),
        ))
    return out


def step_graph(device: torch.device | str | None, chunks: Sequence[ChunkTasks],
               work: Callable[[ChunkTasks, str | None], tuple[Work | None, Work | None,
                                                              Work | None]] | None = None,
               ) -> TaskGraph:
    """The step's graph: per chunk ``h2d{k}`` (stage state in), ``opt{k}`` (update),
    ``d2h{k}`` (state back) on buffer ``state{k}``; a chunk without staging is
    only ``opt{k}``. ``work(chunk, buffer)`` gives the three tasks' work;
    without it the graph is shape-only."""
    graph = TaskGraph(device=device)
    for c in chunks:
        k = c.index
        buf = graph.add_buffer(f"state{k}", c.staging_bytes) if c.staging_bytes else None
        h2d, opt, d2h = work(c, buf) if work is not None else (None, None, None)
        deps: list[str] = []
        if buf is not None:
            graph.add_task(f"h2d{k}", TaskKind.H2D, h2d, buffers=[buf], nbytes=c.h2d_bytes)
            deps = [f"h2d{k}"]
        graph.add_task(f"opt{k}", TaskKind.OPTIMIZER_CHUNK, opt if c.segments else None,
                       deps=deps, buffers=[buf] if buf else [], nbytes=c.update_bytes)
        if buf is not None:
            graph.add_task(f"d2h{k}", TaskKind.D2H, d2h, deps=[f"opt{k}"], buffers=[buf],
                           nbytes=c.d2h_bytes)
    return graph


def step_schedule(plan: ChunkPlan, prefetch: int | None,
                  budget: int | None = None) -> Schedule:
    """Pipelined, with device staging bounded by ``budget`` if given, else by
    ``prefetch + 1`` of the largest chunk."""
    if budget is None and plan.chunk_bytes is not None and plan.max_chunk_bytes:
        budget = ((2 if prefetch is None else prefetch) + 1) * plan.max_chunk_bytes
    return Schedule.pipelined(device_budget_bytes=budget)


def offload_step(device: torch.device | str | None, plan: ChunkPlan, *,
                 itemsize: Sequence[int], nkeys: Sequence[int], local_numel: Sequence[int],
                 present: Sequence[int], updated: Container[int], prefetch: int | None,
                 budget: int | None = None,
                 work: Callable[[ChunkTasks, str | None], tuple[Work | None, Work | None,
                                                                Work | None]] | None = None,
                 ) -> tuple[TaskGraph, Schedule]:
    """The graph and schedule of one offload-optimizer step: the one builder the
    optimizer (``work`` given), its ``reserve()`` and the simulator (shape only) share.
    Arguments as :func:`chunk_tasks`, :func:`step_graph` and :func:`step_schedule`."""
    chunks = chunk_tasks(plan, itemsize=itemsize, nkeys=nkeys, local_numel=local_numel,
                         present=present, updated=updated)
    return step_graph(device, chunks, work), step_schedule(plan, prefetch, budget)
