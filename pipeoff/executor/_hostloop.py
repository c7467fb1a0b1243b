"""The background anyio event loop that runs asynchronous host tasks."""

from __future__ import annotations

import queue
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
from anyio.from_thread import BlockingPortal

from pipeoff.executor import _exit

T = TypeVar("T")

_lock = threading.Lock()
_portal: BlockingPortal | None = None
_thread: threading.Thread | None = None


def _serve(ready: queue.Queue[BlockingPortal]) -> None:
    async def main() -> None:
        async with BlockingPortal() as portal:
            ready.put(portal)
            await portal.sleep_until_stopped()

    anyio.run(main, backend="asyncio")


def portal() -> BlockingPortal:
    """The process-wide portal into pipeoff's host event loop (started once).

    The loop runs on a daemon thread that pipeoff stops at exit (see
    :mod:`pipeoff.executor._exit`), after the lanes that call into it.
    """
    global _portal, _thread
    with _lock:
        if _portal is None:
            ready: queue.Queue[BlockingPortal] = queue.Queue()
            _thread = threading.Thread(target=_serve, args=(ready,), name="pipeoff-hostloop",
                                       daemon=True)
            _exit.ensure_registered()
            _thread.start()
            _portal = ready.get()
        return _portal


def stop(deadline: float) -> list[str]:
    """Stop the loop once its calls finish (at exit); its thread's name if it is still running."""
    global _portal, _thread
    with _lock:
        p, t = _portal, _thread
        _portal = _thread = None
    if p is None or t is None:
        return []
    try:
        p.call(p.stop)  # lets calls in flight finish: cancel_remaining=False
    except RuntimeError:  # the loop has already gone
        pass
    return [] if _exit.join_until(t, deadline) else [t.name]


def run_async(fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """Run ``fn(*args)`` on the host loop and block the calling lane until it finishes.

    Blocking calls inside ``fn`` belong in ``anyio.to_thread.run_sync``.
    """
    return portal().call(fn, *args)
