"""The state of one execution that every backend shares: status, staging and records."""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from pipeoff import _accel, _compat, _dist, _faults, _happens
from pipeoff._errors import ConfigError
from pipeoff.executor._gates import OPEN as GATE_OPEN
from pipeoff.executor._gates import GateStates
from pipeoff.graph import Task, TaskContext, TaskGraph
from pipeoff.schedule import Plan
from pipeoff.staging import Pools, StagingBlock

PENDING, OK, FAILED, CANCELLED = 0, 1, 2, 3
_gated: weakref.WeakSet[Run] = weakref.WeakSet()
"""Executions in flight that have gates."""


SIGNAL_CHECK_S = 0.05
"""Longest slice of a main-thread wait (see :func:`wait_event`)."""


def wait_event(ev: threading.Event, timeout: float | None) -> bool:
    """``ev.wait(timeout)``; on the main thread, in slices of :data:`SIGNAL_CHECK_S`.

    Hazard: Ctrl-C lost until the wait ends. CPython runs a signal's handler
    when the blocking call it interrupted returns; a SIGINT that lands after
    the waiting thread's last bytecode but before it blocks interrupts
    nothing, and the ``KeyboardInterrupt`` would come only when the wait is
    over (never, for a wait on a hung collective). A slice's end runs it.
    """
    if threading.current_thread() is not threading.main_thread():
        return ev.wait(timeout)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        left = SIGNAL_CHECK_S if deadline is None else min(
            SIGNAL_CHECK_S, deadline - time.monotonic())
        if ev.wait(max(0.0, left)):
            return True
        if deadline is not None and time.monotonic() >= deadline:
            return False


def abandon_gated(why: str) -> None:
    """Fail every execution in flight that waits on a gate nobody has opened."""
    for run in list(_gated):
        run.abandon_gates(why)
_STATUS = {OK: "ok", FAILED: "failed", CANCELLED: "cancelled"}


