"""Ctrl-C reaches a main thread blocked in an execution's wait, also when the signal
lands in the window where no blocking call can be interrupted.

A real SIGINT during a blocked lock acquire interrupts it; one that lands after
the waiting thread's last check and before it blocks does not: CPython has
only set its flag, and runs the handler at the next bytecode check. That window is
reproduced exactly by ``_thread.interrupt_main()``, which sets the flag without
a signal. pipeoff's main-thread waits come back to Python every
``SIGNAL_CHECK_S`` (``executor/_run.py: wait_event``), so the interrupt is
raised while the task it waits for is still held; an unsliced wait would raise
it only once the wait ends. The task is held until the interrupt has arrived
(or, for an unsliced wait, until a generous fallback gives up and releases it,
so the failure is an assertion, not a hang).

The flag is set only once the main thread is past its last check: parked in the
``threading.Event`` the wait blocks on (:func:`_parked_on`). Set earlier, while the
main thread still runs the bytecode on its way into the wait, even an unsliced wait
would raise it at once, and the test would pass by luck of timing.
"""

from __future__ import annotations

import _thread
import threading

import pytest

import pipeoff
import pipeoff.testing
from pipeoff import TaskGraph, TaskKind
from pipeoff.executor import _run
from tests._interrupts import no_collection

FALLBACK_S = 20.0
"""How long the held task waits for the interrupt before it is released anyway (only
an unsliced wait gets there; a sliced one is interrupted within a slice)."""


def _parked_on(ev: threading.Event) -> bool:
    """Whether a thread waiting on ``ev`` is past its last bytecode check before it blocks.

    ``Event.wait`` -> ``Condition.wait`` appends the waiter's lock to the condition's
    ``_waiters`` while it holds the condition's lock, releases that lock (the last call
    in ``_release_save``, whose return is that thread's last check) and then blocks in
    ``waiter.acquire()``, with no check on the way (no call into Python, no backward
    jump). Another thread can see the condition's lock free only after that release;
    with a waiter still listed, the waiting thread is then between that last check
    and the end of its acquire. (Only the main thread waits on these events here:
    its own per-thread event, or the run's ``all_done``.)
    """
    cond = ev._cond  # type: ignore[attr-defined]
    return bool(cond._waiters) and not cond._lock.locked()


def _graph() -> TaskGraph:
    g = TaskGraph()
    g.add_task("held", TaskKind.HOST, lambda ctx: 1)
    return g


@pytest.mark.parametrize("timeout", [None, 3600.0], ids=["no_deadline", "deadline"])
@pytest.mark.parametrize("what", ["execution", "task"])
def test_an_interrupt_in_the_unblockable_window_reaches_the_wait(
        timeout: float | None, what: str) -> None:
    assert threading.current_thread() is threading.main_thread()
    interrupted = threading.Event()
    gave_up = threading.Event()
    with pipeoff.testing.hold_task("held") as release:
        ex = pipeoff.execute(_graph())
        # What the main thread's wait blocks on: the run's all_done, or its own event.
        parks_on = ex._run.all_done if what == "execution" else _run._thread_event()

        def watch() -> None:
            # Ordered by the waiter's state, not by time: once the main thread is
            # parked in the wait (or past its last check on the way in).
            while not _parked_on(parks_on):
                if interrupted.wait(0.001):
                    return
            _thread.interrupt_main()  # the flag only: no blocking call is interrupted
            if not interrupted.wait(FALLBACK_S):
                gave_up.set()
                release.set()

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            with no_collection(), pytest.raises(KeyboardInterrupt):
                if what == "execution":
                    ex.wait(timeout=timeout)
                else:
                    ex.wait("held", timeout=timeout)
                # An unsliced wait returns once released; the pending flag raises here.
                threading.Event().wait(0.0)
        finally:
            interrupted.set()
            watcher.join()
        assert not gave_up.is_set(), "the interrupt came only once the wait had ended"
        assert not ex.done()  # still held: the wait was interrupted, not over
        release.set()
    ex.wait(timeout=60)
    assert ex.result("held") == 1
