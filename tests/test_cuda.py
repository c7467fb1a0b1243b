"""The CUDA backend, on the simulated CUDA device (and on a real GPU where there is one).

Each synchronization the backend makes has a test here that fails with it
switched off (``pipeoff.testing.disable``): on the simulated device a missing
``wait_event``, block fence or host synchronize raises ``DataRaceError``,
whatever the threads' timing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch

import pipeoff
import pipeoff.testing
from pipeoff import Schedule, TaskGraph, TaskKind
from pipeoff.executor.cuda import lane_stream
from tests.gpu_device import Gpu


def _mutated(gpu: Gpu, name: str, scenario: Callable[[], None]) -> None:
    """``scenario`` passes as it is, and raises a data race with ``name`` switched off."""
    scenario()
    if not gpu.simulated:
        return  # a real GPU shows a missing wait only by luck
    with pipeoff.testing.disable(name), pytest.raises(pipeoff.testing.DataRaceError):
        scenario()
        gpu.synchronize()


def test_cross_lane_dependency_waits_on_a_delayed_lane(gpu: Gpu) -> None:
    def scenario() -> None:
        x = gpu.zeros(1 << 10)
        out = gpu.zeros(())
        g = TaskGraph(device=gpu.device)
        g.add_task("produce", TaskKind.H2D, lambda ctx: x.fill_(1.0))
        g.add_task("consume", TaskKind.OPTIMIZER_CHUNK, lambda ctx: out.copy_(x.sum()),
                   deps=["produce"])
        with pipeoff.testing.delay_lane("h2d", 0.05):  # the h2d stream is late
            ex = pipeoff.execute(g)
        ex.wait()
        assert ex.backend == "cuda"
        assert gpu.read(out).item() == float(1 << 10)

    _mutated(gpu, "cross_lane_wait", scenario)


def test_lanes_start_after_the_callers_stream(gpu: Gpu) -> None:
    """Work the caller enqueued before the launch (a backward writing grads)."""

    def scenario() -> None:
        x = gpu.zeros(1 << 10)
        out = gpu.zeros(())
        with pipeoff.testing.delay_lane("compute", 0.0):
            x.add_(2.0)  # on the caller's current stream
        g = TaskGraph(device=gpu.device)
        g.add_task("read", TaskKind.OPTIMIZER_CHUNK, lambda ctx: out.copy_(x.sum()))
        pipeoff.execute(g).wait()
        assert gpu.read(out).item() == 2.0 * (1 << 10)

    _mutated(gpu, "base_wait", scenario)


def test_pooled_blocks_are_reused_only_after_their_last_user(gpu: Gpu) -> None:
    scratch = gpu.accel.new_stream(gpu.device)

    def scenario() -> None:
        runs = []
        for value in (1.0, 2.0, 3.0):
            g = TaskGraph(device=gpu.device)
            g.add_buffer("stage", 1 << 12)
            host = gpu.host(1 << 10)

            def fill(ctx: pipeoff.TaskContext, v: float = value) -> None:
                ctx.buffer("stage", torch.float32).fill_(v)

            def back(ctx: pipeoff.TaskContext, h: torch.Tensor = host) -> None:
                # The next execution's fill must not overwrite the block before
                # this (delayed) copy-out has read it.
                h.copy_(ctx.buffer("stage", torch.float32), non_blocking=True)

            g.add_task("fill", TaskKind.H2D, fill, buffers=["stage"])
            g.add_task("back", TaskKind.D2H, back, deps=["fill"], buffers=["stage"])
            with pipeoff.testing.delay_lane("d2h", 0.02):
                ex = pipeoff.execute(g)
            # Until "back" is issued (not run: its stream is late): its block is
            # back in the pool for the next execution to take.
            ex.events_for("back")[0].wait(scratch)
            runs.append((ex, host, value))
        for ex, host, value in runs:
            ex.wait()
            assert torch.all(host == value)

    _mutated(gpu, "block_fence", scenario)


def test_an_inline_execution_waits_for_a_block_a_cuda_one_released(gpu: Gpu) -> None:
    """Staging pools are shared: a block that a CUDA execution released while its
    copy-out still runs must not be written by an inline execution at once."""

    def scenario() -> None:
        host = gpu.host(1 << 10)
        g = TaskGraph(device=gpu.device)
        g.add_buffer("stage", 1 << 12)
        g.add_task("fill", TaskKind.H2D,
                   lambda ctx: ctx.buffer("stage", torch.float32).fill_(1.0), buffers=["stage"])
        g.add_task("back", TaskKind.D2H,
                   lambda ctx: host.copy_(ctx.buffer("stage", torch.float32), non_blocking=True),
                   deps=["fill"], buffers=["stage"])
        with pipeoff.testing.delay_lane("d2h", 0.03):
            first = pipeoff.execute(g)
        run = first._run
        run.wait_terminal(run.index["back"])  # issued: the block is released, copy pending
        g2 = TaskGraph(device=gpu.device)
        g2.add_buffer("stage", 1 << 12)
        g2.add_task("overwrite", TaskKind.H2D,
                    lambda ctx: ctx.buffer("stage", torch.float32).fill_(2.0), buffers=["stage"])
        second = pipeoff.execute(g2, schedule=Schedule.synchronous())
        assert second.backend == "inline"
        second.wait()
        first.wait()
        gpu.synchronize()
        assert torch.all(host == 1.0)

    _mutated(gpu, "block_fence", scenario)


def test_a_host_task_reads_device_results_after_they_are_done(gpu: Gpu) -> None:
    def scenario() -> None:
        x = gpu.zeros(1 << 10)
        host = gpu.host(1 << 10)
        seen: list[float] = []
        g = TaskGraph(device=gpu.device)
        g.add_task("fill", TaskKind.OPTIMIZER_CHUNK, lambda ctx: x.fill_(7.0))
        g.add_task("d2h", TaskKind.D2H, lambda ctx: host.copy_(x, non_blocking=True),
                   deps=["fill"])
        g.add_task("decide", TaskKind.HOST, lambda ctx: seen.append(float(host.sum())),
                   deps=["d2h"])
        with pipeoff.testing.delay_lane("d2h", 0.03):
            pipeoff.execute(g).wait()
        assert seen == [7.0 * (1 << 10)]

    _mutated(gpu, "host_sync", scenario)


def test_device_tasks_wait_for_device_work_a_host_task_enqueued(gpu: Gpu) -> None:
    """torchft's should_commit may load a healed state into the parameters: device
    work on the host task's thread's stream. The write-backs after it wait for it."""

    def scenario() -> None:
        param = gpu.zeros(1 << 10)
        healed = gpu.zeros(1 << 10)
        healed.fill_(3.0)
        accel = gpu.accel

        def should_commit(ctx: pipeoff.TaskContext) -> bool:
            stream = accel.current_stream(gpu.device)
            accel.sleep(stream, 0.03)  # the heal's copies are late on their stream
            param.copy_(healed)
            return True

        g = TaskGraph(device=gpu.device)
        g.add_task("should_commit", TaskKind.HOST, should_commit)
        g.add_task("h2d", TaskKind.H2D, lambda ctx: param.add_(1.0), deps=["should_commit"])
        pipeoff.execute(g).wait()
        assert torch.all(gpu.read(param) == 4.0)

    _mutated(gpu, "host_task_event", scenario)


def test_wait_makes_host_reads_of_copies_safe(gpu: Gpu) -> None:
    def scenario() -> None:
        x = gpu.zeros(1 << 10)
        x.fill_(3.0)
        host = gpu.host(1 << 10)
        g = TaskGraph(device=gpu.device)
        g.add_task("d2h", TaskKind.D2H, lambda ctx: host.copy_(x, non_blocking=True))
        with pipeoff.testing.delay_lane("d2h", 0.03):
            ex = pipeoff.execute(g)
        ex.wait()  # the host waits for the device work too
        assert float(host.sum()) == 3.0 * (1 << 10)

    _mutated(gpu, "execution_sync", scenario)


def test_completion_wait_orders_a_stream_and_synchronize_the_host(gpu: Gpu) -> None:
    """``Completion.wait()`` makes the current stream wait (the host does not block):
    device reads after it are safe, host reads need ``Completion.synchronize()``."""
    x = gpu.zeros(1 << 10)
    host = gpu.host(1 << 10)
    g = TaskGraph(device=gpu.device)
    g.add_task("write", TaskKind.OPTIMIZER_CHUNK, lambda ctx: x.fill_(5.0))
    g.add_task("d2h", TaskKind.D2H, lambda ctx: host.copy_(x, non_blocking=True),
               deps=["write"])
    with pipeoff.testing.delay_lane("compute", 0.03):
        ex = pipeoff.execute(g)
    write, d2h = ex.events_for(["write", "d2h"])
    write.wait()  # the current stream waits
    assert gpu.read(x.sum()).item() == 5.0 * (1 << 10)
    d2h.synchronize()  # the host waits
    assert float(host.sum()) == 5.0 * (1 << 10)
    ex.wait()
    if gpu.simulated:  # a host read after a stream-only wait is a race
        g2 = TaskGraph(device=gpu.device)
        g2.add_task("d2h", TaskKind.D2H, lambda ctx: host.copy_(x, non_blocking=True))
        with pipeoff.testing.delay_lane("d2h", 0.03):
            ex2 = pipeoff.execute(g2)
        (done,) = ex2.events_for("d2h")
        done.wait()
        # Found on whichever side comes second: the host's read, or the copy.
        with pytest.raises(pipeoff.testing.DataRaceError, match="pinned host"):
            float(host.sum())
            ex2.wait()


def test_streams_are_created_once_per_lane(gpu: Gpu) -> None:
    g = TaskGraph(device=gpu.device)
    g.add_task("c", TaskKind.OPTIMIZER_CHUNK)
    pipeoff.execute(g).wait()
    s = lane_stream(gpu.device, "compute")
    pipeoff.execute(g).wait()
    assert lane_stream(gpu.device, "compute") is s


def test_failure_reraises_and_releases(gpu: Gpu) -> None:
    g = TaskGraph(device=gpu.device)
    g.add_buffer("s", 1024)
    g.add_task("a", TaskKind.H2D, buffers=["s"])
    g.add_task("b", TaskKind.ALLREDUCE, lambda ctx: (_ for _ in ()).throw(RuntimeError("nccl")),
               deps=["a"], buffers=["s"])
    g.add_task("c", TaskKind.D2H, deps=["b"], buffers=["s"])
    ex = pipeoff.execute(g)
    with pytest.raises(RuntimeError, match="nccl"):
        ex.wait()
    assert pipeoff.pools_for(gpu.device).device.stats().live_bytes == 0
    assert {r.name: r.status for r in ex.trace.tasks}["c"] == "cancelled"


def test_synchronous_schedule_runs_inline(gpu: Gpu) -> None:
    x = gpu.zeros(4)
    g = TaskGraph(device=gpu.device)
    g.add_task("a", TaskKind.H2D, lambda ctx: x.add_(1))
    g.add_task("b", TaskKind.D2H, lambda ctx: x.mul_(3), deps=["a"])
    ex = pipeoff.execute(g, Schedule.synchronous())
    assert ex.backend == "inline" and ex.done()
    assert torch.equal(gpu.read(x), torch.full((4,), 3.0))


def test_threads_backend_is_refused_for_a_device_graph(gpu: Gpu) -> None:
    g = TaskGraph(device=gpu.device)
    g.add_task("a", TaskKind.H2D)
    with pytest.raises(pipeoff.ConfigError, match="backend='threads' cannot run"):
        pipeoff.execute(g, backend="threads")


def test_an_execution_waiting_on_its_streams_never_blocks_another(gpu: Gpu) -> None:
    """A write-back waiting for a commit holds its own stream only (issue 10, input 4)."""
    gate = threading.Event()
    x = gpu.zeros(16)
    a = TaskGraph(device=gpu.device)
    a.add_task("decide", TaskKind.HOST, lambda c: gate.wait(30))
    a.add_task("write_back", TaskKind.H2D, lambda c: x.add_(1.0), deps=["decide"])
    b = TaskGraph(device=gpu.device)
    y = gpu.zeros(16)
    b.add_task("copy", TaskKind.H2D, lambda c: y.fill_(7.0))
    ex_a = pipeoff.execute(a)
    ex_b = pipeoff.execute(b)
    ex_b.wait(timeout=30)  # not queued behind A's write-back
    assert float(gpu.read(y).sum()) == 7.0 * 16
    assert not ex_a.done()
    gate.set()
    ex_a.wait(timeout=30)
    assert float(gpu.read(x).sum()) == 16.0


def test_host_tasks_run_on_host_lanes_and_never_stall_device_issue(gpu: Gpu) -> None:
    """A slow CPU step between copies does not hold back the copies behind it."""
    release = threading.Event()
    x = gpu.zeros(16)
    g = TaskGraph(device=gpu.device)
    g.add_task("cpu_step", TaskKind.HOST, lambda c: release.wait(30))
    g.add_task("copy", TaskKind.H2D, lambda c: x.fill_(2.0))  # independent of it
    ex = pipeoff.execute(g)
    ex.wait("copy", timeout=30)
    assert not ex.done("cpu_step")
    release.set()
    ex.wait(timeout=30)


def test_delays_apply_to_host_tasks(gpu: Gpu) -> None:
    g = TaskGraph(device=gpu.device)
    g.add_task("cpu", TaskKind.HOST, lambda c: None)
    with pipeoff.testing.delay_lane("host", 0.05):
        ex = pipeoff.execute(g)
        ex.wait()
    (rec,) = ex.trace.tasks
    assert rec.end_ns - rec.enqueue_ns >= 0.04e9


def test_task_times_are_on_the_host_clock(gpu: Gpu) -> None:
    """Device times are placed on the host clock: after the launch, in issue order."""
    x = gpu.zeros(1 << 10)
    g = TaskGraph(device=gpu.device)
    g.add_task("a", TaskKind.H2D, lambda c: x.fill_(1.0))
    g.add_task("b", TaskKind.OPTIMIZER_CHUNK, lambda c: x.mul_(2.0), deps=["a"])
    t0 = time.perf_counter_ns()
    with pipeoff.testing.delay_lane("h2d", 0.03):
        ex = pipeoff.execute(g)
    ex.wait()
    t1 = time.perf_counter_ns()
    a, b = ex.trace.tasks
    assert 0 <= a.start_ns <= a.end_ns <= b.start_ns <= b.end_ns
    assert ex.origin_ns + b.end_ns <= t1 + 5_000_000  # not in the future (5 ms of slack)
    assert ex.origin_ns >= t0
    assert a.end_ns - a.start_ns >= 0.02e9  # the delayed lane's sleep is inside a


@pytest.mark.gpu
def test_copy_and_compute_lanes_overlap() -> None:
    """Real overlap in time needs a real GPU."""
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
    parts = []
    for only in ("copy", "matmul"):
        ex = pipeoff.execute(graph(only))
        ex.wait()
        parts.append(ex.trace.tasks[0].duration_ns)
    ex = pipeoff.execute(graph("copy", "matmul"))
    ex.wait()
    assert ex.trace.makespan_ns() < 0.8 * sum(parts), (ex.trace.makespan_ns(), parts)


def test_a_device_without_an_index_is_the_current_device(gpu: Gpu) -> None:
    """``torch.device("cuda")`` (no index) in a graph: inline runs and stream waits
    use the current device's streams."""
    if gpu.simulated:
        pytest.skip("the simulated device has one device, and no index to leave out")
    x = gpu.zeros(4)
    for schedule in (Schedule.synchronous(), Schedule.pipelined()):
        g = TaskGraph(device=torch.device("cuda"))
        g.add_task("a", TaskKind.OPTIMIZER_CHUNK, lambda ctx: x.add_(1))
        ex = pipeoff.execute(g, schedule)
        for comp in ex.events_for(["a"]):
            comp.wait()
        ex.wait()
    assert torch.equal(gpu.read(x), torch.full((4,), 2.0, device=gpu.device).cpu())


