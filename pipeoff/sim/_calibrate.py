"""``cpu_here``: a cost model measured on this machine at run time."""

from __future__ import annotations

import functools
import threading
import time

import torch

GB = 1e9

_CHUNK = 32 << 20  # bytes per measured copy: as big as the L3 cache, so copies are cold
_COUNT = 4  # distinct buffers per pass (128 MiB moved)


def _best(fn, repeats: int = 7) -> float:  # type: ignore[no-untyped-def]
    """The fastest of ``repeats`` runs: on a shared machine the minimum is the stable figure."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _pairs(count: int, numel: int, randn: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    make = torch.randn if randn else torch.ones
    return [(make(numel), torch.empty(numel)) for _ in range(count)]


def measure_copy_gbps(nbytes: int = _CHUNK, count: int = _COUNT) -> float:
    """``copy_`` bandwidth over ``count`` distinct buffers, so no copy is cache-hot."""
    pairs = _pairs(count, nbytes // 4)

    def all_copies() -> None:
        for src, dst in pairs:
            dst.copy_(src)

    return count * nbytes / _best(all_copies, repeats=3) / GB


def measure_concurrent_copy_factor(nbytes: int = _CHUNK, count: int = _COUNT) -> float:
    """Each of two concurrent copy streams' rate, as a share of one stream alone."""
    half = count // 2
    a, b = _pairs(half, nbytes // 4), _pairs(half, nbytes // 4)

    def run(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for src, dst in pairs:
            dst.copy_(src)

    alone = _best(lambda: run(a), repeats=3)

    def both() -> None:
        t = threading.Thread(target=run, args=(b,))
        t.start()
        run(a)
        t.join()

    together = _best(both, repeats=3)
    return max(0.05, min(1.0, alone / together))


def measure_copy_compute_factor(nbytes: int = _CHUNK, count: int = _COUNT) -> float:
    """Share of full speed a copy stream and an update stream keep while both run."""
    half = count // 2
    copies = _pairs(half, nbytes // 4)
    updates = _pairs(half, nbytes // 4, randn=True)

    def run_copies() -> None:
        for src, dst in copies:
            dst.copy_(src)

    def run_updates() -> None:
        for g, m in updates:
            m.mul_(0.9).add_(g)

    alone = _best(run_copies, repeats=3) + _best(run_updates, repeats=3)

    def both() -> None:
        t = threading.Thread(target=run_updates)
        t.start()
        run_copies()
        t.join()

    together = _best(both, repeats=3)
    # Run together, the pair finishes in `together`; sharing a resource at a
    # factor f, it would take alone / (2 f) for equal halves: f = alone / (2 together).
    return max(0.05, min(1.0, alone / (2 * together)))


def measure_update_elems_per_s(numel: int = _CHUNK // 4, count: int = _COUNT) -> float:
    """The element-wise update pipeoff's CPU workloads run: ``m.mul_(0.9).add_(g)``."""
    pairs = _pairs(count, numel, randn=True)

    def all_updates() -> None:
        for g, m in pairs:
            m.mul_(0.9).add_(g)

    return count * numel / _best(all_updates, repeats=3)


def measure_launch_overhead_s(n: int = 2000) -> float:
    from pipeoff.executor import execute
    from pipeoff.graph import TaskGraph, TaskKind

    g = TaskGraph()
    prev: list[str] = []
    for i in range(n):
        g.add_task(f"t{i}", TaskKind.OPTIMIZER_CHUNK, None, deps=prev)
        prev = [f"t{i}"]
    return _best(lambda: execute(g).wait(), repeats=3) / n


@functools.lru_cache(maxsize=1)
def cpu_here() -> dict[str, object]:
    """Measure this machine (about a second): the fields of its cost model.

    On a CPU-only machine "device" and "host" are the same memory, so H2D,
    D2H and device copies all run at the measured ``copy_`` bandwidth, two
    copies at once share it (the bidirectional factor), and so do a copy and
    an update (the copy/compute factor). Collectives are
    modelled as free (one participant).
    """
    copy = measure_copy_gbps()
    factor = measure_concurrent_copy_factor()
    update = measure_update_elems_per_s()
    mixed = measure_copy_compute_factor()
    return dict(
        name="cpu_here",
        h2d_gbps=copy,
        d2h_gbps=copy,
        h2d_bidir_factor=factor,
        d2h_bidir_factor=factor,
        copy_compute_factor=mixed,
        hbm_gbps=copy,
        interconnect_gbps=copy,
        interconnect_latency_s=0.0,
        participants=1,
        optimizer_elems_per_s=update,
        cpu_optimizer_elems_per_s=update,
        launch_overhead_s=measure_launch_overhead_s(),
    )
