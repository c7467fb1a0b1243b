"""What an operation touches, as the simulated device's checker sees it: the kinds of
aten operations, the byte span of a tensor, and where in the caller's code it ran."""

from __future__ import annotations

import sys
from typing import Any

import torch

__all__ = ["ALLOCATE_ONLY", "HOST_VALUES", "METADATA_IN_PLACE", "METADATA_ONLY",
           "SHAPE_FROM_DATA", "host_waits", "on_meta", "ptr", "span", "where"]

METADATA_ONLY = frozenset(getattr(torch.ops.aten, n) for n in (
    "new_empty", "new_empty_strided", "new_zeros", "new_ones", "new_full", "empty_like",
    "zeros_like", "ones_like", "full_like", "empty_strided",
))


def host_waits(func: Any, args: Any, kwargs: dict[str, Any], tensors: list[torch.Tensor],
                kinds: list[tuple[int, int, bool] | None]) -> bool:
    """Whether a device operation on these tensors is a copy the host waits for: it
    touches host memory, and is not a ``non_blocking`` copy of pinned memory only.
    A 0-dim host tensor is a scalar argument, read by the host at the launch: no
    copy, no synchronization."""
    if not any(k is not None and t.dim() > 0 for k, t in zip(kinds, tensors)):
        return False
    non_blocking = kwargs.get("non_blocking")
    for i, a in enumerate(func._schema.arguments):
        if a.name == "non_blocking" and i < len(args):
            non_blocking = args[i]  # copy_(src, True): positional
    return not (bool(non_blocking) and all(k is None or k[2] for k in kinds))


def on_meta(t: torch.Tensor) -> torch.Tensor:
    return t.to("meta")


def ptr(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError, TypeError):
        return 0


def span(t: torch.Tensor) -> tuple[int, int] | None:
    """Byte range ``[lo, hi)`` of ``t`` inside its storage, or ``None`` if empty."""
    if t.numel() == 0:
        return None
    size = t.element_size()
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 1)
    lo = int(t.storage_offset()) * size
    return lo, lo + int(last + 1) * size


HOST_VALUES = frozenset({"Scalar", "bool", "int", "float", "SymInt", "SymBool"})
ALLOCATE_ONLY = frozenset(getattr(torch.ops.aten, n) for n in (
    "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided",
))
"""Factories that only allocate: nothing is written, so they wait for nothing."""
METADATA_IN_PLACE = frozenset(getattr(torch.ops.aten, n) for n in (
    "resize_", "resize_as_", "set_", "as_strided_", "squeeze_", "unsqueeze_", "transpose_",
    "t_", "swapdims_", "swapaxes_", "detach_", "_resize_output_", "_coalesced_",
))
"""In-place in the schema, but they change the tensor itself (its size, its storage):
they run when issued, as on CUDA, where they launch no kernel."""
SHAPE_FROM_DATA = frozenset(getattr(torch.ops.aten, n) for n in (
    "nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive",
))
_OWN = ("_simcuda.py", "_simstreams.py", "_simclocks.py", "_simreports.py", "_simops.py",
        "_simmemory.py",
        "_python_dispatch.py", "_ops.py", "_pytree.py", "contextlib.py",
        "threading.py", "overrides.py", "_tensor.py", "functional.py", "__init__.py")


def where() -> str:
    """The innermost frame outside the device, torch and pipeoff's executor machinery."""
    frame: Any = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.endswith(_OWN) and "/torch/" not in name:
            return f"{name.rsplit('/', 1)[-1]}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "?"
