"""Stopping pipeoff's background threads before the interpreter finalizes.

pipeoff's lane workers (the CUDA backend's dispatch threads among them) are
daemon threads, so a program that forgets to wait never hangs at
exit. But a daemon thread still alive when CPython finalizes is a hazard of its
own: once finalization starts, a thread that re-takes the GIL is unwound with
``pthread_exit``, and if that unwind crosses a C++ ``noexcept`` frame (torch
re-acquiring the GIL after an op, for example) the process aborts with
"terminate called without an active exception" (SIGABRT). We saw it in about
one exit in four of a two-process FSDP2 job whose lanes had been idle for
seconds.

So the first time pipeoff starts a thread it registers :func:`_shutdown` with
:mod:`atexit`. It runs while the interpreter is still whole: it lets work
already queued finish (a step launched just before exit still lands), stops
each thread and joins it, in dependency order, under one deadline.

Then it says what would otherwise be lost: a step whose failure nothing raised
(an overlapped optimizer step that failed on a lane after ``step()`` returned,
with no ``wait_for_step()``, read of a parameter or later ``step()`` after it),
as asyncio says "Task exception was never retrieved".
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
import traceback
import warnings
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["EXIT_TIMEOUT_S", "ensure_registered", "watch"]

#: How long, in all, exit waits for pipeoff's threads to drain and stop.
EXIT_TIMEOUT_S = 30.0

_lock = threading.Lock()
_registered = False
_watched: weakref.WeakKeyDictionary[Any, tuple[Callable[[Any], Any], str]] = (
    weakref.WeakKeyDictionary())
"""Owners of steps in flight: how to find the execution of the step in flight (``None``
once its failure was reported otherwise), and what to call the owner."""


def watch(owner: Any, step_in_flight: Callable[[Any], Any], name: str) -> None:
    """At exit, say if ``step_in_flight(owner)`` is an execution that failed and that no
    wait raised (the owner returns ``None`` once it reports the failure otherwise)."""
    ensure_registered()
    _watched[owner] = (step_in_flight, name)


def ensure_registered() -> None:
    """Register :func:`_shutdown` with :mod:`atexit` (once per process)."""
    global _registered
    if _registered:
        return
    with _lock:
        if not _registered:
            atexit.register(_shutdown)
            _registered = True


def _shutdown() -> None:
    deadline = time.monotonic() + EXIT_TIMEOUT_S
    stuck: list[str] = []
    run = sys.modules.get("pipeoff.executor._run")
    if run is not None:
        # A lane waiting on a gate nobody will open now would hold up the exit.
        run.abandon_gated("the interpreter is exiting")
    threads = sys.modules.get("pipeoff.executor.threads")
    if threads is not None:
        stuck += threads.stop_lanes(deadline)
    _unraised()
    if stuck:
        warnings.warn(
            f"pipeoff: {len(stuck)} thread(s) still running after waiting "
            f"{EXIT_TIMEOUT_S:.0f}s at exit: {', '.join(stuck)}; an execution was "
            "probably left waiting on something that never came (call "
            "Execution.wait() before exiting). The process may abort as it finalizes.",
            RuntimeWarning,
            stacklevel=1,
        )


def join_until(thread: threading.Thread, deadline: float) -> bool:
    """Join ``thread`` until ``deadline`` (monotonic); whether it has ended."""
    thread.join(max(0.0, deadline - time.monotonic()))
    return not thread.is_alive()


def _unraised() -> None:
    for owner, (step_in_flight, name) in list(_watched.items()):
        try:  # (at exit: a device gone bad must not hide the other warnings)
            ex = step_in_flight(owner)
            run = None if ex is None else ex._run
            err = (None if run is None or not run.complete or ex._failure_raised
                   else run.error)
        except Exception:  # noqa: BLE001 - nothing to say about this one
            continue
        if err is not None:
            tb = "".join(traceback.format_exception(err)).rstrip()
            warnings.warn(
                f"pipeoff: the last step of a {name} failed, and nothing raised its "
                "failure (no wait_for_step(), read of a parameter or step() came after "
                f"it); the model holds what the step wrote before it failed:\n{tb}",
                RuntimeWarning, stacklevel=1)
