"""The host side of each wait of the CUDA backend, its failure paths, and the ``Cuda`` class.

Each test here is the one that fails when a synchronization in the code is
removed or weakened (the mutants of ``tests/mutation/mutants.py`` name them):
a host thread reading pinned memory that a stream still writes, a pooled block
reused after a failure, the real :class:`pipeoff._accel.Cuda` class losing its
stream. They run on the simulated device, where the race is a
``DataRaceError`` whatever the threads' timing; on a GPU they are plain
correctness checks.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

import pipeoff
import pipeoff.testing
from pipeoff import Schedule, TaskGraph, TaskKind
from pipeoff.executor._run import Run
from tests.gpu_device import Gpu

N = 256


def _late_copy(gpu: Gpu, out: torch.Tensor, value: float, stream: Any = None) -> None:
    """Copy ``value``s into pinned ``out`` on ``stream`` (the current one), which is late."""
    accel = gpu.accel
    stream = accel.current_stream(gpu.device) if stream is None else stream
    accel.sleep(stream, 0.05)
    with accel.use_stream(stream):
        src = gpu.tensor(torch.full((N,), value))
        out.copy_(src, non_blocking=True)


def _issued(ex: pipeoff.Execution, task: str, gpu: Gpu) -> None:
    """Block until ``task`` is issued (not run: its stream may be late)."""
    ex.events_for(task)[0].wait(gpu.accel.new_stream(gpu.device))


def _copy_out_then_fail(gpu: Gpu, host: torch.Tensor) -> TaskGraph:
    """A staging block filled, copied out into ``host`` (on the d2h lane: late under
    ``delay_lane``), then a task "boom" that a test makes fail."""
    g = TaskGraph(device=gpu.device)
    g.add_buffer("stage", 4 * N)
    g.add_task("fill", TaskKind.H2D,
               lambda ctx: ctx.buffer("stage", torch.float32).fill_(1.0), buffers=["stage"])
    g.add_task("back", TaskKind.D2H,
               lambda ctx: host.copy_(ctx.buffer("stage", torch.float32), non_blocking=True),
               deps=["fill"], buffers=["stage"])
    g.add_task("boom", TaskKind.OPTIMIZER_CHUNK, None, deps=["back"])
    return g


def _overwrite(gpu: Gpu) -> TaskGraph:
    """Another execution writing a block of the same size (the pool hands it the free one)."""
    g = TaskGraph(device=gpu.device)
    g.add_buffer("stage", 4 * N)
    g.add_task("overwrite", TaskKind.H2D,
               lambda ctx: ctx.buffer("stage", torch.float32).fill_(2.0), buffers=["stage"])
    return g


def test_a_dependency_seen_finished_is_seen_issued(gpu: Gpu, monkeypatch: Any) -> None:
    """A consumer woken by its dependency's finish must find its end event recorded
    (hazard: the task marked issued only after its waiters were woken, which then
    skip the stream wait)."""
    finish = Run.finish

    def descheduled_after_finish(self: Run, i: int, status: int) -> None:
        finish(self, i, status)
        if self.tasks[i].name == "produce":
            time.sleep(0.05)  # the issuing thread loses the CPU right here

    monkeypatch.setattr(Run, "finish", descheduled_after_finish)
    x = gpu.zeros(N)
    out = gpu.zeros(())
    g = TaskGraph(device=gpu.device)
    g.add_task("produce", TaskKind.H2D, lambda ctx: x.fill_(1.0))
    g.add_task("consume", TaskKind.OPTIMIZER_CHUNK, lambda ctx: out.copy_(x.sum()),
               deps=["produce"])
    with pipeoff.testing.delay_lane("h2d", 0.05):
        ex = pipeoff.execute(g)
    ex.wait()
    assert gpu.read(out).item() == float(N)


def test_a_cancelled_last_user_releases_its_block_after_the_issued_ones(gpu: Gpu) -> None:
    """After a failure, the block's last user is cancelled; the block goes back to the
    pool ready after the last user that was issued (still reading on a late stream)."""
    host = gpu.host(N)
    g = _copy_out_then_fail(gpu, host)
    g.add_task("last", TaskKind.D2H, lambda ctx: None, deps=["boom"], buffers=["stage"])
    with pipeoff.testing.delay_lane("d2h", 0.05), pipeoff.testing.fail_task("boom"):
        first = pipeoff.execute(g)
    _issued(first, "last", gpu)  # cancelled: the block is back in the pool
    second = pipeoff.execute(_overwrite(gpu))
    second.wait()
    with pytest.raises(RuntimeError, match="injected"):
        first.wait()
    gpu.synchronize()
    assert torch.all(host == 1.0)


def test_a_retired_block_is_freed_only_once_its_last_user_has_run(gpu: Gpu) -> None:
    """``ctx.retire_buffer`` (a collective's buffer that may still be written) drops the
    block instead of returning it to the pool: only once its last user's stream work
    has run (hazard: the caching allocator handing the memory to the next allocation
    at once while a late stream still copies out of it; the simulated device's find,
    a Ctrl-C in a LocalSGD all-reduce's wait)."""
    host = gpu.host(N)
    g = TaskGraph(device=gpu.device)
    g.add_buffer("stage", 4 * N)

    def fill(ctx: Any) -> None:
        ctx.buffer("stage", torch.float32).fill_(1.0)
        ctx.retire_buffer("stage")

    g.add_task("fill", TaskKind.H2D, fill, buffers=["stage"])
    g.add_task("back", TaskKind.D2H,
               lambda ctx: host.copy_(ctx.buffer("stage", torch.float32), non_blocking=True),
               deps=["fill"], buffers=["stage"])
    pool = pipeoff.pools_for(gpu.device).device
    with pipeoff.testing.delay_lane("d2h", 0.05):
        ex = pipeoff.execute(g)
    _issued(ex, "back", gpu)  # the last user: the block is dropped from the pool
    pipeoff.execute(_overwrite(gpu)).wait()
    ex.wait()
    gpu.synchronize()
    assert torch.all(host == 1.0)
    assert pool.stats().live_bytes == 0


def test_a_failed_execution_is_finalized_after_its_device_work(gpu: Gpu) -> None:
    """A failure re-raised by ``wait(task)`` finalizes the execution: its events and
    blocks are recycled only once its issued work has run (hazard: a block whose
    copy-out still reads it handed to the next execution without a fence)."""
    host = gpu.host(N)
    g = _copy_out_then_fail(gpu, host)
    with pipeoff.testing.delay_lane("d2h", 0.05), pipeoff.testing.fail_task("boom"):
        first = pipeoff.execute(g)
    _issued(first, "boom", gpu)
    with pytest.raises(RuntimeError, match="injected"):
        first.wait("fill")  # re-raises the failure, and finalizes
    pipeoff.execute(_overwrite(gpu)).wait()
    gpu.synchronize()
    assert torch.all(host == 1.0)


def test_waiting_for_a_host_task_waits_for_the_device_work_it_enqueued(gpu: Gpu) -> None:
    """``wait(task)`` of a HOST task covers what it enqueued on its thread's stream."""
    out = gpu.host(N)
    g = TaskGraph(device=gpu.device)
    g.add_task("h", TaskKind.HOST, lambda ctx: _late_copy(gpu, out, 7.0))
    ex = pipeoff.execute(g)
    ex.wait("h")
    assert torch.all(out == 7.0)  # a host read of pinned memory
    ex.wait()


def test_waiting_for_a_device_task_synchronizes_the_host(gpu: Gpu) -> None:
    """``wait(task)`` of a device task: the host may read what it wrote."""
    out = gpu.host(N)
    src = gpu.tensor(torch.full((N,), 5.0))
    g = TaskGraph(device=gpu.device)
    g.add_task("copy", TaskKind.D2H, lambda ctx: out.copy_(src, non_blocking=True))
    with pipeoff.testing.delay_lane("d2h", 0.05):
        ex = pipeoff.execute(g)
    ex.wait("copy")
    assert torch.all(out == 5.0)
    ex.wait()


def test_a_host_task_blocks_on_its_gates_event(gpu: Gpu) -> None:
    """A HOST task reads a gate's payload only after the producer's device work: the
    host thread waits for the event (a stream wait would order only device work)."""
    out = gpu.host(N)
    seen: list[float] = []
    g = TaskGraph(device=gpu.device)
    g.add_gate("grad")
    g.add_task("read", TaskKind.HOST, lambda ctx: seen.append(float(ctx.gate("grad").sum())),
               gates=["grad"])
    ex = pipeoff.execute(g)
    producer = gpu.accel.new_stream(gpu.device, name="producer")
    producer.wait_stream(gpu.current_stream())
    with gpu.accel.use_stream(producer):
        _late_copy(gpu, out, 3.0, producer)
        ex.gate("grad").open(out)  # ready after the producer's stream, so far
    ex.wait()
    assert seen == [3.0 * N]


def test_a_host_task_fences_a_pinned_block_a_cuda_execution_released(gpu: Gpu) -> None:
    """A host task taking a pooled pinned block whose last user (a copy into it on a
    late stream) was issued, not run, waits for it on the host."""
    src = gpu.tensor(torch.full((N,), 4.0))
    g = TaskGraph(device=gpu.device)
    g.add_buffer("pinned", 4 * N, where="host")
    g.add_task("back", TaskKind.D2H,
               lambda ctx: ctx.buffer("pinned", torch.float32).copy_(src, non_blocking=True),
               buffers=["pinned"])
    with pipeoff.testing.delay_lane("d2h", 0.05):
        first = pipeoff.execute(g)
    _issued(first, "back", gpu)
    seen: list[float] = []
    g2 = TaskGraph(device=gpu.device)
    g2.add_buffer("pinned", 4 * N, where="host")

    def overwrite(ctx: pipeoff.TaskContext) -> None:
        view = ctx.buffer("pinned", torch.float32)
        view.fill_(2.0)
        seen.append(float(view.sum()))

    g2.add_task("overwrite", TaskKind.HOST, overwrite, buffers=["pinned"])
    second = pipeoff.execute(g2)
    second.wait()
    first.wait()
    assert seen == [2.0 * N]


def test_an_inline_execution_finishes_each_task_on_the_device_before_the_next(
        gpu: Gpu) -> None:
    """The synchronous schedule: a host task after a device copy reads its result."""
    out = gpu.host(N)
    seen: list[float] = []
    g = TaskGraph(device=gpu.device)
    g.add_task("copy", TaskKind.D2H, lambda ctx: _late_copy(gpu, out, 6.0))
    g.add_task("read", TaskKind.HOST, lambda ctx: seen.append(float(out.sum())),
               deps=["copy"])
    ex = pipeoff.execute(g, Schedule.synchronous())
    assert ex.backend == "inline"
    ex.wait()
    assert seen == [6.0 * N]


# -- the Cuda class itself (it runs on the simulated device's fake of torch.cuda) ------
def test_synchronize_waits_for_every_stream_of_the_device(gpu: Gpu) -> None:
    out = gpu.host(N)
    stream = gpu.accel.new_stream(gpu.device)
    stream.wait_stream(gpu.current_stream())
    _late_copy(gpu, out, 8.0, stream)
    gpu.accel.synchronize(gpu.device)
    assert torch.all(out == 8.0)


def test_the_simulated_device_runs_the_real_cuda_class(gpu: Gpu) -> None:
    if not gpu.simulated:
        pytest.skip("on a GPU the class is torch.cuda's already")
    from pipeoff import _accel

    accel = _accel.current()
    assert type(accel) is _accel.Cuda and accel.runtime is gpu.sim.runtime
    # Lanes' streams come from cudaStreamCreateWithPriority, non-blocking, copies first.
    from pipeoff.executor.cuda import lane_stream

    h2d, compute = lane_stream(gpu.device, "h2d"), lane_stream(gpu.device, "compute")
    flags = gpu.sim.runtime.stream_flags
    assert flags[h2d] == flags[compute] == 1
    assert h2d.priority == -1 and compute.priority == 0
    # Large pinned allocations are page-locked in place (cudaHostRegister), and
    # unregistered when their last user goes.
    big = gpu.accel.host_empty((_accel.REGISTER_MIN_BYTES // 4,), torch.float32, pinned=True)
    assert gpu.accel.is_pinned(big) and gpu.sim.runtime.registered
    del big
    import gc

    gc.collect()
    assert not gpu.sim.runtime.registered


def test_a_gate_is_seen_open_only_with_its_event(gpu: Gpu, monkeypatch: Any) -> None:
    """A lane that sees a gate open finds its payload's event too (hazard: the state
    published first, the lane skipping the wait on the producer's stream). The
    producer's thread is held right after it leaves the gate's lock."""
    import threading

    from pipeoff.executor._gates import GateStates

    opener = threading.current_thread()

    class _HeldOnExit:
        """The gates' lock, its opener's thread held right after it releases it."""

        def __init__(self) -> None:
            self._lock = threading.Lock()
            self.acquire, self.release = self._lock.acquire, self._lock.release

        def __enter__(self) -> bool:
            return self._lock.__enter__()

        def __exit__(self, *exc: Any) -> None:
            self._lock.__exit__(*exc)
            if threading.current_thread() is opener:
                time.sleep(0.05)

    init = GateStates.__init__

    def held(self: GateStates, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self._lock = _HeldOnExit()  # type: ignore[assignment]  # before any lane waits on it
        self._cond = threading.Condition(self._lock)  # type: ignore[arg-type]

    monkeypatch.setattr(GateStates, "__init__", held)

    out = gpu.zeros(N)
    g = TaskGraph(device=gpu.device)
    g.add_gate("grad")
    g.add_task("copy", TaskKind.D2H, lambda ctx: out.copy_(ctx.gate("grad")), gates=["grad"])
    ex = pipeoff.execute(g)
    producer = gpu.accel.new_stream(gpu.device, name="producer")
    producer.wait_stream(gpu.current_stream())
    with gpu.accel.use_stream(producer):
        gpu.accel.sleep(producer, 0.05)
        grad = gpu.tensor(torch.full((N,), 5.0))
        ex.gate("grad").open(grad)
    ex.wait()
    assert torch.all(gpu.read(out) == 5.0)
