"""What features read of an execution beyond its public surface: the only code outside
``execution.py`` and ``executor/`` that reads an execution's run."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeoff.execution import Completion, Execution
    from pipeoff.trace import TaskRecord, Trace

__all__ = ["completions", "hook_wait_records", "is_failure_of", "on_complete", "pending",
           "settle", "shifted_trace", "translate_failures"]


def is_failure_of(err: BaseException, execution: Execution) -> bool:
    """Whether ``err``, raised by a wait on ``execution``, is the execution's own failure.

    Anything else interrupted the wait itself: ``KeyboardInterrupt`` (Ctrl-C
    reaches the waiting thread only), a :class:`~pipeoff.StepTimeoutError`, an
    exception from a signal handler. The execution then goes on.
    """
    failure = execution.exception
    return failure is not None and (err is failure or err.__cause__ is failure)


def settle(execution: Execution, task: str | None = None, *,
           timeout: float | None = None) -> BaseException | None:
    """Wait for ``task`` (or every task) of ``execution``; return its failure, not raise it.

    For code that goes on after a failure it has already accounted for (an
    abandoned micro-step, a transfer whose failure is its own caller's to
    report). What interrupts the wait (Ctrl-C, the timeout) is raised: it
    must reach the caller.

    Raises:
        KeyboardInterrupt: Ctrl-C while waiting.
        StepTimeoutError: ``timeout`` expired.
    """
    try:
        execution.wait(task, timeout=timeout)
    except BaseException as err:
        if not is_failure_of(err, execution):
            raise
        return execution.exception
    return None


# -- reading an execution ---------------------------------------------------------------

def completions(execution: Execution, tasks: Iterable[str]) -> tuple[Completion, ...]:
    """The completions of those of ``tasks`` that ``execution`` has (others are skipped:
    a step without a gradient for a chunk has no task writing it)."""
    index = execution._run.index
    return execution.events_for([t for t in tasks if t in index])


def pending(execution: Execution) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The names of the tasks still pending and of the gates not yet settled."""
    run = execution._run
    return run.pending(), run.gates.pending()


def shifted_trace(execution: Execution, prefix: str, shift_ns: int, number: int = 0,
                  deadline: float | None = None) -> Trace | None:
    """The execution's trace with task and buffer names prefixed and times shifted by
    ``shift_ns`` (a recorder's timeline), numbered ``number``; ``None`` if it has not
    finished by ``deadline`` (``time.monotonic``). Never raises a task's failure."""
    from pipeoff.executor._tracing import trace_of

    run, backend = execution._run, execution._backend
    if not run.wait_all(deadline) or not backend.synchronize_all(run, deadline):
        return None
    execution._finalize()
    backend.resolve_times(run)
    return trace_of(run, prefix=prefix, shift_ns=shift_ns, execution=number)


# -- extending an execution ---------------------------------------------------------------

def on_complete(execution: Execution, callback: Callable[[], None]) -> None:
    """Call ``callback`` (on a lane's thread, or now) once every task is terminal."""
    execution._run.on_complete(callback)


def translate_failures(execution: Execution,
                       translate: Callable[[BaseException], BaseException]) -> None:
    """Make waits on ``execution`` raise ``translate(failure)`` (chained from the
    failure) instead of its first failure: a feature's own account of what broke."""
    execution._translate = translate


# -- records of the training thread ----------------------------------------------------------

def hook_wait_records(waits: Iterable[tuple[str, int, int]], origin_ns: int,
                      rank: int) -> tuple[TaskRecord, ...]:
    """Trace records of forward-hook waits, ``(name, start, end)`` in ``perf_counter_ns``,
    on the timeline of an execution launched at ``origin_ns``."""
    from pipeoff.trace._records import hook_wait_record

    return tuple(hook_wait_record(n, a, b, origin_ns=origin_ns, rank=rank) for n, a, b in waits)
