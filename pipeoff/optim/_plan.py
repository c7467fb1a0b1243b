"""Chunk plans: how an optimizer's flat parameter space is cut into bounded chunks.

A plan is a pure function of global shapes, dtypes, placements and the
optimizer's state layout, so every rank computes the same plan whatever its
local shard holds, and whichever parameters have gradients this step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pipeoff._errors import ConfigError, PlanMismatchError
from pipeoff._validate import check_int

__all__ = ["Chunk", "ChunkPlan", "ParamMeta", "Segment", "plan_chunks", "planned_numel",
           "whole_chunks"]

SLOT_ALIGN_BYTES = 16
"""Each state slot in a chunk's staging buffer starts at a multiple of this."""


def _round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k


@dataclass(frozen=True, kw_only=True, slots=True)
class ParamMeta:
    """What the planner needs to know of one parameter."""

    numel: int
    """Planned local elements: the largest local shard over ranks (ceil per sharded dim)."""
    itemsize: int
    """Bytes per element of the parameter (and of its per-element state)."""
    nkeys: int
    """How many per-element state tensors the optimizer keeps for it (2 for AdamW)."""
    group: int
    """Index of its param group in the wrapped optimizer."""
    align: int = 1
    """Split this parameter only at multiples of this many elements (at least the
    plan's ``align``): a kernel vectorized from a tensor's start rounds its body and
    its scalar tail differently for 16-bit dtypes on CPU, so slices must start
    where the whole tensor's vector lanes do."""

    def __post_init__(self) -> None:
        if (self.numel < 0 or self.itemsize <= 0 or self.nkeys < 0 or self.group < 0
                or self.align <= 0):
            raise ConfigError(f"invalid parameter metadata {self!r}")

    def slot_bytes(self, elems: int) -> int:
        """Staging bytes of one state slot holding ``elems`` elements."""
        return _round_up(elems * self.itemsize, SLOT_ALIGN_BYTES)

    def segment_bytes(self, elems: int) -> int:
        """Staging bytes of a segment of ``elems`` elements (every state key)."""
        return self.nkeys * self.slot_bytes(elems)


@dataclass(frozen=True, kw_only=True, slots=True)
class Segment:
    """A flat slice ``[lo, hi)`` of one parameter's local elements, staged at ``offset``."""

    param: int
    """Index of the parameter in the wrapped optimizer's parameter order."""
    lo: int
    """First element (planned coordinates; clipped to the local shard at run time)."""
    hi: int
    """One past the last element."""
    offset: int
    """Byte offset of the segment's first state slot in the chunk's staging buffer."""
    slot_bytes: int
    """Bytes of each state slot; state key ``j`` starts at ``offset + j * slot_bytes``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Chunk:
    """The unit of one H2D -> update -> D2H round trip."""

    index: int
    """Position in the plan."""
    segments: tuple[Segment, ...]
    """The parameter slices it updates, in parameter order."""
    nbytes: int
    """Bytes of device staging it needs for optimizer state (0 for state-less optimizers)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ChunkPlan:
    """How one optimizer step is cut into chunks. Identical on every rank."""

    chunks: tuple[Chunk, ...]
    """The chunks in execution order."""
    chunk_bytes: int | None
    """The bound each chunk's staging respects, or ``None`` for a single chunk."""
    align: int
    """Parameters are split only at multiples of this many elements."""

    @property
    def max_chunk_bytes(self) -> int:
        """The largest chunk's staging bytes."""
        return max((c.nbytes for c in self.chunks), default=0)

    def signature(self) -> tuple[int, ...]:
        """Number of chunks, then each chunk's staging bytes and segment count."""
        out = [len(self.chunks)]
        for c in self.chunks:
            out += [c.nbytes, len(c.segments)]
        return tuple(out)

    def chunks_of(self, param: int) -> tuple[int, ...]:
        """Indices of the chunks that hold parameter ``param``."""
        return tuple(c.index for c in self.chunks if any(s.param == param for s in c.segments))


def planned_numel(p: torch.Tensor) -> int:
    """Local elements planned for ``p``: for a DTensor, the largest shard over ranks.

    Each sharded dimension is divided by its mesh dimension's size, rounded up,
    so that (3, 1000) sharded ``Shard(0)`` over 2 ranks plans 2000 elements on
    every rank (rank 1 holds only 1000).
    """
    placements = getattr(p, "placements", None)
    mesh = getattr(p, "device_mesh", None)
    if placements is None or mesh is None:
        return p.numel()
    shape = list(p.shape)
    for mesh_dim, pl in enumerate(placements):
        dim = getattr(pl, "dim", None)
        if dim is not None and pl.is_shard():
            shape[dim] = math.ceil(shape[dim] / mesh.size(mesh_dim))
    return math.prod(shape)


