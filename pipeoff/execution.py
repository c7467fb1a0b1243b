"""The handle that :func:`pipeoff.execute` returns: waits, completion events, results, trace."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from pipeoff import _happens
from pipeoff._errors import ConfigError, StepTimeoutError
from pipeoff.executor._tracing import trace_of
from pipeoff.trace import Trace

if TYPE_CHECKING:
    from pipeoff.executor._backend import Backend
    from pipeoff.executor._run import Run
    from pipeoff.schedule import Plan

__all__ = ["Completion", "Execution", "Gate"]


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

    @property
    def status(self) -> str:
        """``"pending"``, ``"ok"``, ``"failed"`` or ``"cancelled"`` (on the host: a device
        task that was issued is ``"ok"`` before its kernels end; see :meth:`query`)."""
        run = self._run
        if not run.terminal(self._index):
            return "pending"
        return run.status_names()[self._index]

    def settled_status(self) -> str:
        """:attr:`status` once the task is terminal on the host (blocks until then; a
        device task's kernels may still run): ``"ok"``, ``"failed"`` or ``"cancelled"``."""
        self._run.wait_terminal(self._index)
        return self.status

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


class Gate:
    """The producer's end of one gate of an execution (see :meth:`TaskGraph.add_gate`).

    Get it with :meth:`Execution.gate`. Call exactly one of :meth:`open`,
    :meth:`close` or :meth:`fail`, from any thread (an autograd hook, another
    execution's task), before or after the tasks that wait on it are reached.
    """

    __slots__ = ("_k", "_run")

    def __init__(self, run: Run, k: int) -> None:
        self._run = run
        self._k = k

    @property
    def name(self) -> str:
        return self._run.gates.names[self._k]

    @property
    def state(self) -> str:
        """``"pending"``, ``"open"``, ``"closed"`` (empty) or ``"failed"``."""
        return self._run.gates.state_name(self._k)

    def open(self, payload: Any = None, *, event: Any = None) -> None:
        """Let the tasks that wait on this gate start; they read ``payload``
        (``ctx.gate(name)``).

        Args:
            payload: any value (a tensor, a tuple of them).
            event: what the payload is ready after, when device work still
                writes it: a CUDA event, or a :class:`Completion` of another
                execution. On a CUDA execution the default is an event recorded
                now on the caller's current stream (the work that produced the
                payload), and lanes' *streams* wait on it; host lanes
                synchronize it. Nothing here blocks the caller.

        Raises:
            ConfigError: the gate was already opened, closed or failed, or
                ``event`` has no ``synchronize()`` and ``wait(stream)``.
        """
        if event is not None and not (callable(getattr(event, "synchronize", None))
                                      and callable(getattr(event, "wait", None))):
            raise ConfigError(
                f"gate {self.name!r}: event must be a CUDA event or a pipeoff.Completion "
                f"(with synchronize() and wait(stream)), got {type(event).__name__}")
        self._run.open_gate(self._k, payload, event)

    def close(self) -> None:
        """Settle the gate without a payload: the tasks that wait on it run and
        read ``None`` (a parameter that got no gradient this step).

        Raises:
            ConfigError: the gate was already opened, closed or failed.
        """
        self._run.gates.close(self._k)

    def fail(self, error: BaseException) -> None:
        """Fail the execution with ``error``, as if a task had raised it: tasks
        that have not started do not run, and ``wait()`` re-raises it.

        Raises:
            ConfigError: ``error`` is not an exception, or the gate was already
                opened, closed or failed.
        """
        if not isinstance(error, BaseException):
            raise ConfigError(f"Gate.fail() takes an exception, got {error!r}")
        self._run.gates.fail(self._k, error)

    def __repr__(self) -> str:
        return f"Gate({self.name!r}, {self.state})"


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
        self._failure_raised = False
        # Whether a wait has seen the first failure (raised it, or handed it to a
        # feature's settle()): an exit that finds a failed step unseen says so (_exit.py).
        self._translate: Callable[[BaseException], BaseException] | None = None
        """A feature's mapping of the first failure to what its callers see (a state
        transfer's own failure becomes the torn error every rank raises); set through
        :func:`pipeoff._lowlevel.translate_failures`."""

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
        # A wait that a lane's own thread could never see end (a deadlock) is refused.
        self._backend.check_wait(run, None if task is None else self._index(task))
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
            closed = run.gates.pending()
            gates = ""
            if closed:
                gates = "; gate(s) not yet opened: " + ", ".join(repr(g) for g in closed[:8]) + (
                    f" and {len(closed) - 8} more" if len(closed) > 8 else "")
            raise StepTimeoutError(
                f"timed out after {timeout}s waiting for "
                f"{'the execution' if task is None else repr(task)}; "
                f"{len(pending)} task(s) pending: {shown}{more}{gates}",
                pending,
                closed,
            )
        self._check()
        if task is None:
            self._finalize()

    async def wait_async(self, task: str | None = None, *, timeout: float | None = None) -> None:
        """:meth:`wait` for asyncio and trio callers (through anyio); does not block the loop."""
        import anyio.to_thread

        await anyio.to_thread.run_sync(
            functools.partial(self.wait, task, timeout=timeout), abandon_on_cancel=True
        )

    def _check(self) -> None:
        err = self._run.error
        if err is not None:
            _happens.report(err)  # the simulated device: this race reached its caller
            self._finalize()
            self._failure_raised = True
            shown = err if self._translate is None else self._translate(err)
            if shown is not err:
                raise shown from err
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

    def gate(self, name: str) -> Gate:
        """The producer's handle on gate ``name`` (see :class:`Gate`).

        Raises:
            ConfigError: the graph has no gate of that name.
        """
        k = self._run.gates.index.get(name) if isinstance(name, str) else None
        if k is None:
            known = self._run.gates.names
            raise ConfigError(f"unknown gate {name!r}; this execution has "
                              + (f"gates {list(known[:8])}" if known else "no gates"))
        return Gate(self._run, k)

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

    @property
    def trace(self) -> Trace:
        """The trace of this execution; waits for it to finish, failed or not."""
        run = self._run
        run.wait_all()
        self._backend.synchronize_all(run, None)
        self._finalize()
        if self._trace is None:
            self._backend.resolve_times(run)
            self._trace = trace_of(run)
        return self._trace

    def __repr__(self) -> str:
        run = self._run
        state = "failed" if run.error else ("done" if run.complete else "running")
        return (f"Execution({run.n} tasks, backend={self._backend.name!r}, "
                f"schedule={run.plan.schedule.kind!r}, {state})")


