"""Planning a state transfer: exact coverage by interval arithmetic, then runs packed into rounds.

A pure function of what every rank declared (gathered by the preflight), so
every rank computes the same plan, or the same refusal, without talking.

Geometry: each piece is a box of the key's global index space, ``offsets`` and
``sizes`` per dimension. Coverage is checked per dimension on intervals: source
boxes must be pairwise disjoint (byte-identical replicas excepted, which must
have identical boxes), and the disjoint boxes must tile every target box. A
count of elements alone would accept a gap and an overlap of the same size
(torchstore's routing admits this in a comment); here the overlap is found by
intersecting intervals, and the gap is located by a sweep over the cut points.
"""

from __future__ import annotations

import fnmatch
import hashlib
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["ALIGN", "Piece", "PlanRefusal", "Run", "TransferPlan", "plan_transfer"]

ALIGN = 16
"""Every run starts at a multiple of this many bytes in a wire buffer (any dtype's
element size divides it), so that its bytes can be viewed as the run's dtype."""

Box = tuple[tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True, slots=True)
class Piece:
    """What one rank declared of one key: a box of the key's global index space."""

    key: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    dtype: torch.dtype
    replica: bool = False
    """Other ranks hold a byte-identical copy of this box (a ``Replicate`` placement)."""


@dataclass(frozen=True, slots=True)
class Run:
    """One box of one key copied from rank ``src`` to rank ``dst`` in one round."""

    key: str
    src: int
    dst: int
    lo: tuple[int, ...]
    """The run's box in global coordinates: its first index ..."""
    size: tuple[int, ...]
    """... and its extent per dimension."""
    dtype: torch.dtype
    """The dtype on the wire and in the target (a declared cast happens when packing)."""
    offset: int
    """Byte offset in the ``src -> dst`` segment of the round's wire buffers (``-1``:
    a local run, copied directly)."""

    @property
    def numel(self) -> int:
        return math.prod(self.size)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


class PlanRefusal(Exception):  # noqa: N818 - internal: the preflight turns it into a refusal
    """The declared pieces cannot be transferred; ``problems`` are ``(rank, key, reason)``."""

    def __init__(self, problems: list[tuple[int, str, str]]) -> None:
        super().__init__(problems)
        self.problems = problems


@dataclass(frozen=True, kw_only=True, slots=True)
class TransferPlan:
    """Rounds of runs, identical on every rank. Build it with :func:`plan_transfer`."""

    world: int
    """Ranks taking part."""
    rounds: tuple[tuple[Run, ...], ...]
    """Per round, its runs (local and remote)."""
    segments: tuple[tuple[tuple[int, ...], ...], ...]
    """Per round, ``segments[r][src][dst]``: bytes of the ``src -> dst`` segment of the
    wire (aligned; ``0`` on the diagonal: local runs are not sent)."""

    def send_bytes(self, r: int, rank: int) -> int:
        """Bytes ``rank`` sends in round ``r``: its send buffer."""
        return sum(self.segments[r][rank])

    def recv_bytes(self, r: int, rank: int) -> int:
        """Bytes ``rank`` receives in round ``r``: its receive buffer."""
        return sum(row[rank] for row in self.segments[r])

    def exchanges(self, r: int) -> bool:
        """Whether round ``r`` sends anything between ranks (then every rank joins its
        collective)."""
        return any(any(row) for row in self.segments[r])

    @property
    def nbytes(self) -> int:
        """Bytes of target the plan writes."""
        return sum(run.nbytes for rnd in self.rounds for run in rnd)

    def signature(self) -> str:
        """A digest of the plan: ranks that disagree on it must not exchange."""
        h = hashlib.sha256(repr((self.world, self.segments)).encode())
        for rnd in self.rounds:
            for u in rnd:
                h.update(repr((u.key, u.src, u.dst, u.lo, u.size, str(u.dtype),
                               u.offset)).encode())
        return h.hexdigest()[:16]


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _intersect(a: Box, b: Box) -> Box | None:
    lo, size = [], []
    for ao, asz, bo, bsz in zip(a[0], a[1], b[0], b[1]):
        start, end = max(ao, bo), min(ao + asz, bo + bsz)
        if end <= start:
            return None
        lo.append(start)
        size.append(end - start)
    return tuple(lo), tuple(size)


