"""What the main thread is doing, read from its stack: tests order their events by it,
not by time (a watcher thread acts once the main thread blocks in a given wait)."""

from __future__ import annotations

import functools
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple


class Frame(NamedTuple):
    """One frame of a thread's stack: what the checks below read."""

    name: str
    filename: str
    lineno: int


_published: dict[int, list[Frame]] = {}
"""Per thread, its stack while it is inside an execution's (or a completion's) wait."""
_install_lock = threading.Lock()
_installed = False


def install() -> None:
    """Make every thread publish its stack while it waits on an execution (once per
    process; call it on the main thread before the wait a watcher looks for).

    The waiting thread records its own frames (``sys._getframe``, safe on one's own
    thread) as it enters ``Execution.wait``, ``Completion.wait`` or
    ``Completion.synchronize``, and withdraws them when it leaves. A watcher reads
    that record, never another thread's live frames: walking a running thread's
    ``f_back`` chain (``sys._current_frames()``) can crash CPython 3.11
    (cpython#111363; a segfault in one CI run), and ``faulthandler``'s dump stops
    at 100 threads, which leaves the main thread out once earlier tests have left
    their lane threads idle.
    """
    global _installed
    with _install_lock:
        if _installed:
            return
        from pipeoff import execution

        for cls, name in ((execution.Execution, "wait"), (execution.Completion, "wait"),
                          (execution.Completion, "synchronize")):
            setattr(cls, name, _publishing(getattr(cls, name), name))
        _installed = True


def _publishing(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    code = fn.__code__

    @functools.wraps(fn)
    def waiting(*args: Any, **kwargs: Any) -> Any:
        me = threading.get_ident()
        outermost = me not in _published
        if outermost:
            frames = [Frame(name, code.co_filename, code.co_firstlineno)]
            f: Any = sys._getframe(1)
            while f is not None:
                frames.append(Frame(f.f_code.co_name, f.f_code.co_filename, f.f_lineno))
                f = f.f_back
            _published[me] = frames
        try:
            return fn(*args, **kwargs)
        finally:
            if outermost:
                _published.pop(me, None)

    return waiting


def stack_of(ident: int) -> list[Frame]:
    """The frames of thread ``ident``, innermost first, while it waits on an execution
    (after :func:`install`); else empty."""
    return list(_published.get(ident, ()))


def waiting_in(stack: list[Frame], where: tuple[str, ...]) -> tuple[int, ...] | None:
    """If the thread blocks in ``Execution.wait`` (or a Completion's wait) called from
    ``where`` (function names, outermost first, each further in than the one before),
    the line each of those frames is at; else ``None``."""
    names = [f.name for f in stack]
    if not any(f.filename.endswith("pipeoff/execution.py")
               and f.name in ("wait", "synchronize") for f in stack):
        return None
    pos = len(names)
    lines = []
    for w in where:  # outermost first: search towards the innermost frame
        found = [k for k in range(pos) if names[k] == w]
        if not found:
            return None
        pos = max(found)
        lines.append(stack[pos].lineno)
    return tuple(lines)


def release_when_waiting(release: threading.Event, *where: str) -> threading.Thread:
    """A thread that sets ``release`` once the main thread blocks in an execution's wait
    called from ``where`` (see :func:`waiting_in`); join it after the block."""
    main = threading.main_thread().ident
    assert main is not None
    install()

    def watch() -> None:
        while not release.is_set():
            if waiting_in(stack_of(main), where) is not None:
                release.set()
                return
            time.sleep(0.001)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def release_when_any_waiting(release: threading.Event,
                             *wheres: tuple[str, ...]) -> threading.Thread:
    """A thread that sets ``release`` once any thread blocks in an execution's wait called
    from one of ``wheres`` (each a :func:`waiting_in` path); join it after the block."""
    install()

    def watch() -> None:
        while not release.is_set():
            for stack in list(_published.values()):
                if any(waiting_in(stack, w) is not None for w in wheres):
                    release.set()
                    return
            time.sleep(0.001)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t
