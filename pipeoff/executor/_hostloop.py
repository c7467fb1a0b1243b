"""The background anyio event loop that runs asynchronous host tasks."""

from __future__ import annotations

import queue
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
from anyio.from_thread import BlockingPortal

T = TypeVar("T")

_lock = threading.Lock()
_portal: BlockingPortal | None = None


def _serve(ready: queue.Queue[BlockingPortal]) -> None:
    async def main() -> None:
        async with BlockingPortal() as portal:
            ready.put(portal)
            await portal.sleep_until_stopped()

    anyio.run(main, backend="asyncio")


def portal() -> BlockingPortal:
    """The process-wide portal into pipeoff's host event loop (started once).

    The loop runs on a daemon thread, so it never holds up interpreter exit
    (anyio's ``start_blocking_portal`` uses a worker that exit would join).
    """
    global _portal
    with _lock:
        if _portal is None:
            ready: queue.Queue[BlockingPortal] = queue.Queue()
            threading.Thread(target=_serve, args=(ready,), name="pipeoff-hostloop",
                             daemon=True).start()
            _portal = ready.get()
        return _portal


def run_async(fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """Run ``fn(*args)`` on the host loop and block the calling lane until it finishes.

    Blocking calls inside ``fn`` belong in ``anyio.to_thread.run_sync``.
    """
    return portal().call(fn, *args)
