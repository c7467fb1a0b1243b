"""Happens-before annotations between host threads, for the simulated device's checker.

pipeoff's threads (the caller, host lanes, CUDA dispatchers) hand tensors to
each other through its own primitives: a task's completion, a gate, a lane's
queue, a staging pool. The simulated CUDA device gives every host thread a
clock of its own (as it gives every stream one), so that two threads touching
the same accumulator, master weight or pinned slot with nothing ordering them
is a :class:`~pipeoff.testing.DataRaceError`. These calls tell it where that
order comes from: :func:`release` where a thread publishes (before the waiter
can see the task finished, the gate settled, the item queued), :func:`acquire`
where another learns of it. Like ThreadSanitizer's ``ANNOTATE_HAPPENS_BEFORE``.

With no checker installed (everywhere but under
:func:`pipeoff.testing.simulated_cuda`) each call is one global read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

__all__ = ["Observer", "acquire", "install", "native_access", "release", "report"]


class Observer(Protocol):
    def release(self, obj: Any, key: Any) -> None:
        """The calling thread's past happens before any later :meth:`acquire` of
        ``(obj, key)``."""

    def acquire(self, obj: Any, key: Any) -> None:
        """The calling thread now comes after every :meth:`release` of ``(obj, key)``."""

    def report(self, err: BaseException) -> None:
        """A task's failure ``err`` is being re-raised to the execution's caller."""

    def native_access(self, op: str, reads: Sequence[Any], writes: Sequence[Any]) -> None:
        """The calling thread is about to read ``reads`` and write ``writes`` (tensors)
        outside aten: native code on their ``data_ptr()``."""


_observer: Observer | None = None


def install(observer: Observer | None) -> Observer | None:
    """Make ``observer`` the checker told of host-thread order; returns the prior one."""
    global _observer
    prior, _observer = _observer, observer
    return prior


def release(obj: Any, key: Any = None) -> None:
    obs = _observer
    if obs is not None:
        obs.release(obj, key)


def acquire(obj: Any, key: Any = None) -> None:
    obs = _observer
    if obs is not None:
        obs.acquire(obj, key)


def report(err: BaseException) -> None:
    obs = _observer
    if obs is not None:
        obs.report(err)


def native_access(op: str, reads: Sequence[Any] = (), writes: Sequence[Any] = ()) -> None:
    """Native code (``op``) is about to touch these tensors' memory on this thread:
    the checker sees it as it sees an aten operation's reads and writes."""
    obs = _observer
    if obs is not None:
        obs.native_access(op, reads, writes)