@pytest.mark.parametrize("shape", ["synchronous", "host_task_on_a_device_lane"])
def test_host_and_device_tasks_on_one_lane_name_are_ordered(gpu: Gpu, shape: str) -> None:
    """On CUDA one lane name is both a host thread and a stream (a synchronous schedule
    with gates runs every task on "main"): the order between them is waited for."""
    seen: list[float] = []
    x = gpu.zeros(4)
    g = TaskGraph(device=gpu.device)
    g.add_gate("go")
    g.add_task("produce", TaskKind.OPTIMIZER_CHUNK, lambda ctx: x.fill_(3.0), gates=["go"])
    g.add_task("consume", TaskKind.HOST, lambda ctx: seen.append(float(x.sum())),
               deps=["produce"], lane="compute" if shape != "synchronous" else None)
    sched = Schedule.synchronous() if shape == "synchronous" else Schedule.pipelined()
    with pipeoff.testing.delay_task("produce", 0.05):
        ex = pipeoff.execute(g, sched)
        assert ex.backend == "cuda"
        ex.gate("go").open(None)
        ex.wait(timeout=30)
    assert seen == [12.0]


def test_a_gate_holds_back_only_its_own_lane(gpu: Gpu) -> None:
    """Each device lane is issued by its own thread: a producer that needs an ungated
    task on another lane before it opens the gate does not deadlock."""
    x = gpu.zeros(4)
    g = TaskGraph(device=gpu.device)
    g.add_gate("grad")
    g.add_task("copy", TaskKind.D2H, lambda ctx: None, gates=["grad"])
    g.add_task("prep", TaskKind.OPTIMIZER_CHUNK, lambda ctx: x.fill_(1.0))  # added later
    ex = pipeoff.execute(g)
    ex.wait("prep", timeout=30)
    ex.gate("grad").open(x)
    ex.wait(timeout=30)


