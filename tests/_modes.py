"""A dispatch mode for tests: the one place torch's version counters go blind."""

from __future__ import annotations

from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode


class PassThrough(TorchDispatchMode):
    """A dispatch mode that changes nothing (as ``FlopCounterMode`` around a loop): torch
    2.13's in-place foreach ops under it bump no version counter."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))
