"""The handle that :func:`pipeoff.execute` returns: waits, completion events, results, trace."""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from pipeoff._errors import ConfigError, StepTimeoutError
from pipeoff.executor._run import Run
from pipeoff.schedule import Plan
from pipeoff.trace import Trace

if TYPE_CHECKING:
    from pipeoff.executor._backend import Backend

__all__ = ["Completion", "Execution"]


class Completion:
    """The completion of one task, for code outside pipeoff to wait on.

    On a CUDA lane :meth:`wait` makes a stream wait (the host does not block);
    on a host lane it blocks the calling thread. So after ``wait()`` on a
    device-to-host copy, work *enqueued on that stream* may read the host
    tensor, but the host itself may not: call :meth:`synchronize` before a host
    read (``.item()``, ``.numpy()``, ``torch.save``) of a D2H task's result.
    """

    __slots__ = ("_backend", "_index", "_run")

    def __init__(self, run: Run, backend: Backend, index: int) -> None:
        self._run = run
        self._backend = backend
        self._index = index

    @property
    def task(self) -> str:
        return self._run.tasks[self._index].name

    def query(self) -> bool:
        """Whether the task has finished (or will never run)."""
        return self._backend.query(self._run, self._index)

    def synchronize(self) -> None:
        """Block the host until the task has finished."""
        self._backend.synchronize(self._run, self._index, None)

    def wait(self, stream: Any = None) -> None:
        """Make ``stream`` (default: the current CUDA stream) wait for the task.

        The host does not wait: a host read of the task's output needs
        :meth:`synchronize`. On a CPU execution there is no stream, and the host
        blocks instead.
        """
        self._backend.stream_wait(self._run, self._index, stream)

    def __repr__(self) -> str:
        return f"Completion({self.task!r}, done={self.query()})"


