"""The background anyio event loop that runs asynchronous host tasks."""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager
from typing import Any, TypeVar

from anyio.from_thread import BlockingPortal, start_blocking_portal

T = TypeVar("T")

_lock = threading.Lock()
_portal: BlockingPortal | None = None
_portal_cm: AbstractContextManager[BlockingPortal] | None = None


def portal() -> BlockingPortal:
    """The process-wide portal into pipeoff's host event loop (started once)."""
    global _portal, _portal_cm
    with _lock:
        if _portal is None:
            _portal_cm = start_blocking_portal(backend="asyncio")
            _portal = _portal_cm.__enter__()
        return _portal


def run_async(fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """Run ``fn(*args)`` on the host loop and block the calling lane until it finishes.

    Blocking calls inside ``fn`` belong in ``anyio.to_thread.run_sync``.
    """
    return portal().call(fn, *args)
