"""``cpu_here``: a cost model measured on this machine at run time."""

from __future__ import annotations

import functools
import threading
import time

import torch

from pipeoff.sim._costmodel import GB, CostModel

_CHUNK = 8 << 20  # bytes per measured copy; well past the caches


def _best(fn, repeats: int = 7) -> float:  # type: ignore[no-untyped-def]
    """The fastest of ``repeats`` runs: on a shared machine the minimum is the stable figure."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_copy_gbps(nbytes: int = _CHUNK) -> float:
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    return nbytes / _best(lambda: dst.copy_(src)) / GB


def measure_concurrent_copy_factor(nbytes: int = _CHUNK) -> float:
    """Each of two concurrent copies' rate, as a share of one copy alone."""
    pairs = [(torch.ones(nbytes // 4), torch.empty(nbytes // 4)) for _ in range(2)]
    alone = _best(lambda: pairs[0][1].copy_(pairs[0][0]))

    def both() -> None:
        t = threading.Thread(target=lambda: pairs[1][1].copy_(pairs[1][0]))
        t.start()
        pairs[0][1].copy_(pairs[0][0])
        t.join()

    together = _best(both)
    return max(0.05, min(1.0, alone / together))


def measure_update_elems_per_s(numel: int = _CHUNK // 4) -> float:
    """The element-wise update pipeoff's CPU workloads run: ``m.mul_(0.9).add_(g)``."""
    m = torch.zeros(numel)
    g = torch.randn(numel)
    return numel / _best(lambda: m.mul_(0.9).add_(g))


def measure_launch_overhead_s(n: int = 2000) -> float:
    import pipeoff
    from pipeoff import TaskGraph, TaskKind

    g = TaskGraph()
    prev: list[str] = []
    for i in range(n):
        g.add_task(f"t{i}", TaskKind.OPTIMIZER_CHUNK, None, deps=prev)
        prev = [f"t{i}"]
    return _best(lambda: pipeoff.execute(g).wait(), repeats=3) / n


@functools.lru_cache(maxsize=1)
def cpu_here() -> CostModel:
    """Measure this machine (about a second) and return its cost model.

    On a CPU-only machine "device" and "host" are the same memory, so H2D,
    D2H and device copies all run at the measured ``copy_`` bandwidth, and
    two copies at once share it (the bidirectional factor). Collectives are
    modelled as free (one participant).
    """
    copy = measure_copy_gbps()
    factor = measure_concurrent_copy_factor()
    update = measure_update_elems_per_s()
    return CostModel(
        name="cpu_here",
        h2d_gbps=copy,
        d2h_gbps=copy,
        h2d_bidir_factor=factor,
        d2h_bidir_factor=factor,
        hbm_gbps=copy,
        interconnect_gbps=copy,
        interconnect_latency_s=0.0,
        participants=1,
        optimizer_elems_per_s=update,
        cpu_optimizer_elems_per_s=update,
        launch_overhead_s=measure_launch_overhead_s(),
    )