class Run:
    """Bookkeeping of one launched plan; lanes call :meth:`run_task` for each task."""

    def __init__(self, graph: TaskGraph, plan: Plan, pools: Pools, backend: str) -> None:
        self.graph = graph
        self.plan = plan
        self.pools = pools
        self.backend = backend
        n = len(plan.order)
        self.n = n
        self.tasks: list[Task] = [graph.tasks[name] for name in plan.order]
        self.status = [PENDING] * n
        self.enqueue_ns = [0] * n
        self.start_ns = [0] * n
        self.end_ns = [0] * n
        self.results: dict[str, Any] = {}
        self.error: BaseException | None = None
        self.error_task: str | None = None
        self._lock = threading.Lock()
        self._waiting: dict[int, list[threading.Event]] = {}
        self._finished = itertools.count()
        self.all_done = threading.Event()
        if n == 0:
            self.all_done.set()
        self.blocks: dict[str, StagingBlock] = {}
        self.origin_ns = time.perf_counter_ns()
        self.origin_unix_ns = time.time_ns()
        self.rank = _dist.rank()
        self.backend_state: Any = None
        """Per-run data of the backend (the CUDA events)."""
        self._index: dict[str, int] | None = None
        self._on_complete: list[Callable[[], None]] = []
        self.hooks = _faults.snapshot()
        """The test hooks (delays, injected failures) installed at launch."""
        self.retired: set[str] = set()
        self.moved: dict[int, int] = {}
        """Per task index, the bytes its run said it moved (TaskContext.moved)."""
        """Buffers a task declared unsafe to reuse (a failed collective may still write
        them): dropped from their pool at release instead of returned."""
        cap = plan.schedule.max_in_flight
        self.window = cap if cap is not None and cap < n else None
        """Flow control: task ``i`` starts only after task ``i - window`` is terminal."""
        self.gates = GateStates(graph.gates, self.origin_ns, self._gate_failed)
        """The graph's gates (inputs from outside the execution)."""
        index = self.gates.index
        self.task_gates: list[tuple[int, ...]] = (
            [tuple(index[g] for g in t.gates) for t in self.tasks] if index else [()] * n)
        """Per task, the indices of the gates it waits on."""
        if index:
            # At exit, a gate nobody opened would hold its lanes (see _exit).
            _gated.add(self)
            self.on_complete(lambda: _gated.discard(self))

    @property
    def index(self) -> dict[str, int]:
        """Position of each task in the plan, by name (built on first use)."""
        if self._index is None:
            self._index = {name: i for i, name in enumerate(self.plan.order)}
        return self._index

    # -- status -------------------------------------------------------------
    def terminal(self, i: int) -> bool:
        return self.status[i] != PENDING

    def wait_terminal(self, i: int, deadline: float | None = None) -> bool:
        """Block until task ``i`` ran, failed or was cancelled; False on deadline.

        The waiter parks on an event of its own thread, registered under ``i``;
        :meth:`finish` sets exactly the events waiting on the task it finishes,
        so lanes do not wake each other up (a shared condition would).
        """
        status = self.status
        if status[i] == PENDING and not self._park(i, deadline):
            return False
        _happens.acquire(self, i)  # what the task's thread did comes before what we do
        return True

    def _park(self, i: int, deadline: float | None) -> bool:
        status = self.status
        ev = _thread_event()
        while True:
            ev.clear()
            self._waiting.setdefault(i, []).append(ev)
            # Re-check after registering: finish() may have run in between.
            if status[i] != PENDING:
                return True
            timeout = None if deadline is None else deadline - time.monotonic()
            if timeout is not None and timeout <= 0:
                return False
            wait_event(ev, timeout)
            if status[i] != PENDING:
                return True
            # A stale wake-up from an earlier wait of this thread: wait again.

    def wait_all(self, deadline: float | None = None) -> bool:
        """Block until every task is terminal; False on deadline."""
        if not self.all_done.is_set():
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not wait_event(self.all_done, timeout):
                return False
        _happens.acquire(self, None)
        return True

    @property
    def complete(self) -> bool:
        """Whether every task is terminal."""
        return self.all_done.is_set()

    def finish(self, i: int, status: int) -> None:
        # Published before the status: a waiter that sees it must see this too.
        _happens.release(self, i)
        _happens.release(self, None)
        self.status[i] = status
        waiting = self._waiting.pop(i, None)
        if waiting:
            for ev in waiting:
                ev.set()
        # next() on a counter is atomic, so lanes need no lock to count.
        if next(self._finished) == self.n - 1:
            self.all_done.set()
            with self._lock:
                callbacks, self._on_complete = self._on_complete, []
            for fn in callbacks:
                fn()

    def on_complete(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` once every task is terminal (at once if that is already so)."""
        with self._lock:
            if not self.all_done.is_set():
                self._on_complete.append(fn)
                return
        fn()

    def fail(self, i: int, err: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.error = err
                self.error_task = self.tasks[i].name
                err.add_note(
                    f"(raised in pipeoff task {self.tasks[i].name!r} "
                    f"on lane {self.plan.lanes[i]!r})"
                )
        # Tasks waiting on gates that may never open now are cancelled instead.
        self.gates.abandon()

    def abandon_gates(self, why: str) -> None:
        """Fail the execution because its pending gates will never be opened (the
        interpreter is exiting): the tasks waiting on them are cancelled."""
        pending = self.gates.pending()
        if not pending:
            return
        err = RuntimeError(f"pipeoff: {why}, with gate(s) {', '.join(map(repr, pending[:8]))} "
                           "never opened")
        with self._lock:
            if self.error is None:
                self.error = err
                self.error_task = pending[0]
        self.gates.abandon()

    def _gate_failed(self, name: str, err: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.error = err
                self.error_task = name
                err.add_note(f"(pipeoff gate {name!r} was failed by its producer)")
        self.gates.abandon()

    def open_gate(self, k: int, payload: Any, event: Any) -> None:
        """Open gate ``k``. On a device execution without ``event``, the payload is
        ready after the work the caller has enqueued on its current stream."""
        if event is None and self.backend == "cuda":
            accel = _accel.current()
            event = accel.new_event()
            # Hazard: lanes reading a payload that the producer's stream (the
            # backward that computed a gradient) is still writing.
            event.record(accel.current_stream(accel.normalize(self.graph.device)))
        self.gates.open(k, payload, event)

    def wait_gates(self, i: int, *, host: bool) -> None:
        """Wait until task ``i``'s gates are settled (or the run failed).

        ``host``: the task's work runs on this host thread, so it also waits
        for each opened gate's event (on CUDA the dispatcher makes the lane's
        stream wait instead).
        """
        ks = self.task_gates[i]
        self.gates.wait(ks)
        if host:
            for k in ks:
                ev = self.gates.event[k]
                if ev is None or self.gates.state[k] != GATE_OPEN:
                    continue
                if not _faults.disabled("gate_wait"):
                    # Hazard: the host reading a payload that device work (the
                    # producer's stream, another execution) is still writing.
                    ev.synchronize()
                self.check_gate_event(k)

    def check_gate_event(self, k: int) -> None:
        """Raise if gate ``k``'s event is another execution's task that did not run: its
        payload was never written. Waits (on the host) until that task is terminal: a
        failure of it must reach this execution whether or not its device work was
        waited for (the check is not the wait; a test switching the wait off keeps it)."""
        ev = self.gates.event[k]
        settled_status = getattr(ev, "settled_status", None)  # (a Completion's, not an event's)
        status = settled_status() if settled_status is not None else None
        if status in ("failed", "cancelled"):
            # The other execution's first failure, as the cause: what went wrong first.
            cause = getattr(getattr(ev, "_run", None), "error", None)
            raise RuntimeError(
                f"gate {self.gates.names[k]!r} was opened to be ready after task "
                f"{getattr(ev, 'task', '?')!r} of another execution, which {status}: "
                "its payload was never written") from cause

    def pending(self) -> tuple[str, ...]:
        return tuple(self.tasks[i].name for i in range(self.n) if self.status[i] == PENDING)

    # -- staging ------------------------------------------------------------
    def acquire(self, i: int) -> list[StagingBlock]:
        """Take the blocks task ``i`` is the first user of; returns them."""
        new = []
        specs = self.graph.buffers
        for b in self.plan.acquire[i]:
            spec = specs[b]
            block = self.pools.for_where(spec.where).acquire(spec.nbytes)
            self.blocks[b] = block
            new.append(block)
        return new

    def views(self, i: int) -> dict[str, Any]:
        """Task ``i``'s staging views. A buffer whose first user was cancelled (after a
        failure) was never acquired: a ``must_run`` task that uses it later runs
        without it (and must not need it: the run has failed)."""
        specs = self.graph.buffers
        blocks = self.blocks
        return {b: blocks[b].view(specs[b].nbytes) for b in self.tasks[i].buffers
                if b in blocks}

    def release(self, i: int, ready: Any = None,
                ready_of: Callable[[str], Any] | None = None) -> None:
        """Return the blocks task ``i`` is the last user of (also when it was cancelled).

        ``ready`` (or ``ready_of(buffer)``) is the event after which a block
        may be reused; ``None`` on host backends.
        """
        specs = self.graph.buffers
        for b in self.plan.release[i]:
            block = self.blocks.pop(b, None)
            if block is None:
                continue
            pool = self.pools.for_where(specs[b].where)
            marker = ready_of(b) if ready_of is not None else ready
            if b in self.retired:
                pool.discard(block, marker)
            else:
                pool.release(block, marker)

    # -- running ------------------------------------------------------------
    def cancel(self, i: int, ready_of: Callable[[str], Any] | None = None) -> None:
        now = time.perf_counter_ns() - self.origin_ns
        self.start_ns[i] = self.end_ns[i] = now
        self.release(i, ready_of=ready_of)
        self.finish(i, CANCELLED)

    def run_task(self, i: int, lane: str, *, waited: bool = False,
                 after: Callable[[], None] | None = None) -> None:
        """Run task ``i`` on the calling host thread: wait, acquire, work, release, finish.

        ``waited``: the caller has already waited for the task's dependencies.
        ``after``: called once the work has run (or failed), before the task is
        released to its dependents.
        """
        status = self.status
        try:
            for j in () if waited else self.plan.waits[i]:
                self.wait_terminal(j)
            if (self.window is not None and i >= self.window
                    and status[i - self.window] == PENDING):
                # Flow control, not a dependency: task i starts only once task
                # i - window has finished (Schedule.max_in_flight).
                self.wait_terminal(i - self.window)
            if self.task_gates[i]:
                self.wait_gates(i, host=True)
        except BaseException as err:  # a gate's event that fails to synchronize
            self.fail(i, err)
            self.cancel(i)
            return
        task = self.tasks[i]
        if self.error is not None and not task.must_run:
            self.cancel(i)
            return
        outcome = OK
        if self.plan.acquire[i]:
            try:
                for block in self.acquire(i):
                    if block.ready is not None and not _faults.disabled("block_fence"):
                        # Hazard: the host touching a pooled block that a CUDA
                        # execution released with its last copy still in flight.
                        block.ready.synchronize()
            except BaseException as err:  # e.g. an out-of-memory allocating staging
                self.fail(i, err)
                if not task.must_run:
                    self.cancel(i)
                    return
                # A must_run task (a collective every rank joins) runs without the
                # buffers it did not get (see views()): the run has failed, and its
                # work sees it in ctx.failed.
                outcome = FAILED
        result = None
        start = time.perf_counter_ns()
        work = task.work
        if work is not None or self.hooks:
            try:
                if self.hooks:
                    try:
                        _faults.run_hooks(task.name, lane, hooks=self.hooks)
                    except BaseException as err:
                        if not task.must_run:
                            raise
                        # A must_run task (a collective every rank joins) runs its work
                        # anyway, which sees the failure (a Ctrl-C in an injected delay).
                        outcome = FAILED
                        self.fail(i, err)
                if work is not None:
                    ctx = TaskContext(task=task, lane=lane, buffers=self.views(i),
                                      results=self.results, retire=self.retired.add,
                                      failed=self.error, failed_task=self.error_task,
                                      gates=self.gates.payloads(self.task_gates[i]),
                                      on_moved=functools.partial(self.moved.__setitem__, i))
                    with (_faults.failing_work(task.name, lane, self.hooks) if self.hooks
                          else contextlib.nullcontext()):
                        if _compat.profiler_enabled():
                            # The same task, visible inside a torch.profiler trace.
                            with torch.profiler.record_function(
                                f"pipeoff::{task.kind.value}::{task.name}"
                            ):
                                result = self._call(i, work, ctx)
                        else:
                            result = self._call(i, work, ctx)
            except BaseException as err:
                outcome = FAILED
                self.fail(i, err)
            if result is not None:
                self.results[task.name] = result
        end = time.perf_counter_ns()
        self.start_ns[i] = start - self.origin_ns
        self.end_ns[i] = end - self.origin_ns
        if after is not None:
            after()
        if self.plan.release[i]:
            self.release(i)
        self.finish(i, outcome)

    def _call(self, i: int, work: Any, ctx: TaskContext) -> Any:
        result = work(ctx)
        if inspect.isawaitable(result):
            # An async callable that add_task could not recognize (a partial of an
            # async function): never leave it un-awaited in silence.
            if inspect.iscoroutine(result):
                result.close()
            raise ConfigError(
                f"task {self.tasks[i].name!r}: its work returned an awaitable; task work "
                "runs synchronously on a lane (await the result of an RPC inside it with "
                "anyio.from_thread or asyncio.run_coroutine_threadsafe)")
        return result

    # -- trace --------------------------------------------------------------
    def status_names(self) -> list[str]:
        """Per task, ``"ok"``, ``"failed"`` or ``"cancelled"`` (for
        :meth:`pipeoff.Trace.from_run`; a pending task counts as cancelled)."""
        return [_STATUS.get(st, "cancelled") for st in self.status]


_local = threading.local()


def _thread_event() -> threading.Event:
    """An event owned by the calling thread, reused across its waits."""
    ev: threading.Event | None = getattr(_local, "event", None)
    if ev is None:
        ev = _local.event = threading.Event()
    return ev