class Execution:
    """A launched graph. Returned by :func:`pipeoff.execute`; do not build one yourself.

    The first exception raised by any task is re-raised by :meth:`wait` (and
    :meth:`wait_async`, :meth:`result`, :attr:`trace`) with its original
    traceback; once a task fails, no task that has not started runs.
    """

    def __init__(self, run: Run, backend: Backend) -> None:
        self._run = run
        self._backend = backend
        self._trace: Trace | None = None
        self._finalized = False

    # -- waiting --------------------------------------------------------------
    def _index(self, task: str) -> int:
        try:
            return self._run.index[task]
        except (KeyError, TypeError):
            raise ConfigError(f"unknown task {task!r}; this execution has "
                              f"{len(self._run.index)} tasks") from None

    def wait(self, task: str | None = None, *, timeout: float | None = None) -> None:
        """Block until ``task`` (or every task) has finished.

        Args:
            task: a task name, or ``None`` for all of them.
            timeout: seconds to wait at most, or ``None``.

        Raises:
            StepTimeoutError: the timeout expired; it names the pending tasks.
            BaseException: the first exception any task raised, as raised.
        """
        if timeout is not None and (isinstance(timeout, bool)
                                    or not isinstance(timeout, (int, float))
                                    or not timeout >= 0):  # also refuses nan
            raise ConfigError(f"timeout must be a number >= 0 or None, got {timeout!r}")
        deadline = None if timeout is None else time.monotonic() + timeout
        run = self._run
        self._refuse_waiting_on_own_lane(task)
        if task is None:
            ok = run.wait_all(deadline) and self._backend.synchronize_all(run, deadline)
        else:
            i = self._index(task)
            ok = self._backend.synchronize(run, i, deadline)
        if not ok:
            pending = run.pending() or tuple(
                run.tasks[i].name for i in range(run.n) if not self._backend.query(run, i)
            )
            shown = ", ".join(repr(p) for p in pending[:8])
            more = f" and {len(pending) - 8} more" if len(pending) > 8 else ""
            raise StepTimeoutError(
                f"timed out after {timeout}s waiting for "
                f"{'the execution' if task is None else repr(task)}; "
                f"{len(pending)} task(s) pending: {shown}{more}",
                pending,
            )
        self._check()
        if task is None:
            self._finalize()

    def _refuse_waiting_on_own_lane(self, task: str | None) -> None:
        """Refuse a wait that a lane's own thread can never see end (a deadlock)."""
        if self._backend.name != "threads":
            return
        from pipeoff.executor.threads import current_holder, current_lane

        lane = current_lane()
        run = self._run
        if lane is None or current_holder() is not run:
            return  # another execution's lane instance: it can run meanwhile
        mine = [i for i in ((self._index(task),) if task is not None else range(run.n))
                if run.plan.lanes[i] == lane and not run.terminal(i)]
        if mine:
            raise ConfigError(
                f"wait() called from a task on lane {lane!r} for {run.tasks[mine[0]].name!r}, "
                f"which is queued on that same lane behind the caller: it could never run. "
                "Give the inner graph's tasks other lanes, or run it with "
                "Schedule.synchronous() (inline, on the calling thread)"
            )

    async def wait_async(self, task: str | None = None, *, timeout: float | None = None) -> None:
        """:meth:`wait` for asyncio and trio callers (through anyio); does not block the loop."""
        import anyio.to_thread

        await anyio.to_thread.run_sync(
            functools.partial(self.wait, task, timeout=timeout), abandon_on_cancel=True
        )

    def _check(self) -> None:
        err = self._run.error
        if err is not None:
            self._finalize()
            raise err

    def _finalize(self) -> None:
        if not self._finalized and self._run.complete:
            self._finalized = True
            self._backend.finalize(self._run)

    def done(self, task: str | None = None) -> bool:
        """Whether ``task`` (or every task) has finished, failed or been cancelled."""
        run = self._run
        if task is None:
            return run.complete and all(
                self._backend.query(run, i) for i in range(run.n)
            )
        return self._backend.query(run, self._index(task))

    # -- reading ------------------------------------------------------------
    def events_for(self, tasks: Iterable[str] | str) -> tuple[Completion, ...]:
        """Completion handles of the named tasks, in the order given."""
        names = (tasks,) if isinstance(tasks, str) else tuple(tasks)
        return tuple(Completion(self._run, self._backend, self._index(n)) for n in names)

    def result(self, task: str) -> Any:
        """The value ``task``'s work returned (``None`` if nothing); waits for it."""
        self.wait(task)
        return self._run.results.get(task)

    @property
    def exception(self) -> BaseException | None:
        """The first exception raised by a task so far, or ``None``."""
        return self._run.error

    @property
    def failed_task(self) -> str | None:
        """The name of the task that raised :attr:`exception`."""
        return self._run.error_task

    @property
    def plan(self) -> Plan:
        return self._run.plan

    @property
    def backend(self) -> str:
        return self._backend.name

    @property
    def origin_ns(self) -> int:
        """``perf_counter_ns`` at launch; the trace's times are relative to it."""
        return self._run.origin_ns

    def _shifted_trace(self, prefix: str, shift_ns: int) -> Trace:
        """The trace with task and buffer names prefixed and times shifted (for recorders)."""
        run = self._run
        run.wait_all()
        self._backend.synchronize_all(run, None)
        self._finalize()
        self._backend.resolve_times(run)
        return run.make_trace(prefix=prefix, shift_ns=shift_ns)

    @property
    def trace(self) -> Trace:
        """The trace of this execution; waits for it to finish, failed or not."""
        run = self._run
        run.wait_all()
        self._backend.synchronize_all(run, None)
        self._finalize()
        if self._trace is None:
            self._backend.resolve_times(run)
            self._trace = run.make_trace()
        return self._trace

    def __repr__(self) -> str:
        run = self._run
        state = "failed" if run.error else ("done" if run.complete else "running")
        return (f"Execution({run.n} tasks, backend={self._backend.name!r}, "
                f"schedule={run.plan.schedule.kind!r}, {state})")


