"""Staging pools: device and pinned host buffers, allocated once and reused.

Each process keeps one :class:`StagingPool` per device for device staging and
one for pinned host staging (:func:`pools_for`). A block released by one
execution is handed to the next. On CUDA the release carries the event of the
block's last user, and the new user's stream waits on it before touching the
block, so reuse never races and the host never blocks.
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from pipeoff import _accel, _happens
from pipeoff._errors import ConfigError

_log = logging.getLogger("pipeoff")

if TYPE_CHECKING:
    from pipeoff.graph import TaskGraph
    from pipeoff.schedule import Plan, Schedule

__all__ = ["PoolStats", "Pools", "StagingBlock", "StagingPool", "host_pool", "pools_for",
           "reserve_for"]


@dataclass(eq=False, slots=True)
class StagingBlock:
    """A pooled allocation. ``tensor`` is a flat ``uint8`` tensor of ``capacity`` bytes."""

    tensor: torch.Tensor
    capacity: int
    ready: Any = None
    """The CUDA event after which the block is free to reuse, or ``None``."""
    in_use: int = 0
    """Bytes handed out to the current user, 0 when free."""

    def view(self, nbytes: int) -> torch.Tensor:
        return self.tensor[:nbytes]


@dataclass(frozen=True, kw_only=True, slots=True)
class PoolStats:
    """A snapshot of a pool's accounting."""

    live_bytes: int
    """Bytes handed out and not yet released."""
    peak_live_bytes: int
    """High-water mark of ``live_bytes`` since the last :meth:`StagingPool.reset_peak`."""
    reserved_bytes: int
    """Bytes held by the pool, free or not."""
    allocations: int
    """How many blocks the pool has ever allocated (constant once warm)."""
    pinned: bool
    """Whether host blocks are page-locked."""


_pin_warned = False


def _can_pin() -> bool:
    return _accel.current().available()


