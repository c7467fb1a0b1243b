"""What the main thread is doing, read from its stack: tests order their events by it,
not by time (a watcher thread acts once the main thread blocks in a given wait)."""

from __future__ import annotations

import sys
import threading
import time
from typing import Any


def stack_of(ident: int) -> list[Any]:
    """The frames of thread ``ident``, innermost first."""
    out = []
    f = sys._current_frames().get(ident)
    while f is not None:
        out.append(f)
        f = f.f_back
    return out


def waiting_in(stack: list[Any], where: tuple[str, ...]) -> tuple[int, ...] | None:
    """If the thread blocks in ``Execution.wait`` (or a Completion's wait) called from
    ``where`` (function names, outermost first, each further in than the one before),
    the line each of those frames is at; else ``None``."""
    names = [f.f_code.co_name for f in stack]
    if not any(f.f_code.co_filename.endswith("pipeoff/execution.py")
               and f.f_code.co_name in ("wait", "synchronize") for f in stack):
        return None
    pos = len(names)
    lines = []
    for w in where:  # outermost first: search towards the innermost frame
        found = [k for k in range(pos) if names[k] == w]
        if not found:
            return None
        pos = max(found)
        lines.append(stack[pos].f_lineno)
    return tuple(lines)


def release_when_waiting(release: threading.Event, *where: str) -> threading.Thread:
    """A thread that sets ``release`` once the main thread blocks in an execution's wait
    called from ``where`` (see :func:`waiting_in`); join it after the block."""
    main = threading.main_thread().ident
    assert main is not None

    def watch() -> None:
        while not release.is_set():
            if waiting_in(stack_of(main), where) is not None:
                release.set()
                return
            time.sleep(0.001)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t
