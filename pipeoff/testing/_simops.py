"""What an operation touches, as the simulated device's checker sees it: the kinds of
aten operations, the byte span of a tensor, and where in the caller's code it ran."""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["ALLOCATE_ONLY", "COPIES", "HOST_VALUES", "METADATA_IN_PLACE", "METADATA_ONLY",
           "SHAPE_FROM_DATA", "HostReads", "host_waits", "on_meta", "ptr", "scalar_argument",
           "span", "where", "written_first"]

METADATA_ONLY = frozenset(getattr(torch.ops.aten, n) for n in (
    "new_empty", "new_empty_strided", "new_zeros", "new_ones", "new_full", "empty_like",
    "zeros_like", "ones_like", "full_like", "empty_strided", "rand_like", "randn_like",
    "randint_like",
))

COPIES = frozenset(getattr(torch.ops.aten, n) for n in ("copy_", "_copy_from", "_foreach_copy_"))
"""Copies: a 0-dim host tensor in one is memory the copy reads or writes (a memcpy, as
any other), not a scalar argument."""


def scalar_argument(func: Any, t: torch.Tensor, kind: tuple[int, int, bool] | None,
                    written: bool = False) -> bool:
    """Whether ``t`` (in host memory if ``kind``; ``written`` by ``func``) is, in a
    device operation ``func``, a scalar argument: a 0-dim host tensor read outside a
    copy, whose value the host reads at the launch (TensorIterator's CPU scalar).
    Hazard: a write into a 0-dim host tensor (a copy's, or an update's) made into a
    copy of it taken at the issue (a tester's find: a scalar parameter's gradient
    never reached its host buffer, nor its state its host copy)."""
    return (kind is not None and t.dim() == 0 and not written
            and func.overloadpacket not in COPIES)


def written_first(func: Any, args: Any) -> torch.Tensor | None:
    """The tensor an in-place operation writes (its first argument), or ``None``."""
    arguments = func._schema.arguments
    info = arguments[0].alias_info if arguments else None
    first = args[0] if args else None
    return first if info is not None and info.is_write and isinstance(first, torch.Tensor) else None


def host_waits(func: Any, args: Any, kwargs: dict[str, Any], tensors: list[torch.Tensor],
                kinds: list[tuple[int, int, bool] | None]) -> bool:
    """Whether a device operation on these tensors is a copy the host waits for: it
    touches host memory, and is not a ``non_blocking`` copy of pinned memory only.
    A scalar argument (:func:`scalar_argument`) is read by the host at the launch: no
    copy, no synchronization."""
    out = written_first(func, args)
    if not any(k is not None and not scalar_argument(func, t, k, t is out)
               for k, t in zip(kinds, tensors)):
        return False
    non_blocking = kwargs.get("non_blocking")
    for i, a in enumerate(func._schema.arguments):
        if a.name == "non_blocking" and i < len(args):
            non_blocking = args[i]  # copy_(src, True): positional
    return not (bool(non_blocking) and all(k is None or k[2] for k in kinds))


class HostReads(TorchFunctionMode):
    """On host threads: reads that bypass aten (``.tolist()``, ``.numpy()``) are checked
    like an aten read, and on device memory synchronize the host first."""

    _READS = frozenset({"tolist", "numpy", "__array__"})

    def __init__(self, sim: Any) -> None:
        super().__init__()
        self.sim = sim

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in self._READS and args and isinstance(args[0], torch.Tensor):
            self.sim.host_read(args[0], name)
        return func(*args, **(kwargs or {}))


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
"""Return types that are values for the host: the host waits for them. Not ``.item()``'s
(``number``): a tensor made from Python data (AdamW's ``step``, a CPU tensor on CUDA)
is device memory here, and its ``.item()`` would order the host after the stream
where CUDA does not, hiding races (two tests lost the race they force). So ``.item()``
of device memory does not synchronize here: synchronize before reading what it
would have ordered."""
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
