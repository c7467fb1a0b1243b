"""The shape of an offloaded LocalSGD sync's task graph, with or without the work.

One builder serves :class:`~pipeoff.ft.LocalSGD` (with each task's work) and
the simulator (shape only), so a simulated sync has exactly the tasks, bytes,
buffers and dependencies of a real one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pipeoff.ft._buckets import Bucket
from pipeoff.graph import TaskContext, TaskGraph, TaskKind
from pipeoff.schedule import Schedule

__all__ = ["SyncWork", "sync_graph", "sync_schedule"]

Work = Callable[[TaskContext], Any]


@dataclass(frozen=True, kw_only=True, slots=True)
class SyncWork:
    """The work of a sync's tasks (see :func:`sync_graph`)."""

    allreduce: Callable[[int, Bucket, str], Work]
    """``(k, bucket, device buffer)``: average bucket ``k`` in the device buffer."""
    d2h: Callable[[int, Bucket, str, str], Work]
    """``(k, bucket, device buffer, host buffer)``: stage the average on the host."""
    decide: Work
    """``should_commit``: returns whether the quorum commits."""
    h2d: Callable[[int, Bucket, str], Work]
    """``(k, bucket, host buffer)``: write the average back, if committed."""


def sync_graph(buckets: Sequence[Bucket], device: torch.device | str | None,
               work: SyncWork | None = None) -> TaskGraph:
    """Per bucket ``allreduce:b{k}`` (on ``device:b{k}``; ``must_run``: peers wait for
    it) then ``d2h:b{k}`` (into pinned ``host:b{k}``); ``should_commit`` once every
    bucket is on the host; then ``h2d:b{k}`` writes each back. Without ``work`` the
    graph is shape-only."""
    g = TaskGraph(device=device)
    copied = []
    for k, b in enumerate(buckets):
        dev = g.add_buffer(f"device:b{k}", b.nbytes, where="device")
        host = g.add_buffer(f"host:b{k}", b.nbytes, where="host")
        g.add_task(f"allreduce:b{k}", TaskKind.ALLREDUCE,
                   work.allreduce(k, b, dev) if work else None, buffers=[dev],
                   nbytes=b.nbytes, must_run=True)
        g.add_task(f"d2h:b{k}", TaskKind.D2H, work.d2h(k, b, dev, host) if work else None,
                   deps=[f"allreduce:b{k}"], buffers=[dev, host], nbytes=b.nbytes)
        copied.append(f"d2h:b{k}")
    g.add_task("should_commit", TaskKind.HOST, work.decide if work else None, deps=copied)
    for k, b in enumerate(buckets):
        host = f"host:b{k}"
        g.add_task(f"h2d:b{k}", TaskKind.H2D, work.h2d(k, b, host) if work else None,
                   deps=["should_commit"], buffers=[host], nbytes=b.nbytes)
    return g


def sync_schedule(buckets: Sequence[Bucket], *, pipelined: bool,
                  device_budget_bytes: int | None) -> Schedule:
    """Pipelined within ``device_budget_bytes`` (one bucket per parameter and no
    budget: the RFC's bound M, the largest bucket), or RFC 0003's synchronous path."""
    if not pipelined:
        return Schedule.synchronous()
    budget = device_budget_bytes
    if budget is None and buckets:
        budget = max(b.nbytes for b in buckets)
    return Schedule.pipelined(device_budget_bytes=budget)
