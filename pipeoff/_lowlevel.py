"""The runtime's front door for pipeoff's own features (in the spirit of ``trio.lowlevel``).

Features (``optim``, ``ft``, ``transfer``, the trace recorder) build graphs
and launch them with :func:`pipeoff.execute`; what they need of an execution
beyond its public surface goes through the functions here, which are the only
code outside ``execution.py`` and ``executor/`` that reads an execution's run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeoff.execution import Execution

__all__ = ["is_failure_of", "settle"]


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