class StagingPool:
    """Reusable staging blocks of one memory kind on one device.

    Acquire picks the smallest free block that holds the request (and is at
    most twice its size), else allocates a new one; blocks are never freed
    except by :meth:`trim`. Accounting is of requested bytes.

    Args:
        device: where blocks live; the CPU for host pools.
        pinned: page-lock host blocks. On a torch without an accelerator,
            pinning is impossible; the pool falls back to ordinary memory and
            says so once with a ``RuntimeWarning``.
    """

    def __init__(self, device: torch.device | str, *, pinned: bool = False,
                 host: bool = False) -> None:
        global _pin_warned
        self.device = torch.device(device)
        self.host = host or pinned
        """Whether blocks are host memory (the accelerator allocates them)."""
        if pinned and not _can_pin():
            if not _pin_warned:
                _pin_warned = True
                # Information, not a warning: nothing to act on (a CPU-only torch has no
                # page-locked memory, and nothing needs it there).
                _log.info("pinned host memory needs an accelerator; this torch has none, "
                          "so host staging uses ordinary (pageable) memory")
            pinned = False
        self.pinned = pinned
        self._lock = threading.Lock()
        self._free: list[tuple[int, int, StagingBlock]] = []  # (capacity, id, block), sorted
        self._retiring: list[StagingBlock] = []  # discarded, until their marker completes
        self._live = 0
        self._peak = 0
        self._reserved = 0
        self._allocations = 0

    def acquire(self, nbytes: int) -> StagingBlock:
        """Hand out a block of at least ``nbytes``. The caller must honour ``block.ready``."""
        _happens.acquire(self)  # after the host work of whoever released a block here
        with self._lock:
            i = bisect.bisect_left(self._free, (nbytes, -1))
            if i < len(self._free) and self._free[i][0] <= 2 * nbytes:
                block = self._free.pop(i)[2]
            else:
                block = None
            self._live += nbytes
            self._peak = max(self._peak, self._live)
        if block is None:
            block = StagingBlock(tensor=self._allocate(nbytes), capacity=nbytes)
            with self._lock:
                self._reserved += nbytes
                self._allocations += 1
        block.in_use = nbytes
        return block

    def reserve(self, sizes: Iterable[int]) -> int:
        """Allocate a free block of each of ``sizes`` (bytes) now; returns the bytes.

        Pinned allocation stalls the device (``cudaHostAlloc``) and, under NCCL,
        can deadlock against peers spinning in a collective: reserve the blocks a
        feature's executions will need before training starts (see
        :func:`reserve_for`), never in a hook or during the backward.

        Raises:
            ConfigError: a size is not a positive int.
        """
        sizes = list(sizes)
        for n in sizes:
            if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
                raise ConfigError(f"reserve() takes positive byte counts, got {n!r}")
        blocks = [StagingBlock(tensor=self._allocate(n), capacity=n) for n in sizes]
        with self._lock:
            for block in blocks:
                bisect.insort(self._free, (block.capacity, id(block), block))
            self._reserved += sum(sizes)
            self._allocations += len(sizes)
        return sum(sizes)

    def _allocate(self, nbytes: int) -> torch.Tensor:
        if self.device.type == "cpu" and self.host:
            return _accel.current().host_empty(nbytes, torch.uint8, pinned=self.pinned)
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def release(self, block: StagingBlock, ready: Any = None) -> None:
        """Return ``block``; ``ready`` is the event of its last user (CUDA) or ``None``."""
        _happens.release(self)
        with self._lock:
            self._live -= block.in_use
            block.in_use = 0
            if ready is not None:
                # Without a new marker (a cancelled user that never ran), the
                # block keeps its previous owner's, which is still unmet.
                block.ready = ready
            bisect.insort(self._free, (block.capacity, id(block), block))

    def discard(self, block: StagingBlock, ready: Any = None) -> None:
        """Drop ``block`` instead of returning it: it will not be handed out again.

        ``ready``: the event of its last user (CUDA) or ``None``. A block with a
        marker is held until :meth:`forget_events` says it completed. Hazard: freeing
        memory that queued stream work still writes (the caching allocator hands it
        to the next allocation on the stream it was made on at once; the simulated
        device's find, once a Ctrl-C retired a staging buffer).
        """
        with self._lock:
            self._live -= block.in_use
            block.in_use = 0
            if ready is not None:
                block.ready = ready  # (else the previous owner's marker, if unmet)
            if block.ready is None:
                self._reserved -= block.capacity
            else:
                self._retiring.append(block)

    def forget_events(self, events: set[Any]) -> None:
        """Drop ``ready`` markers that are in ``events`` (they completed and are
        recycled), and the discarded blocks that waited for them."""
        with self._lock:
            for _, _, block in self._free:
                if block.ready is not None and block.ready in events:
                    block.ready = None
            done = [b for b in self._retiring if b.ready in events]
            self._retiring = [b for b in self._retiring if b.ready not in events]
            self._reserved -= sum(b.capacity for b in done)

    def stats(self) -> PoolStats:
        with self._lock:
            return PoolStats(
                live_bytes=self._live,
                peak_live_bytes=self._peak,
                reserved_bytes=self._reserved,
                allocations=self._allocations,
                pinned=self.pinned,
            )

    def reset_peak(self) -> None:
        with self._lock:
            self._peak = self._live

    def trim(self) -> int:
        """Free every idle block; returns the bytes freed."""
        with self._lock:
            idle = [block for _, _, block in self._free] + self._retiring
            for block in idle:
                if block.ready is not None:
                    # Hazard: freeing memory a stream may still read or write.
                    block.ready.synchronize()
            freed = sum(block.capacity for block in idle)
            self._free.clear()
            self._retiring.clear()
            self._reserved -= freed
        return freed


