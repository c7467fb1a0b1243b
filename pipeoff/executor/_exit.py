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
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
import warnings

__all__ = ["EXIT_TIMEOUT_S", "ensure_registered"]

#: How long, in all, exit waits for pipeoff's threads to drain and stop.
EXIT_TIMEOUT_S = 30.0

_lock = threading.Lock()
_registered = False


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