def test_a_device_error_surfacing_in_a_host_tasks_wait_fails_it_instead_of_hanging(
        gpu: Gpu) -> None:
    """A sticky device error reported at the synchronize a HOST task does on its
    dependency (found by the full-offload tests: the task stayed pending forever)."""
    if not gpu.simulated:
        pytest.skip("needs a kernel that fails on purpose")
    from pipeoff import _accel

    def boom() -> None:
        raise RuntimeError("device fault")

    g = pipeoff.TaskGraph(gpu.device)
    g.add_task("dev", pipeoff.TaskKind.D2H, lambda ctx: _accel.current().launch(ctx.stream, boom))
    g.add_task("host", pipeoff.TaskKind.HOST, lambda ctx: None, deps=["dev"])
    ex = pipeoff.execute(g)
    with pytest.raises(RuntimeError, match="device fault"):
        ex.wait(timeout=30)
    assert ex.failed_task in ("dev", "host")
    assert ex.events_for("host")[0].status in ("failed", "cancelled")


def test_a_host_task_reads_device_work_a_host_task_before_it_on_its_lane_enqueued(
        gpu: Gpu) -> None:
    """Two HOST tasks on one lane, the second depending on the first: the device work
    the first enqueued on its thread's stream (a late copy to the host) is done
    before the second reads its result on the host (issue 21: same-lane order
    was left to the lane's FIFO, which orders the host sides only)."""

    def scenario() -> None:
        x = gpu.zeros(1 << 10)
        x.fill_(5.0)
        host = gpu.host(1 << 10)
        seen: list[float] = []
        accel = gpu.accel

        def fetch(ctx: pipeoff.TaskContext) -> None:
            stream = accel.current_stream(gpu.device)
            accel.sleep(stream, 0.03)  # the copy is late on this thread's stream
            host.copy_(x, non_blocking=True)

        g = TaskGraph(device=gpu.device)
        g.add_task("fetch", TaskKind.HOST, fetch, lane="bookkeeping")
        g.add_task("decide", TaskKind.HOST, lambda ctx: seen.append(float(host.sum())),
                   deps=["fetch"], lane="bookkeeping")
        pipeoff.execute(g).wait()
        assert seen == [5.0 * (1 << 10)]

    _mutated(gpu, "host_sync", scenario)
