"""The shape of an offloaded DiLoCo fragment sync's task graph, with or without the work.

One builder serves :class:`~pipeoff.ft.DiLoCo` (with each task's work) and the
simulator (shape only), so a simulated sync has exactly the tasks, bytes,
buffers and dependencies of a real one.

A sync is one execution from ``prepare_sync`` to the end of ``perform_sync``:

* per bucket ``k`` (the fragment's local tensors packed by
  :func:`~pipeoff.ft._buckets.plan_buckets`), in device staging ``device:b{k}``:
  ``pseudograd:b{k}`` copies the backup's slices in (host to device) and
  subtracts the local parameters (torchft's ``original - local``);
  ``allreduce:b{k}`` averages the bucket over the replica groups (``must_run``:
  peers wait for it); ``d2h:b{k}`` stages the average in the host
  pseudo-gradients;
* ``formed`` (null) once every pseudo-gradient is formed: after it, nothing of
  the sync reads the parameters until the commit, so the caller may write them;
* with ``form_first`` (a sync whose decision comes ``fragment_sync_delay``
  steps later, pipelined): the formation does not wait for the all-reduces.
  ``stage:b{k}`` copies each formed bucket to the host pseudo-gradients (its
  device staging is free again), and ``upload:b{k}`` copies it back into
  staging ``r:b{k}`` for its all-reduce. The formation (the ``pseudograd:b{k}``
  tasks, which ``prepare_sync`` waits for before anything may write the
  parameters again) then ends after a pass over the link, not after the
  averaging (one more pass each way over the link, in exchange); ``formed``
  marks it on the trace;
* ``staged`` (null) once every average is on the host; ``perform_sync`` calls
  ``should_commit()`` then, and opens the gate ``commit`` with the decision;
* per chunk ``c`` of whole parameters, ``outer:c{c}`` on the ``outer_step`` host
  lane: the outer optimizer's step on the host backup (the new global
  parameters) and its host state, if committed;
* per bucket ``k``, ``write:b{k}`` through device staging ``w:b{k}``: the new
  global parameters merged with the local ones (``lerp`` by
  ``fragment_update_alpha``, torchft's ``_merge_parameters``) into the
  parameters if committed; the backup (torchft's ``restore_parameters``) if not.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pipeoff.ft._buckets import Bucket
from pipeoff.graph import TaskContext, TaskGraph, TaskKind
from pipeoff.schedule import Schedule

__all__ = ["OUTER_LANE", "DiLoCoWork", "diloco_graph", "diloco_schedule"]

OUTER_LANE = "outer_step"
Work = Callable[[TaskContext], Any]


@dataclass(frozen=True, kw_only=True, slots=True)
class DiLoCoWork:
    """The work of a sync's tasks (see the module docstring)."""

    pseudograd: Callable[[int, Bucket, str], Work]
    """``(k, bucket, device buffer)``: form bucket ``k``'s pseudo-gradients."""
    allreduce: Callable[[int, Bucket, str], Work]
    """``(k, bucket, device buffer)``: average them over the replica groups."""
    d2h: Callable[[int, Bucket, str], Work]
    """``(k, bucket, device buffer)``: stage the average in the host pseudo-gradients."""
    stage: Callable[[int, Bucket, str], Work] | None = None
    """``form_first``: ``(k, bucket, device buffer)``: the formed bucket to the host."""
    upload: Callable[[int, Bucket, str], Work] | None = None
    """``form_first``: ``(k, bucket, device buffer)``: the formed bucket back into staging
    for its all-reduce."""
    outer: Callable[[int, Sequence[int]], Work]
    """``(c, parameter indices)``: the outer step of chunk ``c``, if committed."""
    write: Callable[[int, Bucket, str], Work]
    """``(k, bucket, device buffer)``: merge (committed) or restore (rejected)."""
    keep: Callable[[], Work] | None = None
    """``speculative``: keep the outer step's spares (committed), or drop them."""


