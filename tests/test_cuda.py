"""The CUDA backend on a real GPU. Skipped without one (see conftest)."""

from __future__ import annotations

import pytest
import torch

import pipeoff
import pipeoff.testing
from pipeoff import Schedule, TaskGraph, TaskKind
from pipeoff.executor.cuda import lane_stream

pytestmark = pytest.mark.cuda


def test_copy_and_compute_lanes_overlap() -> None:
    dev = torch.device("cuda")
    host = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)  # 1 GiB: ~20 ms of PCIe
    dst = torch.empty_like(host, device=dev)
    a = torch.randn(4096, 4096, device=dev)

    def copy(ctx: pipeoff.TaskContext) -> None:
        dst.copy_(host, non_blocking=True)  # pinned: a true async copy on the lane's stream

    def matmuls(ctx: pipeoff.TaskContext) -> None:
        for _ in range(8):  # ~15-20 ms of fp32 GEMMs on an H100/H200
            a @ a

    def graph(*names: str) -> TaskGraph:
        g = TaskGraph(device=dev)
        if "copy" in names:
            g.add_task("copy", TaskKind.H2D, copy, nbytes=host.numel())
        if "matmul" in names:
            g.add_task("matmul", TaskKind.OPTIMIZER_CHUNK, matmuls)
        return g

    for _ in range(2):  # warm up cuBLAS, the allocator and the lane streams
        pipeoff.execute(graph("copy", "matmul")).wait()
    # Parts measured alone, then together; all times from CUDA events.
    parts = []
    for only in ("copy", "matmul"):
        ex = pipeoff.execute(graph(only))
        ex.wait()
        parts.append(ex.trace.tasks[0].duration_ns)
    ex = pipeoff.execute(graph("copy", "matmul"))
    ex.wait()
    makespan = ex.trace.makespan_ns()
    assert makespan < 0.8 * sum(parts), (makespan, parts)


def test_streams_are_created_once_per_lane() -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    g = TaskGraph(device=dev)
    g.add_task("c", TaskKind.OPTIMIZER_CHUNK)
    pipeoff.execute(g).wait()
    s = lane_stream(dev, "compute")
    pipeoff.execute(g).wait()
    assert lane_stream(dev, "compute") is s


def test_cross_lane_dependency_waits_on_a_delayed_gpu_lane() -> None:
    dev = torch.device("cuda")
    x = torch.zeros(1 << 20, device=dev)
    out = torch.zeros((), device=dev)
    g = TaskGraph(device=dev)
    g.add_task("produce", TaskKind.H2D, lambda ctx: x.fill_(1.0))
    g.add_task("consume", TaskKind.OPTIMIZER_CHUNK, lambda ctx: out.copy_(x.sum()),
               deps=["produce"])
    with pipeoff.testing.delay_lane("h2d", 0.05):  # a GPU-side sleep on the h2d stream
        ex = pipeoff.execute(g)
    ex.wait()
    assert out.item() == float(1 << 20)


def test_pooled_blocks_are_reused_only_after_their_last_user() -> None:
    dev = torch.device("cuda")
    results = []
    for value in (1.0, 2.0, 3.0):
        g = TaskGraph(device=dev)
        g.add_buffer("stage", 1 << 22)
        host = torch.empty(1 << 20, pin_memory=True)

        def fill(ctx: pipeoff.TaskContext, v: float = value) -> None:
            ctx.buffer("stage", torch.float32).fill_(v)

        def back(ctx: pipeoff.TaskContext, h: torch.Tensor = host) -> None:
            # Hazard under test: the next execution's fill must not overwrite
            # the block before this (delayed) copy-out has read it.
            h.copy_(ctx.buffer("stage", torch.float32), non_blocking=True)

        g.add_task("fill", TaskKind.H2D, fill, buffers=["stage"])
        g.add_task("back", TaskKind.D2H, back, deps=["fill"], buffers=["stage"])
        with pipeoff.testing.delay_lane("d2h", 0.02):
            ex = pipeoff.execute(g)
        results.append((ex, host, value))
    for ex, host, value in results:
        ex.wait()
        assert torch.all(host == value)


def test_failure_on_cuda_reraises_and_releases() -> None:
    dev = torch.device("cuda")
    g = TaskGraph(device=dev)
    g.add_buffer("s", 1024)
    g.add_task("a", TaskKind.H2D, buffers=["s"])
    g.add_task("b", TaskKind.ALLREDUCE, lambda ctx: (_ for _ in ()).throw(RuntimeError("nccl")),
               deps=["a"], buffers=["s"])
    g.add_task("c", TaskKind.D2H, deps=["b"], buffers=["s"])
    ex = pipeoff.execute(g)
    with pytest.raises(RuntimeError, match="nccl"):
        ex.wait()
    assert pipeoff.pools_for(dev).device.stats().live_bytes == 0
    assert {r.name: r.status for r in ex.trace.tasks}["c"] == "cancelled"


def test_completion_makes_the_current_stream_wait() -> None:
    dev = torch.device("cuda")
    x = torch.zeros(1 << 20, device=dev)
    g = TaskGraph(device=dev)
    g.add_task("write", TaskKind.OPTIMIZER_CHUNK, lambda ctx: x.fill_(5.0))
    with pipeoff.testing.delay_lane("compute", 0.05):
        ex = pipeoff.execute(g)
    (done,) = ex.events_for("write")
    done.wait()  # the current stream waits; the host does not
    assert x.sum().item() == 5.0 * (1 << 20)
    ex.wait()


def test_synchronous_schedule_on_cuda_runs_inline() -> None:
    dev = torch.device("cuda")
    x = torch.zeros(4, device=dev)
    g = TaskGraph(device=dev)
    g.add_task("a", TaskKind.H2D, lambda ctx: x.add_(1))
    g.add_task("b", TaskKind.D2H, lambda ctx: x.mul_(3), deps=["a"])
    ex = pipeoff.execute(g, Schedule.synchronous())
    assert ex.backend == "inline" and ex.done()
    assert torch.equal(x.cpu(), torch.full((4,), 3.0))
