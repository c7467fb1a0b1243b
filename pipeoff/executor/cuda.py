"""The CUDA backend: device tasks on lane streams, host tasks on host lanes; never blocks.

Every CUDA call goes through :mod:`pipeoff._accel` (tests run this backend on
the simulated device of :mod:`pipeoff.testing`).

* **Device tasks** are issued in plan order by a dispatch thread (an instance
  of the ``cuda-dispatch`` lane), each between a start and an end event on its
  lane's stream. A cross-lane dependency is ``wait_event`` on the consumer's
  stream, so the host never blocks for it. Issue is not windowed unless the
  schedule asks for it: a forward hook waiting for a chunk needs only that
  chunk's end event to be recorded.
* **Host tasks** (a CPU optimizer chunk, a ``should_commit`` RPC) run on
  host-lane threads, one FIFO per lane as on the threads backend, so they
  never stall the issue of the copies behind them. A host task first
  host-synchronizes the device tasks it depends on (blocking events: no spin);
  a device task that depends on a host task is issued once that host task has
  finished.
* **Streams** are created once per process, device and lane instance, and an
  execution in flight holds its lanes' streams until its device work is done:
  another execution takes another instance, so neither waits behind the
  other's ``wait_event`` (see ``docs/concepts.md``).
* **Times** come from timing events kept apart from the dependency events,
  placed on the host clock by an offset calibrated per device.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from typing import Any

import torch

from pipeoff import _accel, _faults
from pipeoff.executor import threads
from pipeoff.executor._run import CANCELLED, FAILED, OK, Run
from pipeoff.graph import TaskContext, TaskKind

DISPATCH_LANE = "cuda-dispatch"
"""The host lane whose instances issue device tasks (one per execution in flight)."""
_COPY_LANES = ("h2d", "d2h")
_RECALIBRATE_S = 60.0  # timing-event offsets drift; re-measure at most this often


class _StreamSlot:
    __slots__ = ("holder", "stream")

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.holder: Run | None = None


_streams: dict[tuple[Any, torch.device, str], list[_StreamSlot]] = {}
_streams_lock = threading.Lock()
_events: dict[tuple[Any, torch.device, bool], list[Any]] = {}
_events_lock = threading.Lock()
_calibration: dict[tuple[Any, torch.device], tuple[Any, int, float]] = {}
_calibration_lock = threading.Lock()


def _new_stream(accel: _accel.Accelerator, device: torch.device, lane: str) -> Any:
    # Copy lanes at high priority: their copies are short and gate compute;
    # they should not queue behind the optimizer's kernels.
    return accel.new_stream(device, priority=-1 if lane in _COPY_LANES else 0, name=lane)


def lane_stream(device: torch.device, lane: str) -> Any:
    """The first stream of ``lane`` on ``device``, created on first use and kept."""
    accel = _accel.current()
    with _streams_lock:
        slots = _streams.setdefault((accel, device, lane), [])
        if not slots:
            slots.append(_StreamSlot(_new_stream(accel, device, lane)))
        return slots[0].stream


def _holder_done(run: Run) -> bool:
    """Whether an execution holding streams has finished on the host and the device."""
    if not run.complete:
        return False
    state: _CudaRunState | None = run.backend_state
    return state is None or all(not d or e.query() for d, e in zip(state.dispatched, state.ends))


def _acquire_streams(accel: _accel.Accelerator, device: torch.device, lanes: list[str],
                     run: Run) -> dict[str, Any]:
    """A stream per lane that no other execution with device work pending holds."""
    out: dict[str, Any] = {}
    with _streams_lock:
        for lane in lanes:
            slots = _streams.setdefault((accel, device, lane), [])
            slot = next((s for s in slots if s.holder is None
                         or (s.holder is not run and _holder_done(s.holder))), None)
            if slot is None:
                slot = _StreamSlot(_new_stream(accel, device, lane))
                slots.append(slot)
            slot.holder = run
            out[lane] = slot.stream
    return out


def _release_streams(run: Run) -> None:
    with _streams_lock:
        for slots in _streams.values():
            for s in slots:
                if s.holder is run:
                    s.holder = None


def _take_events(accel: _accel.Accelerator, device: torch.device, n: int,
                 timing: bool) -> list[Any]:
    key = (accel, device, timing)
    with _events_lock:
        pool = _events.setdefault(key, [])
        take = pool[-n:] if n else []
        del pool[len(pool) - len(take):]
    with accel.use_device(device):
        take.extend(accel.new_event(timing=timing) for _ in range(n - len(take)))
    return take


def _give_events(accel: _accel.Accelerator, device: torch.device, events: list[Any],
                 timing: bool) -> None:
    with _events_lock:
        _events.setdefault((accel, device, timing), []).extend(events)


def _clock(accel: _accel.Accelerator, device: torch.device) -> tuple[Any, int]:
    """A timing event and the host time (``perf_counter_ns``) at which it completed.

    GPU times of later timing events are ``host_ns + elapsed_time(event, ev)``:
    on the host clock, as hook waits and recorders are. Measured on an idle
    stream of its own (no stall of the caller's work), again after
    ``_RECALIBRATE_S`` (elapsed times are single-precision milliseconds).
    """
    key = (accel, device)
    now = time.monotonic()
    with _calibration_lock:
        cal = _calibration.get(key)
        if cal is not None and now - cal[2] < _RECALIBRATE_S:
            return cal[0], cal[1]
        stream = lane_stream(device, "clock")
        with accel.use_device(device):
            ev = accel.new_event(timing=True)
        ev.record(stream)
        ev.synchronize()
        host_ns = time.perf_counter_ns()
        _calibration[key] = (ev, host_ns, now)
        return ev, host_ns


def _host_device_order(run: Run) -> list[tuple[int, ...]]:
    """Per task, the previous task of its lane that runs on the other side (a HOST task
    on a host thread, a device task on a stream), which it must also wait for; and
    per HOST task, its HOST dependencies on its own lane (device work they enqueued).

    A plan leaves same-lane order to the lane's FIFO; on CUDA one lane name is both
    a host thread and a stream (a synchronous schedule puts every task on "main"),
    so that order has to be waited for explicitly between the two.
    """
    lanes = run.plan.lanes
    index = {t.name: k for k, t in enumerate(run.tasks)}
    last: dict[str, tuple[int | None, int | None]] = {}
    out: list[tuple[int, ...]] = []
    for i, task in enumerate(run.tasks):
        host_last, dev_last = last.get(lanes[i], (None, None))
        is_host = task.kind is TaskKind.HOST
        other = dev_last if is_host else host_last
        waits: tuple[int, ...] = () if other is None else (other,)
        if is_host:
            # A HOST dependency on the same lane ran first on this thread (the
            # lane's FIFO), but the device work it enqueued on the thread's
            # stream may still run: its end event is synchronized like any.
            waits += tuple(j for j in (index[d] for d in task.deps)
                           if lanes[j] == lanes[i] and run.tasks[j].kind is TaskKind.HOST)
        out.append(waits)
        last[lanes[i]] = (i, dev_last) if is_host else (host_last, i)
    return out


class _CudaRunState:
    __slots__ = ("accel", "clock", "device", "dispatched", "ends", "base", "extra_waits",
                 "host_recorded", "starts_t", "ends_t", "streams")

    def __init__(self, run: Run, accel: _accel.Accelerator, device: torch.device) -> None:
        n = run.n
        self.accel = accel
        self.device = device
        # Dependency events: blocking (a host synchronize sleeps, not spins), no timing.
        deps = _take_events(accel, device, n + 1, timing=False)
        self.base = deps[0]
        self.ends = deps[1:]
        timing = _take_events(accel, device, 2 * n, timing=True)
        self.starts_t = timing[:n]
        self.ends_t = timing[n:]
        self.dispatched = [False] * n
        self.host_recorded = [False] * n
        """Per HOST task: its end event was recorded on its thread's stream after its
        work (which may have enqueued device work: torchft's heal in should_commit)."""
        self.streams: dict[str, Any] = {}
        self.extra_waits: list[tuple[int, ...]] = []
        self.clock = _clock(accel, device)


class CudaBackend:
    """Issues device tasks on lane streams and host tasks on host lanes; returns at once."""

    name = "cuda"

    def launch(self, run: Run) -> None:
        accel = _accel.current()
        device = accel.normalize(run.graph.device)
        state = _CudaRunState(run, accel, device)
        run.backend_state = state
        host = [i for i, t in enumerate(run.tasks) if t.kind is TaskKind.HOST]
        lanes = run.plan.lanes
        device_lanes = list(dict.fromkeys(lanes[i] for i in range(run.n)
                                          if run.tasks[i].kind is not TaskKind.HOST))
        host_lanes = list(dict.fromkeys(lanes[i] for i in host))
        state.streams = _acquire_streams(accel, device, device_lanes, run)
        state.extra_waits = _host_device_order(run)
        # Every lane starts after the work the caller has already enqueued (the
        # backward that produced the grads, the forward that wrote the params).
        state.base.record(accel.current_stream(device))
        # One dispatch thread per device lane, as the threads backend has one
        # thread per lane: a task that cannot be issued yet (a gate not open, a
        # dependency on another lane) holds back only its own lane's issue.
        dispatch = {lane: f"{DISPATCH_LANE}:{lane}" for lane in device_lanes}
        workers = threads.acquire([*dispatch.values(), *host_lanes], run)
        held = list(workers.values())
        run.on_complete(lambda: threads.release(held, run))
        now = time.perf_counter_ns() - run.origin_ns
        run.enqueue_ns = [now] * run.n
        for i in host:
            workers[lanes[i]].submit([functools.partial(self._run_host, run, state, i)])
        for lane in device_lanes:
            mine = [i for i in range(run.n)
                    if lanes[i] == lane and run.tasks[i].kind is not TaskKind.HOST]
            workers[dispatch[lane]].submit(
                [functools.partial(self._dispatch, run, state, lane, mine)])

    # -- device tasks ---------------------------------------------------------
    def _dispatch(self, run: Run, state: _CudaRunState, lane: str, mine: list[int]) -> None:
        """Issue ``lane``'s device tasks, in plan order."""
        accel = state.accel
        window = run.window
        with accel.use_device(state.device):
            for n, i in enumerate(mine):
                try:
                    if window is not None and i >= window:
                        # Flow control (Schedule.max_in_flight), on this thread only.
                        self.synchronize(run, i - window, None)
                    self._issue(run, state, i, first=n == 0)
                except BaseException as err:  # a sticky CUDA error, an allocator failure
                    run.fail(i, err)
                    if not run.terminal(i):
                        self._cancel(run, state, i)

    def _cancel(self, run: Run, state: _CudaRunState, i: int) -> None:
        run.cancel(i, ready_of=functools.partial(self._last_ready, run, state, before=i))

    @staticmethod
    def _last_ready(run: Run, state: _CudaRunState, buffer: str, before: int) -> Any:
        """End event of the last issued user of ``buffer`` before task ``before``.

        Users of a buffer are chained, so that event covers all of them: the
        block must not be reused before it (hazard: an issued user still
        reading or writing the block on its stream).
        """
        for k in range(before - 1, -1, -1):
            if state.dispatched[k] and buffer in run.tasks[k].buffers:
                return state.ends[k]
        return None

    def _issue(self, run: Run, state: _CudaRunState, i: int, *, first: bool) -> None:
        accel = state.accel
        task = run.tasks[i]
        lane = run.plan.lanes[i]
        stream = state.streams[lane]
        if first and not _faults.disabled("base_wait"):
            # Hazard: reading tensors the caller's stream is still producing.
            stream.wait_event(state.base)
        for j in (*run.plan.waits[i], *state.extra_waits[i]):
            # Issued (by its own lane's dispatcher) or done (a host task): only
            # then is its end event recorded, and can a stream wait on it.
            run.wait_terminal(j)
            if run.tasks[j].kind is TaskKind.HOST:
                if state.host_recorded[j] and not _faults.disabled("host_task_event"):
                    # Hazard: device work the host task enqueued on its thread's
                    # stream (torchft's should_commit loading a healed state
                    # into the parameters) still running when this task writes.
                    stream.wait_event(state.ends[j])
            elif state.dispatched[j] and not _faults.disabled("cross_lane_wait"):
                # Hazard: starting before a dependency (or the previous user of a
                # buffer, or a budget release) on another lane has finished.
                stream.wait_event(state.ends[j])
        gates = run.task_gates[i]
        if gates:
            run.wait_gates(i, host=False)  # this dispatch thread waits, not the caller
        if run.error is not None and not task.must_run:
            self._cancel(run, state, i)
            return
        for k in gates:
            ev = run.gates.event[k]
            if ev is None:
                continue
            if not _faults.disabled("gate_wait"):
                # Hazard: reading a gate's payload that the producer's stream (or
                # another execution) is still writing.
                ev.wait(stream)
            # Hazard: going on from another execution's task that failed or was
            # cancelled (its payload never written, its failure lost with it).
            run.check_gate_event(k)
        try:
            # Allocate on the lane's stream: a fresh block then cannot be memory
            # that another stream freed with its kernels still pending.
            with accel.use_stream(stream):
                blocks = run.acquire(i)
        except BaseException as err:  # an out-of-memory allocating staging
            run.fail(i, err)
            self._cancel(run, state, i)
            return
        for block in blocks:
            if block.ready is not None and not _faults.disabled("block_fence"):
                # Hazard: reusing a pooled block while its previous last user
                # (another execution's stream work) may still read or write it.
                stream.wait_event(block.ready)
        outcome = [OK]
        state.starts_t[i].record(stream)
        if run.hooks:
            delay = _faults.delay_for(task.name, lane, run.hooks)
            if delay:
                accel.sleep(stream, delay)  # a GPU-side sleep: the stream is late
        # The context (the staging views) is made now: on the simulated device
        # the work runs later, after this task's staging has been released.
        ctx = TaskContext(task=task, lane=lane, buffers=run.views(i), stream=stream,
                          results=run.results, retire=run.retired.add,
                          gates=run.gates.payloads(gates),
                          on_moved=functools.partial(run.moved.__setitem__, i))
        accel.launch(stream, functools.partial(self._device_work, run, state, i, ctx, outcome))
        # The timing event first: a consumer waiting on the end event then starts
        # after this task's recorded end (the trace's staging timeline needs it).
        state.ends_t[i].record(stream)
        state.ends[i].record(stream)
        state.dispatched[i] = True
        run.release(i, ready=state.ends[i])
        run.finish(i, outcome[0])

    def _device_work(self, run: Run, state: _CudaRunState, i: int, ctx: TaskContext,
                     outcome: list[int]) -> None:
        """A device task's work, run by its issue with ``stream`` current (its kernels
        are enqueued there; on the simulated device too, through ``Cuda.launch``)."""
        task = run.tasks[i]
        lane = run.plan.lanes[i]
        if run.error is not None and not task.must_run and run.error_task != task.name:
            # Another lane failed since this task's issue began (its waits, its
            # staging): it is cancelled, as a failure before its issue would have.
            outcome[0] = CANCELLED
            return
        try:
            if run.hooks:
                _faults.run_hooks(task.name, lane, sleep=False, hooks=run.hooks)
            if task.work is not None:
                name = f"pipeoff::{task.kind.value}::{task.name}"
                ctx.failed = run.error
                ctx.failed_task = run.error_task
                with state.accel.range(name), torch.profiler.record_function(name), (
                        _faults.failing_work(task.name, lane, run.hooks) if run.hooks
                        else contextlib.nullcontext()):
                    result = run._call(i, task.work, ctx)
                if result is not None:
                    run.results[task.name] = result
        except BaseException as err:
            run.fail(i, err)
            outcome[0] = FAILED

    # -- host tasks -----------------------------------------------------------
    def _run_host(self, run: Run, state: _CudaRunState, i: int) -> None:
        """A host task on its host lane: wait for its dependencies, then run on this thread.

        No lane stream is current here: work that enqueues device work (torchft's
        ``should_commit`` synchronizing) does so on this thread's current stream.
        """
        try:
            for j in (*run.plan.waits[i], *state.extra_waits[i]):
                run.wait_terminal(j)
                if ((state.dispatched[j] or state.host_recorded[j])
                        and not _faults.disabled("host_sync")):
                    # Hazard: host work reading device results, or deciding on them,
                    # before the device work it follows has finished.
                    state.ends[j].synchronize()
        except BaseException as err:  # a sticky device error surfacing in the wait
            # The task fails (and its dependents are cancelled): left pending, it
            # would hold every waiter on it forever.
            run.fail(i, err)
            if not run.terminal(i):
                self._cancel(run, state, i)
            return

        def record_end() -> None:
            # The host work may have enqueued device work on this thread's current
            # stream; dependents wait for that with this event.
            with state.accel.use_device(state.device):
                state.ends[i].record(state.accel.current_stream(state.device))
            state.host_recorded[i] = True

        run.run_task(i, run.plan.lanes[i], waited=True, after=record_end)

    def check_wait(self, run: Run, i: int | None) -> None:
        threads.refuse_wait_on_own_lane(run, i)  # host tasks run on host lanes

    # -- completion -----------------------------------------------------------
    # After finalize() the run's events are back in the pool (backend_state is
    # None): every task is complete on the device, so these calls have nothing
    # left to wait for.
    def query(self, run: Run, i: int) -> bool:
        if not run.terminal(i):
            return False
        state: _CudaRunState | None = run.backend_state
        return state is None or not (state.dispatched[i] or state.host_recorded[i]) or (
            state.ends[i].query())

    def synchronize(self, run: Run, i: int, deadline: float | None) -> bool:
        if not run.wait_terminal(i, deadline):
            return False
        state: _CudaRunState | None = run.backend_state
        if state is None or not (state.dispatched[i] or state.host_recorded[i]):
            return True
        if deadline is None:
            state.ends[i].synchronize()
            return True
        while not state.ends[i].query():
            if time.monotonic() >= deadline:
                return False
            time.sleep(1e-4)
        state.ends[i].synchronize()  # the host's view of the device work (no wait now)
        return True

    def synchronize_all(self, run: Run, deadline: float | None) -> bool:
        if _faults.disabled("execution_sync"):
            return True
        return all(self.synchronize(run, i, deadline) for i in range(run.n))

    def stream_wait(self, run: Run, i: int, stream: Any) -> None:
        # The end event must be recorded before a stream can wait on it: wait for
        # the task's issue (a host task: for its end, and the event it recorded).
        run.wait_terminal(i)
        state: _CudaRunState | None = run.backend_state
        if state is None or not (state.dispatched[i] or state.host_recorded[i]):
            return
        target = stream if stream is not None else state.accel.current_stream(state.device)
        # Hazard: the reader's stream running ahead of the task that writes its inputs.
        target.wait_event(state.ends[i])

    def resolve_times(self, run: Run) -> None:
        state: _CudaRunState | None = run.backend_state
        if state is None:  # already resolved when the run was finalized
            return
        clock, host_ns = state.clock
        for i in range(run.n):
            if state.dispatched[i] and run.status[i] != CANCELLED:
                # elapsed_time is in ms; put it on the host clock of the run's origin.
                run.start_ns[i] = (host_ns + int(clock.elapsed_time(state.starts_t[i]) * 1e6)
                                   - run.origin_ns)
                run.end_ns[i] = (host_ns + int(clock.elapsed_time(state.ends_t[i]) * 1e6)
                                 - run.origin_ns)

    def finalize(self, run: Run) -> None:
        state: _CudaRunState | None = run.backend_state
        if state is None or not run.complete:
            return
        # Every task has been issued; wait until the device has run them too.
        # Hazard: reading timings of, or recycling, events still pending, and
        # clearing "ready" markers of blocks whose last user is still running.
        self.synchronize_all(run, None)
        self.resolve_times(run)
        # The events go back to the pool and will be recorded again by later
        # runs; a pooled block must not keep one as its "ready" marker.
        ends = set(state.ends)
        for pool in (run.pools.device, run.pools.host):
            pool.forget_events(ends)
        _give_events(state.accel, state.device, [state.base, *state.ends], timing=False)
        _give_events(state.accel, state.device, [*state.starts_t, *state.ends_t], timing=True)
        run.backend_state = None
        _release_streams(run)