def plan_chunks(
    params: Sequence[ParamMeta], chunk_bytes: int | None, *, align: int = 1
) -> ChunkPlan:
    """Cut ``params`` (in order) into chunks of at most ``chunk_bytes`` of state.

    A parameter whose state exceeds the room left is split into flat slices at
    multiples of ``align`` elements. A chunk always holds at least ``align``
    elements, so a bound smaller than one element's state gives one unit per chunk.

    Args:
        params: the parameters, in the wrapped optimizer's order.
        chunk_bytes: staging bound per chunk, or ``None`` for one chunk.
        align: split granularity in elements (128 keeps fused kernels bitwise).

    Returns:
        The :class:`ChunkPlan`.

    Raises:
        ConfigError: ``chunk_bytes`` or ``align`` is not a positive int.
    """
    check_int("chunk_bytes", chunk_bytes, optional=True)
    check_int("align", align)
    cap = math.inf if chunk_bytes is None else chunk_bytes
    chunks: list[Chunk] = []
    cur: list[Segment] = []
    used = 0  # bytes counted against the bound
    staged = 0  # staging bytes laid out so far

    def flush() -> None:
        nonlocal cur, used, staged
        if cur:
            chunks.append(Chunk(index=len(chunks), segments=tuple(cur), nbytes=staged))
        cur, used, staged = [], 0, 0

    for i, m in enumerate(params):
        if m.numel == 0:
            cur.append(Segment(param=i, lo=0, hi=0, offset=staged, slot_bytes=0))
            continue
        # State-less optimizers (plain SGD) are still chunked, by parameter bytes.
        per_elem = m.nkeys * m.itemsize or m.itemsize
        unit = max(align, m.align)
        lo = 0
        while lo < m.numel:
            rest = m.numel - lo
            take = rest
            if _bytes(m, take) + used > cap:
                room = cap - used
                fit = int(room // per_elem) // unit * unit
                while fit > 0 and _bytes(m, fit) > room:  # slot padding
                    fit -= unit
                if fit <= 0:
                    if cur:
                        flush()
                        continue
                    fit = unit  # the smallest unit: one per chunk
                take = min(fit, rest)
            cur.append(Segment(param=i, lo=lo, hi=lo + take, offset=staged,
                               slot_bytes=m.slot_bytes(take) if m.nkeys else 0))
            used += _bytes(m, take)
            staged += m.segment_bytes(take)
            lo += take
            if used >= cap or lo < m.numel:
                flush()
    flush()
    return ChunkPlan(chunks=tuple(chunks), chunk_bytes=chunk_bytes, align=align)


def _bytes(m: ParamMeta, elems: int) -> int:
    return m.segment_bytes(elems) if m.nkeys else elems * m.itemsize


def verify_plan(plan: ChunkPlan, group: object = None) -> None:
    """Check collectively that every rank of ``group`` holds the same plan.

    Does nothing unless torch.distributed is initialized. Every rank raises
    the same :class:`PlanMismatchError` on a mismatch, before anything is written.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    mine = plan.signature()
    world = dist.get_world_size(group)  # type: ignore[arg-type]
    sigs: list[object] = [None] * world
    dist.all_gather_object(sigs, mine, group=group)  # type: ignore[arg-type]
    if any(s != sigs[0] for s in sigs):
        counts = [s[0] if isinstance(s, tuple) and s else None for s in sigs]
        raise PlanMismatchError(
            "ranks disagree on the optimizer chunk plan (chunks per rank: "
            f"{counts}); every rank must wrap the same parameters with the same "
            "optimizer, chunk_bytes, offload_fraction and param groups"
        )


def whole_chunks(sizes: Sequence[int], bound: int | None, *,
                 last_first: bool = False) -> tuple[tuple[int, ...], ...]:
    """Whole items (indices into ``sizes``) packed greedily, in order, into chunks whose
    sizes sum to at most ``bound``; an item larger than ``bound`` is a chunk of its own,
    ``None`` gives one item per chunk. ``last_first``: the last item first (the order a
    backward finishes parameters in). Full offload's optimizer chunks (sizes in
    elements) and DiLoCo's outer-step chunks (in bytes) both come from here. (Unlike
    :func:`plan_chunks`, which cuts the flat parameter space into slices by bytes of
    state.)"""
    chunks: list[tuple[int, ...]] = []
    cur: list[int] = []
    total = 0
    order = reversed(range(len(sizes))) if last_first else range(len(sizes))
    for i in order:
        if cur and (bound is None or total + sizes[i] > bound):
            chunks.append(tuple(cur))
            cur, total = [], 0
        cur.append(i)
        total += sizes[i]
    if cur:
        chunks.append(tuple(cur))
    return tuple(chunks)
