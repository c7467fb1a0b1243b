"""The task graph of one rank's part of a state transfer, with or without the work.

One builder serves :class:`~pipeoff.transfer.StateTransfer` (with work) and the
simulator (shape only), so a simulated transfer has exactly the tasks, bytes,
buffers and dependencies of a real one.

Per round ``r`` (all ranks have the same rounds):

* ``pack{r}:<lane>``: copies the runs this rank sends into its send buffer
  ``send{r}`` (on the wire's memory: host for gloo, device for NCCL), casting
  on the way; one task per copy direction (lane ``host``, ``d2h``, ``h2d``,
  ``d2d``);
* ``exchange{r}``: joins the round's collective: a fault flag first, then the
  all-to-all of ``send{r}`` into ``recv{r}``. Only rounds that send between ranks
  have one, and every rank joins it (``must_run``): it runs even after a local
  failure, carrying the flag, so that peers never wait for it. The exchanges
  form a chain, so the collectives' order is the same on every rank;
* ``unpack{r}:<lane>``: copies the received runs into the targets;
* ``copy{r}:<lane>``: copies the local runs (source and target on this rank)
  directly, without staging.

``preflight`` comes first (every pack and copy waits for it) and ``verdict``
last (``must_run``: it joins the final collective that tells every rank
whether any rank failed).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from pipeoff.graph import TaskContext, TaskGraph, TaskKind, Where
from pipeoff.transfer._plan import Run, TransferPlan

__all__ = ["Phase", "copy_lane", "transfer_graph"]

Work = Callable[[TaskContext], Any]
Phase = str  # "pack", "unpack" or "copy"
MakeWork = Callable[[str, int, Sequence[Run], str | None], Work]
"""``(phase, round, runs, buffer)`` -> the work of one copy task."""

_LANES: dict[tuple[str, str], tuple[TaskKind, str]] = {
    ("host", "host"): (TaskKind.HOST, "host"),
    ("device", "host"): (TaskKind.D2H, "d2h"),
    ("host", "device"): (TaskKind.H2D, "h2d"),
    # A copy within device memory: stream work like an H2D, on a lane of its own.
    ("device", "device"): (TaskKind.H2D, "d2d"),
}


def copy_lane(src: str, dst: str) -> tuple[TaskKind, str]:
    """The task kind and lane of a copy from ``src`` to ``dst`` memory (``"host"`` or
    ``"device"``)."""
    return _LANES[(src, dst)]


def transfer_graph(plan: TransferPlan, rank: int, *, src_where: Mapping[str, str],
                   dst_where: Mapping[str, str], wire: str, device: torch.device | str | None,
                   preflight: Work | None = None, exchange: Callable[[int], Work] | None = None,
                   verdict: Work | None = None, copy: MakeWork | None = None) -> TaskGraph:
    """Rank ``rank``'s graph for ``plan``; ``src_where`` / ``dst_where`` give each key's
    memory (``"host"`` or ``"device"``) on this rank. Without the work callables the
    graph is shape-only."""
    g = TaskGraph(device=device)
    g.add_task("preflight", TaskKind.HOST, preflight)
    ends: list[str] = []
    prev_exchange: str | None = None
    for r, runs in enumerate(plan.rounds):
        send_n, recv_n = plan.send_bytes(r, rank), plan.recv_bytes(r, rank)
        where: Where = "device" if wire == "device" else "host"
        send = g.add_buffer(f"send{r}", send_n, where=where) if send_n else None
        recv = g.add_buffer(f"recv{r}", recv_n, where=where) if recv_n else None
        packs = _copies(g, "pack", r, [u for u in runs if u.src == rank != u.dst],
                        lambda u: (src_where[u.key], wire), send, ["preflight"], copy)
        if plan.exchanges(r):
            deps = ["preflight", *packs] + ([prev_exchange] if prev_exchange else [])
            # A host wire (gloo) is read and written by the host inside the
            # collective: a host task, whose start synchronizes the packs' copies.
            kind = TaskKind.HOST if wire == "host" else TaskKind.ALLREDUCE
            prev_exchange = g.add_task(
                f"exchange{r}", kind, exchange(r) if exchange else None, deps=deps,
                buffers=[b for b in (send, recv) if b], lane="comm", must_run=True,
                nbytes=send_n + recv_n)
            ends += [prev_exchange]
        ends += _copies(g, "unpack", r, [u for u in runs if u.dst == rank != u.src],
                        lambda u: (wire, dst_where[u.key]), recv,
                        [prev_exchange] if prev_exchange else ["preflight"], copy)
        ends += _copies(g, "copy", r, [u for u in runs if u.src == rank == u.dst],
                        lambda u: (src_where[u.key], dst_where[u.key]), None, ["preflight"],
                        copy)
    g.add_task("verdict", TaskKind.HOST, verdict, deps=["preflight", *ends], must_run=True)
    return g


def _copies(g: TaskGraph, phase: str, r: int, runs: list[Run],
            where: Callable[[Run], tuple[str, str]], buffer: str | None, deps: list[str],
            copy: MakeWork | None) -> list[str]:
    """One task per copy direction of ``runs``; returns their names."""
    by_lane: dict[tuple[TaskKind, str], list[Run]] = {}
    for u in runs:
        by_lane.setdefault(copy_lane(*where(u)), []).append(u)
    names = []
    for (kind, lane), group in by_lane.items():
        # A pack copies a region sent to several ranks from its source once (the rest
        # are copies on the wire's side): the bytes that cross are the distinct ones.
        moved = ({(u.key, u.lo, u.size, u.dtype): u.nbytes for u in group} if phase == "pack" else
                 {i: u.nbytes for i, u in enumerate(group)})
        names.append(g.add_task(
            f"{phase}{r}:{lane}", kind, copy(phase, r, group, buffer) if copy else None,
            deps=deps, buffers=[buffer] if buffer else [], lane=lane,
            nbytes=sum(moved.values())))
    return names