class Pools:
    """The device pool and the host pool that one device's executions share.

    The host pool is process-wide (per accelerator) and created on first use,
    so a run that stages nothing on the host never tries to pin memory.
    """

    __slots__ = ("_accel", "device")

    def __init__(self, device: StagingPool, accel: Any) -> None:
        self.device = device
        self._accel = accel

    @property
    def host(self) -> StagingPool:
        return host_pool(self._accel)

    def for_where(self, where: str) -> StagingPool:
        return self.device if where == "device" else host_pool(self._accel)


_pools: dict[tuple[Any, torch.device], Pools] = {}
_pools_lock = threading.Lock()
_host_pools: dict[Any, StagingPool] = {}


def host_pool(accel: Any = None) -> StagingPool:
    """The process-wide pinned host pool (of the current accelerator; created on first use)."""
    key = _accel.current() if accel is None else accel
    pool = _host_pools.get(key)
    if pool is None:
        with _pools_lock:
            pool = _host_pools.get(key)
            if pool is None:
                pool = _host_pools[key] = StagingPool("cpu", pinned=True, host=True)
    return pool


def pools_for(device: torch.device | str) -> Pools:
    """The process-wide pools for ``device`` (created on first use).

    Pools belong to the current accelerator: the simulated device of
    :mod:`pipeoff.testing` gets pools of its own.
    """
    accel = _accel.current()
    dev = accel.normalize(torch.device(device))
    with _pools_lock:
        pools = _pools.get((accel, dev))
        if pools is None:
            pools = _pools[(accel, dev)] = Pools(StagingPool(dev), accel)
        return pools


def reserve_for(graph: TaskGraph, schedule: Schedule) -> dict[str, int]:
    """Reserve, in ``graph``'s pools, every staging block its executions under
    ``schedule`` can hold at once, so that running it allocates nothing.

    Per memory kind and buffer size, as many blocks as can be live together: all
    of them without a budget, at most ``budget // size`` of a size with one (a
    pool hands a request the smallest free block that holds it, so each size is
    served by its own blocks). Shape-only graphs (``work=None``) are fine: the
    features reserve with the graph the simulator runs. Each call reserves anew;
    features that run at the same time each reserve their own.

    Returns:
        Bytes reserved, by ``"device"`` and ``"host"``.

    Raises:
        GraphError, BudgetError: the graph cannot be planned with ``schedule``.
    """
    plan = schedule.plan(graph)
    pools = pools_for(graph.device)
    out = {}
    for where in ("device", "host"):
        counts: dict[int, int] = {}
        for spec in graph.buffers.values():
            if spec.where == where:
                counts[spec.nbytes] = counts.get(spec.nbytes, 0) + 1
        if not counts:
            out[where] = 0
            continue
        budget = plan.schedule.budget(where)
        live = _max_live(plan, graph, where) if plan.schedule.is_synchronous else None
        sizes = []
        for size, count in sorted(counts.items()):
            n = count
            if budget is not None:
                n = min(n, budget // size)
            if live is not None:
                n = min(n, live.get(size, 0))
            sizes += [size] * max(n, 1)
        out[where] = pools.for_where(where).reserve(sizes)
    return out


def _max_live(plan: Plan, graph: TaskGraph, where: str) -> dict[int, int]:
    """Per buffer size, the most buffers of ``where`` live at once when the tasks run
    one at a time in plan order (live from the first user to the last)."""
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, name in enumerate(plan.order):
        for b in graph.tasks[name].buffers:
            first.setdefault(b, i)
            last[b] = i
    events = []
    for b, lo in first.items():
        spec = graph.buffers[b]
        if spec.where == where:
            events.append((lo, 1, spec.nbytes))
            events.append((last[b] + 1, 0, spec.nbytes))  # gone before the next acquires
    now: dict[int, int] = {}
    most: dict[int, int] = {}
    for _, acquire, size in sorted(events):
        now[size] = now.get(size, 0) + (1 if acquire else -1)
        most[size] = max(most.get(size, 0), now[size])
    return most