def _empty(box: Box) -> bool:
    return any(s == 0 for s in box[1])


def _show(box: Box) -> str:
    return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(*box)) + "]"


def find_gap(target: Box, boxes: Sequence[Box]) -> Box | None:
    """A box of ``target`` that no box in ``boxes`` covers, or ``None``.

    A sweep over the cut points of every dimension: the cells between cuts are
    each wholly inside or outside every box.
    """
    cuts = []
    for d, (o, s) in enumerate(zip(*target)):
        pts = {o, o + s}
        for b in boxes:
            for p in (b[0][d], b[0][d] + b[1][d]):
                if o < p < o + s:
                    pts.add(p)
        cuts.append(sorted(pts))
    for cell in itertools.product(*(range(len(c) - 1) for c in cuts)):
        lo = tuple(cuts[d][i] for d, i in enumerate(cell))
        size = tuple(cuts[d][i + 1] - cuts[d][i] for d, i in enumerate(cell))
        if not any(_intersect((lo, size), b) for b in boxes):
            return lo, size
    return None


def _split(lo: tuple[int, ...], size: tuple[int, ...], max_numel: int) -> list[Box]:
    """``(lo, size)`` cut into boxes of at most ``max_numel`` elements, in row-major
    order: whole rows of the outermost dimensions where they fit, else split inner
    dimensions (down to element ranges of the last)."""
    n = math.prod(size)
    if n <= max_numel:
        return [(lo, size)]
    nd = len(size)
    j = 0
    while math.prod(size[j + 1:]) > max_numel:
        j += 1
    inner = math.prod(size[j + 1:])
    rows = max(1, max_numel // inner)
    out: list[Box] = []
    for idx in itertools.product(*(range(size[d]) for d in range(j))):
        for start in range(0, size[j], rows):
            blo = tuple(lo[d] + idx[d] for d in range(j)) + (lo[j] + start,) + lo[j + 1:]
            bsz = (1,) * j + (min(rows, size[j] - start),) + size[j + 1:]
            out.append((blo, bsz))
    assert all(len(b[0]) == nd for b in out)
    return out


def cast_for(key: str, casts: Sequence[tuple[str, torch.dtype]]) -> torch.dtype | None:
    """The dtype a cast map declares for ``key``: its first matching pattern's (a
    pattern equal to the key matches it, also when the key holds ``fnmatch``'s
    characters: ``"layers[0].w"``)."""
    for pattern, dtype in casts:
        if pattern == key or fnmatch.fnmatchcase(key, pattern):
            return dtype
    return None


def plan_transfer(sources: Sequence[Sequence[Piece]], targets: Sequence[Sequence[Piece]], *,
                  capacity: Sequence[int],
                  casts: Sequence[Sequence[tuple[str, torch.dtype]]] | None = None,
                  local_capacity: Sequence[int] | None = None) -> TransferPlan:
    """Plan the copy of every target box from the sources, in rounds.

    Args:
        sources: per rank, the pieces it holds.
        targets: per rank, the pieces it wants written.
        capacity: per rank, the most wire bytes (sent plus received, aligned) it
            stages in one round.
        casts: per rank, its ``(pattern, dtype)`` casts for the keys it receives.
        local_capacity: per rank, the most bytes of local runs (copied directly,
            without staging) in one round; default ``capacity``. It only bounds
            the bytes one task copies, so that rounds stay bounded in bytes moved.

    Returns:
        The plan, identical for identical arguments.

    Raises:
        PlanRefusal: with every ``(rank, key, reason)`` found: a key without
            sources or without targets, disagreeing global shapes or source
            dtypes, a box outside the global shape, overlapping sources, a gap,
            a dtype change without a declared cast, a capacity below one element.
    """
    world = len(sources)
    casts = casts if casts is not None else [()] * world
    local_cap = list(local_capacity) if local_capacity is not None else list(capacity)
    problems: list[tuple[int, str, str]] = []
    src_by_key: dict[str, list[tuple[int, Piece]]] = {}
    dst_by_key: dict[str, list[tuple[int, Piece]]] = {}
    for by, pieces in ((src_by_key, sources), (dst_by_key, targets)):
        for rank, ps in enumerate(pieces):
            for p in ps:
                by.setdefault(p.key, []).append((rank, p))
    for key in sorted(set(src_by_key) | set(dst_by_key)):
        if key not in src_by_key:
            for rank, _ in dst_by_key[key]:
                problems.append((rank, key, "a target with no source on any rank (a key "
                                            "only this rank declares?)"))
        elif key not in dst_by_key:
            for rank, _ in src_by_key[key]:
                problems.append((rank, key, "a source with no target on any rank (a key "
                                            "only this rank declares?)"))
    groups: dict[str, list[tuple[Box, list[int]]]] = {}
    for key in sorted(set(src_by_key) & set(dst_by_key)):
        found, grp = _check_key(key, src_by_key[key], dst_by_key[key], casts)
        problems += found
        groups[key] = grp
    if problems:
        raise PlanRefusal(problems)

    # Every (source box x target box) intersection, in a fixed order: a source box's
    # destinations next to each other, so that the same region sent to several ranks
    # (replicated targets) lands in one round and is packed once.
    pairs: list[tuple[str, int, int, Box, torch.dtype]] = []
    for key, grp in groups.items():
        for box, holders in grp:
            for d, t in dst_by_key[key]:
                region = _intersect(box, (t.offsets, t.sizes))
                if region is None:
                    continue
                s = d if d in holders else holders[d % len(holders)]
                pairs.append((key, s, d, region, t.dtype))

    for rank, cap in enumerate(capacity):
        for key, s, d, _, dtype in pairs:
            if rank in (s, d) and _align(dtype.itemsize) > cap:
                problems.append((rank, key, f"its staging budget allows {cap} byte(s) per "
                                            f"round, less than one {dtype} element "
                                            f"({_align(dtype.itemsize)} bytes aligned)"))
                break
    if problems:
        raise PlanRefusal(problems)

    rounds: list[tuple[Run, ...]] = []
    segments: list[tuple[tuple[int, ...], ...]] = []
    cur: list[Run] = []
    seg = [[0] * world for _ in range(world)]
    load = [0] * world  # wire bytes per rank in the open round
    local = [0] * world  # local bytes per rank in the open round

    def close() -> None:
        nonlocal cur, seg, load, local
        if cur:
            rounds.append(tuple(cur))
            segments.append(tuple(tuple(row) for row in seg))
        cur, seg, load, local = [], [[0] * world for _ in range(world)], [0] * world, [0] * world

    # The destinations of one source region (replicated targets share it), in order.
    fans: dict[tuple[str, int, Box, torch.dtype], list[int]] = {}
    for key, s, d, region, dtype in pairs:
        fans.setdefault((key, s, region, dtype), []).append(d)
    for (key, s, (lo, size), dtype), dests in fans.items():
        item = _align(dtype.itemsize)
        if s in dests:
            # Local runs: the whole local capacity (they stage nothing).
            per = max(item, local_cap[s] // ALIGN * ALIGN) // dtype.itemsize
            for blo, bsz in _split(lo, size, max(1, per)):
                b = _align(math.prod(bsz) * dtype.itemsize)
                if local[s] + b > local_cap[s]:
                    close()
                local[s] += b
                cur.append(Run(key=key, src=s, dst=s, lo=blo, size=bsz, dtype=dtype,
                               offset=-1))
        remote = [d for d in dests if d != s]
        # Remote runs: a piece and its copies for a group of destinations fit in half
        # the smallest capacity, so they share a round (and the piece is packed once
        # per group). A group is as many destinations as the sender's capacity holds
        # one aligned element for: all of them, but for a budget too small for the
        # fan-out (a tiny budget, many ranks), whose send buffer would exceed it.
        fan = max(1, min(len(remote), capacity[s] // item))
        for group in (remote[i:i + fan] for i in range(0, len(remote), fan)):
            cap = min(capacity[r] for r in (s, *group)) // 2 // len(group)
            per = max(item, cap // ALIGN * ALIGN) // dtype.itemsize
            for blo, bsz in _split(lo, size, max(1, per)):
                b = _align(math.prod(bsz) * dtype.itemsize)
                if (load[s] + b * len(group) > capacity[s]
                        or any(load[d] + b > capacity[d] for d in group)):
                    close()
                for d in group:
                    offset = seg[s][d]
                    seg[s][d] += b
                    load[d] += b
                    load[s] += b
                    cur.append(Run(key=key, src=s, dst=d, lo=blo, size=bsz, dtype=dtype,
                                   offset=offset))
    close()
    return TransferPlan(world=world, rounds=tuple(rounds), segments=tuple(segments))


def _check_key(key: str, srcs: list[tuple[int, Piece]], dsts: list[tuple[int, Piece]],
               casts: Sequence[Sequence[tuple[str, torch.dtype]]]
               ) -> tuple[list[tuple[int, str, str]], list[tuple[Box, list[int]]]]:
    """The problems of one key, and its source boxes, each with the ranks holding it."""
    problems: list[tuple[int, str, str]] = []
    shape = srcs[0][1].global_shape
    sdtype = srcs[0][1].dtype
    for rank, p in srcs + dsts:
        if p.global_shape != shape:
            problems.append((rank, key, f"global shape {list(p.global_shape)} disagrees with "
                                        f"rank {srcs[0][0]}'s {list(shape)}"))
        elif len(p.offsets) != len(shape) or len(p.sizes) != len(shape):
            problems.append((rank, key, f"a box of {len(p.offsets)} dimension(s) for a "
                                        f"{len(shape)}-dimensional tensor"))
        elif any(o < 0 or s < 0 or o + s > g for o, s, g in zip(p.offsets, p.sizes, shape)):
            problems.append((rank, key, f"box {_show((p.offsets, p.sizes))} is outside the "
                                        f"global shape {list(shape)}"))
    for rank, p in srcs:
        if p.dtype != sdtype:
            problems.append((rank, key, f"source dtype {p.dtype} disagrees with rank "
                                        f"{srcs[0][0]}'s {sdtype}"))
    if problems:
        return problems, []
    for rank, p in dsts:
        if p.dtype != sdtype:
            cast = cast_for(key, casts[rank])
            if cast is None:
                problems.append((rank, key, f"target dtype {p.dtype} differs from the source "
                                            f"dtype {sdtype} and no cast is declared for this "
                                            "key (cast={pattern: dtype})"))
            elif cast != p.dtype:
                problems.append((rank, key, f"the declared cast is to {cast}, but the target "
                                            f"dtype is {p.dtype}"))
    # Source boxes: pairwise disjoint, except identical boxes of declared replicas.
    boxes: list[tuple[Box, list[int], bool]] = []
    for rank, p in srcs:
        box = (p.offsets, p.sizes)
        if _empty(box):
            continue
        for other, holders, replica in boxes:
            if other == box and replica and p.replica:
                holders.append(rank)
                break
            inter = _intersect(other, box)
            if inter is not None:
                problems.append((rank, key, f"source box {_show(box)} overlaps rank "
                                            f"{holders[0]}'s {_show(other)} in {_show(inter)}"
                                            + ("" if other != box else
                                               " (declare both replica=True if they hold "
                                               "the same bytes)")))
                break
        else:
            boxes.append((box, [rank], p.replica))
    if problems:
        return problems, []
    plain = [b for b, _, _ in boxes]
    for rank, p in dsts:
        tbox = (p.offsets, p.sizes)
        if _empty(tbox):
            continue
        # Disjoint sources tile the target exactly when their overlaps with it add up
        # to its volume; the gap, if any, is located by the sweep.
        covered = sum(math.prod(i[1]) for b in plain if (i := _intersect(b, tbox)))
        if covered != math.prod(tbox[1]):
            gap = find_gap(tbox, plain)
            problems.append((rank, key, f"target box {_show(tbox)} is not covered by the "
                                        f"sources: nothing holds {_show(gap) if gap else '?'}"))
    return problems, [(b, sorted(h)) for b, h, _ in boxes]