def diloco_graph(buckets: Sequence[Bucket], chunks: Sequence[Sequence[int]],
                 device: torch.device | str | None, work: DiLoCoWork | None = None, *,
                 form_first: bool = False, decided_after: Sequence[str] = (),
                 speculative: bool = False) -> TaskGraph:
    """The graph of one fragment sync (see the module docstring); shape-only without
    ``work``. ``decided_after``: tasks (added later, by the simulator) that the
    decision comes after: the training loop's steps until ``perform_sync``, which
    the gate ``commit`` stands for in a real sync. ``speculative``: the outer step
    runs before the decision, into spares (``_outer_spec.py``); ``keep`` keeps them
    after it, and the writes wait for ``keep``."""
    g = TaskGraph(device=device)
    g.add_gate("commit")
    formed, staged = [], []

    def averaged(k: int, b: Bucket, dev: str, after: str) -> None:
        g.add_task(f"allreduce:b{k}", TaskKind.ALLREDUCE,
                   work.allreduce(k, b, dev) if work else None,
                   deps=[after], buffers=[dev], nbytes=b.nbytes, must_run=True)
        staged.append(g.add_task(f"d2h:b{k}", TaskKind.D2H,
                                 work.d2h(k, b, dev) if work else None,
                                 deps=[f"allreduce:b{k}"], buffers=[dev], nbytes=b.nbytes))

    # Tasks are issued in the order they are added, within the budget: bucket by bucket,
    # or with form_first every formation before any all-reduce.
    for k, b in enumerate(buckets):
        dev = g.add_buffer(f"device:b{k}", b.nbytes, where="device")
        formed.append(g.add_task(f"pseudograd:b{k}", TaskKind.H2D,
                                 work.pseudograd(k, b, dev) if work else None,
                                 buffers=[dev], nbytes=b.nbytes))
        if not form_first:
            averaged(k, b, dev, formed[-1])
            continue
        assert work is None or work.stage is not None
        formed[-1] = g.add_task(f"stage:b{k}", TaskKind.D2H,
                                work.stage(k, b, dev) if work and work.stage else None,
                                deps=[f"pseudograd:b{k}"], buffers=[dev], nbytes=b.nbytes)
    for k, b in enumerate(buckets if form_first else ()):
        r = g.add_buffer(f"r:b{k}", b.nbytes, where="device")
        averaged(k, b, r, g.add_task(f"upload:b{k}", TaskKind.H2D,
                                     work.upload(k, b, r) if work and work.upload else None,
                                     deps=[f"stage:b{k}"], buffers=[r], nbytes=b.nbytes))
    g.add_task("formed", TaskKind.HOST, None, deps=formed)
    g.add_task("staged", TaskKind.HOST, None, deps=staged)
    chunk_of = {i: c for c, chunk in enumerate(chunks) for i in chunk}
    for c, chunk in enumerate(chunks):
        nbytes = sum(pc.numel * b.nbytes // max(b.numel, 1)
                     for b in buckets for pc in b.pieces if pc.param in chunk)
        # Hazard: stepping on a pseudo-gradient whose average has not landed in
        # host staging, or (in place) before the quorum's decision (the gate).
        g.add_task(f"outer:c{c}", TaskKind.HOST, work.outer(c, chunk) if work else None,
                   deps=["staged"] if speculative else ["staged", *decided_after],
                   gates=() if speculative else ["commit"], lane=OUTER_LANE, nbytes=nbytes)
    if speculative:
        g.add_task("stepped", TaskKind.HOST, None,
                   deps=[f"outer:c{c}" for c in range(len(chunks))])
        # Hazard: keeping spares that a speculative step is still writing (on the
        # outer lane after every outer task, the lane's order makes it so too).
        g.add_task("keep", TaskKind.HOST, work.keep() if work and work.keep else None,
                   deps=["stepped", *decided_after], gates=["commit"], lane=OUTER_LANE)
    for k, b in enumerate(buckets):
        w = g.add_buffer(f"w:b{k}", b.nbytes, where="device")
        # Hazard: writing a parameter before its new global value (the outer
        # step on the host backup) is complete.
        deps = (["keep"] if speculative else
                sorted({f"outer:c{chunk_of[pc.param]}" for pc in b.pieces})) + list(decided_after)
        g.add_task(f"write:b{k}", TaskKind.H2D, work.write(k, b, w) if work else None,
                   deps=deps, gates=["commit"], buffers=[w], nbytes=b.nbytes)
    return g


def diloco_schedule(buckets: Sequence[Bucket], *, pipelined: bool,
                    device_budget_bytes: int | None) -> Schedule:
    """Pipelined within ``device_budget_bytes`` (no budget: the largest bucket), or the
    synchronous schedule: one task at a time."""
    if not pipelined:
        return Schedule.synchronous()
    budget = device_budget_bytes
    if budget is None and buckets:
        budget = max(b.nbytes for b in buckets)
    return Schedule.pipelined(device_budget_bytes=budget)
