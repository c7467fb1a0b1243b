"""The simulated device's memory map: which byte ranges are host memory (pinned or
pageable); everything else is device memory."""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable
from typing import Any

import torch

from pipeoff.testing._simops import ptr as _ptr
from pipeoff.testing._simops import scalar_argument

__all__ = ["MemoryMap"]


class MemoryMap:
    """The host ranges, sorted; read and written under the device's lock.

    Args:
        lock: the device's lock.
    """

    def __init__(self, lock: threading.RLock) -> None:
        self.lock = lock
        self._host: list[tuple[int, int, bool]] = []  # (start, end, pinned), sorted

    def add(self, start: int, nbytes: int, pinned: bool) -> None:
        """``[start, start + nbytes)`` is host memory from now on."""
        with self.lock:
            bisect.insort(self._host, (start, start + nbytes, pinned))

    def remove(self, start: int, end: int, pinned: bool) -> None:
        """The host range ``[start, end)`` was freed (idempotent)."""
        with self.lock:
            try:
                self._host.remove((start, end, pinned))
            except ValueError:
                pass

    def host_range(self, ptr: int) -> tuple[int, int, bool] | None:
        """The host range holding address ``ptr``, or ``None`` (device memory)."""
        if not ptr:
            return None
        with self.lock:
            k = bisect.bisect_right(self._host, (ptr, float("inf"), True)) - 1
            if k >= 0 and self._host[k][0] <= ptr < self._host[k][1]:
                return self._host[k]
        return None

    def base(self, ptr: int) -> int:
        """The start of the storage at ``ptr`` (a host range's start, else ``ptr``)."""
        r = self.host_range(ptr)
        return r[0] if r is not None else ptr

    def on_device(self, t: torch.Tensor) -> bool:
        return self.host_range(_ptr(t)) is None

    def is_pinned(self, t: torch.Tensor) -> bool:
        r = self.host_range(_ptr(t))
        return r is not None and r[2]

    def issued_by(self, func: Any, written: torch.Tensor | None,
                  ) -> Callable[[torch.Tensor], torch.Tensor]:
        """What a deferred kernel of ``func`` (which writes ``written``) will touch, given
        a tensor: its storage and strides now, and a scalar argument's value (read at
        the launch: ``pipeoff.testing._simops.scalar_argument``)."""

        def as_issued(t: torch.Tensor) -> torch.Tensor:
            if scalar_argument(func, t, self.host_range(_ptr(t)), t is written):
                return t.clone()
            return t.as_strided(t.size(), t.stride(), t.storage_offset())
        return as_issued
