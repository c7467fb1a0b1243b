"""The CUDA backend: one stream per lane, events across lanes, the host never blocks.

Streams are created once per process and device and reused by every
execution (creating streams per step leaks caching-allocator pools). Each task
is enqueued on its lane's stream between two timing events; its end event is
its completion. A cross-lane dependency is ``wait_event`` on the consumer's
stream. Tasks are issued in plan order, so an event is always recorded before
any stream waits on it.

As on the threads backend, an execution in flight holds its lanes' streams: a
``wait_event`` that an execution enqueued (a write-back waiting for a commit)
sits at the head of its stream, and another execution's copies behind it would
wait too. A launch that finds a lane's stream held by another execution whose
device work is not done takes (or creates) another stream for that lane.
Executions run one after the other reuse the first.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Any

import torch

from pipeoff import testing
from pipeoff.executor import _exit
from pipeoff.executor._run import CANCELLED, FAILED, OK, Run
from pipeoff.graph import TaskContext, TaskKind


class _StreamSlot:
    __slots__ = ("holder", "stream")

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.stream = stream
        self.holder: Run | None = None


_streams: dict[tuple[torch.device, str], list[_StreamSlot]] = {}
_streams_lock = threading.Lock()
_events: dict[torch.device, list[torch.cuda.Event]] = {}
_events_lock = threading.Lock()
_SLEEP_CYCLES_PER_S = 1.98e9  # torch.cuda._sleep spins in clock cycles; ~H200 boost clock


def lane_stream(device: torch.device, lane: str) -> torch.cuda.Stream:
    """The first stream of ``lane`` on ``device``, created on first use and kept."""
    with _streams_lock:
        slots = _streams.setdefault((device, lane), [])
        if not slots:
            slots.append(_StreamSlot(torch.cuda.Stream(device=device)))
        return slots[0].stream


def _holder_done(run: Run) -> bool:
    """Whether an execution holding streams has finished on the host and the device."""
    if not run.complete:
        return False
    state: _CudaRunState | None = run.backend_state
    return state is None or all(not d or e.query() for d, e in zip(state.dispatched, state.ends))


def _acquire_streams(device: torch.device, lanes: list[str], run: Run
                     ) -> dict[str, torch.cuda.Stream]:
    """A stream per lane that no other execution with device work pending holds."""
    out: dict[str, torch.cuda.Stream] = {}
    with _streams_lock:
        for lane in lanes:
            slots = _streams.setdefault((device, lane), [])
            slot = next((s for s in slots if s.holder is None
                         or (s.holder is not run and _holder_done(s.holder))), None)
            if slot is None:
                slot = _StreamSlot(torch.cuda.Stream(device=device))
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


def _take_events(device: torch.device, n: int) -> list[torch.cuda.Event]:
    with _events_lock:
        pool = _events.setdefault(device, [])
        take = pool[-n:] if n else []
        del pool[len(pool) - len(take):]
    with torch.cuda.device(device):
        take.extend(torch.cuda.Event(enable_timing=True) for _ in range(n - len(take)))
    return take


def _give_events(device: torch.device, events: list[torch.cuda.Event]) -> None:
    with _events_lock:
        _events.setdefault(device, []).extend(events)


class _CudaRunState:
    __slots__ = ("base", "device", "dispatched", "ends", "starts", "streams")

    def __init__(self, n: int, device: torch.device) -> None:
        self.device = device
        evs = _take_events(device, 2 * n + 1)
        self.base = evs[0]
        self.starts = evs[1 : n + 1]
        self.ends = evs[n + 1 :]
        self.dispatched = [False] * n
        self.streams: dict[str, torch.cuda.Stream] = {}


# Windowed dispatch threads still running; exit joins them (pipeoff.executor._exit).
_dispatchers: set[threading.Thread] = set()
_dispatchers_lock = threading.Lock()


def join_dispatchers(deadline: float) -> list[str]:
    """Wait for the dispatch threads in flight (at exit); the names of those still running."""
    with _dispatchers_lock:
        threads = list(_dispatchers)
    return [t.name for t in threads if not _exit.join_until(t, deadline)]


class CudaBackend:
    """Enqueues each lane's tasks on its stream; :func:`pipeoff.execute` returns at once."""

    name = "cuda"

    def launch(self, run: Run) -> None:
        device = run.graph.device
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        state = _CudaRunState(run.n, device)
        run.backend_state = state
        state.streams = _acquire_streams(device, list(dict.fromkeys(run.plan.lanes)), run)
        caller = torch.cuda.current_stream(device)
        # Every lane starts after the work the caller has already enqueued
        # (the backward that produced the grads, the forward that wrote the
        # params): without this wait, a lane could read them half-written.
        state.base.record(caller)
        lookahead = run.plan.schedule.lookahead
        if lookahead is None or lookahead >= run.n:
            self._dispatch(run, state, device, None)
        else:
            t = threading.Thread(
                target=self._dispatch, args=(run, state, device, lookahead),
                name="pipeoff-cuda-dispatch", daemon=True,
            )
            _exit.ensure_registered()
            with _dispatchers_lock:
                _dispatchers.add(t)
            t.start()

    def _dispatch(
        self, run: Run, state: _CudaRunState, device: torch.device, lookahead: int | None
    ) -> None:
        try:
            self._dispatch_all(run, state, device, lookahead)
        finally:
            if lookahead is not None:
                with _dispatchers_lock:
                    _dispatchers.discard(threading.current_thread())

    def _dispatch_all(
        self, run: Run, state: _CudaRunState, device: torch.device, lookahead: int | None
    ) -> None:
        lanes = run.plan.lanes
        started: set[str] = set()
        last_on_lane: dict[str, int] = {}
        with torch.cuda.device(device):
            for i in range(run.n):
                try:
                    if lookahead is not None and i >= lookahead:
                        # Flow control on the dispatch thread (never the caller):
                        # keep the launch queue from filling up.
                        state.ends[i - lookahead].synchronize()
                    if run.error is not None and not run.tasks[i].must_run:
                        run.cancel(i, ready_of=functools.partial(self._last_ready, run, state,
                                                                 before=i))
                        continue
                    lane = lanes[i]
                    stream = state.streams[lane]
                    if lane not in started:
                        started.add(lane)
                        # Hazard: reading tensors the caller's stream is still producing.
                        stream.wait_event(state.base)
                    run.enqueue_ns[i] = time.perf_counter_ns() - run.origin_ns
                    self._issue(run, state, stream, i, last_on_lane.get(lane))
                    last_on_lane[lane] = i
                except BaseException as err:  # a sticky CUDA error, an allocator failure
                    run.fail(i, err)
                    if not run.terminal(i):
                        run.cancel(i, ready_of=functools.partial(self._last_ready, run, state,
                                                                 before=i))

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

    def _issue(self, run: Run, state: _CudaRunState, stream: torch.cuda.Stream, i: int,
               prev_on_lane: int | None) -> None:
        task = run.tasks[i]
        lane = run.plan.lanes[i]
        host = task.kind is TaskKind.HOST
        if host:
            # A host task (a CPU optimizer, a should_commit RPC) runs on this
            # thread. Hazard: host work reading device results, or deciding on
            # them, before the device work it follows has finished. On its own
            # lane FIFO order is the edge, so the lane's previous task counts.
            for j in (*run.plan.waits[i], *(() if prev_on_lane is None else (prev_on_lane,))):
                if state.dispatched[j]:
                    state.ends[j].synchronize()
        else:
            for j in run.plan.waits[i]:
                if state.dispatched[j]:  # a cancelled task records no event
                    # Hazard: starting before a dependency (or the previous user of a
                    # buffer, or a budget release) on another lane has finished.
                    stream.wait_event(state.ends[j])
        try:
            # Allocate on the lane's stream: a fresh block then cannot be memory
            # that another stream freed with its kernels still pending.
            with torch.cuda.stream(stream):
                blocks = run.acquire(i)
        except BaseException as err:  # an out-of-memory allocating staging
            run.fail(i, err)
            run.cancel(i, ready_of=lambda b: self._last_ready(run, state, b, i))
            return
        for block in blocks:
            if block.ready is None:
                continue
            if host:
                # Hazard: the CPU touching a pooled block that the previous
                # execution's last user may still be copying.
                block.ready.synchronize()
            else:
                # Hazard: reusing a pooled block while its previous last user
                # (another execution's stream work) may still read or write it.
                stream.wait_event(block.ready)
        status = OK
        name = f"pipeoff::{task.kind.value}::{task.name}"
        with torch.cuda.stream(stream):
            state.starts[i].record(stream)
            try:
                if testing.installed():
                    delay = testing.delay_for(task.name, lane)
                    if delay:
                        torch.cuda._sleep(int(delay * _SLEEP_CYCLES_PER_S))
                    testing.run_hooks(task.name, lane, sleep=False)
                if task.work is not None:
                    torch.cuda.nvtx.range_push(name)
                    try:
                        with torch.profiler.record_function(name):
                            ctx = TaskContext(task=task, lane=lane, buffers=run.views(i),
                                              stream=stream, results=run.results,
                                              retire=run.retired.add, failed=run.error)
                            result = run._call(i, task.work, ctx)
                    finally:
                        torch.cuda.nvtx.range_pop()
                    if result is not None:
                        run.results[task.name] = result
            except BaseException as err:
                status = FAILED
                run.fail(i, err)
            state.ends[i].record(stream)
        state.dispatched[i] = True
        run.release(i, ready=state.ends[i])
        run.finish(i, status)

    # -- completion -----------------------------------------------------------
    # After finalize() the run's events are back in the pool (backend_state is
    # None): every task is complete on the device, so these calls have nothing
    # left to wait for.
    def query(self, run: Run, i: int) -> bool:
        if not run.terminal(i):
            return False
        state: _CudaRunState | None = run.backend_state
        return state is None or not state.dispatched[i] or state.ends[i].query()

    def synchronize(self, run: Run, i: int, deadline: float | None) -> bool:
        if not run.wait_terminal(i, deadline):
            return False
        state: _CudaRunState | None = run.backend_state
        if state is None or not state.dispatched[i]:
            return True
        if deadline is None:
            state.ends[i].synchronize()
            return True
        while not state.ends[i].query():
            if time.monotonic() >= deadline:
                return False
            time.sleep(1e-4)
        return True

    def synchronize_all(self, run: Run, deadline: float | None) -> bool:
        return all(self.synchronize(run, i, deadline) for i in range(run.n))

    def stream_wait(self, run: Run, i: int, stream: Any) -> None:
        # The event must be recorded before a stream can wait on it; with a
        # lookahead window the task may not be issued yet, so wait for that.
        run.wait_terminal(i)
        state: _CudaRunState | None = run.backend_state
        if state is None or not state.dispatched[i]:
            return
        target = stream if stream is not None else torch.cuda.current_stream(run.graph.device)
        # Hazard: the reader's stream running ahead of the task that writes its inputs.
        target.wait_event(state.ends[i])

    def resolve_times(self, run: Run) -> None:
        state: _CudaRunState | None = run.backend_state
        if state is None:  # already resolved when the run was finalized
            return
        for i in range(run.n):
            if state.dispatched[i] and run.status[i] != CANCELLED:
                # elapsed_time is in ms from the launch's base event.
                run.start_ns[i] = int(state.base.elapsed_time(state.starts[i]) * 1e6)
                run.end_ns[i] = int(state.base.elapsed_time(state.ends[i]) * 1e6)

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
        _give_events(state.device, [state.base, *state.starts, *state.ends])
        run.backend_state = None
        _release_streams(run)
