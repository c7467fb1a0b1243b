"""Tensor helpers of both optimizers: memory order, DTensor wrapping, arenas (the local
shard of a DTensor is :func:`pipeoff._compat.local_tensor`, the one helper)."""

from __future__ import annotations

import collections
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from pipeoff import _compat

__all__ = ["NEVER", "casts_to", "describe", "flat", "host_alloc", "memory_order", "relaid",
           "snapshot", "version_of", "wrap_like"]


def casts_to(master: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``master`` cast to ``weight``'s dtype is ``weight``, bit for bit (a master
    and the weight written from it; on either device, the same shape)."""
    cast = master.detach().to(weight.dtype)
    # (Flat first: a 0-dim tensor has no bytes view; a tester's find, CLIP's logit_scale.)
    return cast.shape == weight.shape and bool(torch.equal(
        cast.cpu().reshape(-1).view(torch.uint8),
        weight.detach().cpu().reshape(-1).view(torch.uint8)))


NEVER: tuple[int, int, Any] = (-1, -1, None)
"""A version no :func:`version_of` is: a weight noted with it counts as written since."""


def version_of(param: torch.Tensor) -> tuple[int, int, Any]:
    """The version counters of a parameter and of its local shard (a plain tensor's
    twice), and where that shard's data is. Both counters: an in-place op on a DTensor
    (``copy_``, ``clamp_``, what ``model.load_state_dict`` and ``set_model_state_dict``
    run) bumps the DTensor's alone (torch 2.13), a write to the local shard (the
    optimizer's own) the shard's alone. The data: ``param.data = t`` (``model.to(dtype)``,
    ``.half()``) swaps it and bumps neither (a tester's round trip through BF16 for an
    evaluation was not seen). It is told by a weak reference to the shard's storage
    (torch keeps one Python object per live storage): a data pointer may come back
    after such a round trip (the allocator reuses the freed block); a dead reference
    compares equal only to itself."""
    local = _compat.local_tensor(param)
    try:
        data: Any = weakref.ref(local.untyped_storage())
    except (RuntimeError, TypeError, NotImplementedError):  # (a subclass without storage)
        data = None
    return param._version, local._version, data


def wrap_like(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a state entry for ``p``: a DTensor like ``p`` if ``p`` is one."""
    if not hasattr(p, "placements"):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape,  # type: ignore[attr-defined]
                              stride=p.stride(), run_check=False)


def memory_order(t: torch.Tensor) -> tuple[int, ...] | None:
    """The dimension order in which ``t``'s elements lie in memory, or ``None``.

    ``t.permute(order)`` is contiguous. A contiguous tensor gives the identity; a
    channels-last convolution weight gives ``(0, 2, 3, 1)``. ``None`` means the
    tensor is not dense (it overlaps itself or has gaps), so it has no flat view.
    """
    n = t.dim()
    if t.is_contiguous():
        return tuple(range(n))
    strides, sizes = t.stride(), t.shape
    order = tuple(sorted(range(n), key=lambda d: (-strides[d], -sizes[d], d)))
    return order if t.permute(order).is_contiguous() else None


def flat(t: torch.Tensor, order: Sequence[int] | None = None) -> torch.Tensor:
    """A 1-D view of a dense tensor's elements in memory order (``order`` if given).

    For element-wise math the order of elements does not matter, as long as a
    parameter, its gradient and its state are all flattened in the same order.
    """
    if order is None:
        order = memory_order(t)
        if order is None:
            raise ValueError(f"a tensor of shape {tuple(t.shape)} and strides {t.stride()} "
                             "is not dense in memory")
    if list(order) == list(range(t.dim())):
        return t.view(-1)
    return t.permute(tuple(order)).view(-1)


def flat_like(t: torch.Tensor, order: Sequence[int]) -> torch.Tensor:
    """``t``'s elements as a 1-D tensor in ``order`` (a view if its layout allows, else a copy)."""
    p = t.permute(tuple(order)) if list(order) != list(range(t.dim())) else t
    return p.view(-1) if p.is_contiguous() else p.contiguous().view(-1)


def relaid(t: torch.Tensor, order: Sequence[int]) -> torch.Tensor:
    """``t``'s memory seen with the strides of a tensor laid out in ``order``.

    The same shape, dtype and storage, with the strides :func:`host_alloc` gives
    that order; element values are *not* kept (each index now names another
    byte). For host tensors allocated ahead that hold no values yet, when their
    parameter's layout changed before they were used. ``t`` must be dense.
    """
    n = t.numel()
    piece = t.as_strided((n,), (1,), t.storage_offset())
    order = tuple(order)
    if order == tuple(range(t.dim())):
        return piece.view(t.shape)
    inverse = [0] * len(order)
    for k, d in enumerate(order):
        inverse[d] = k
    return piece.view([t.shape[d] for d in order]).permute(inverse)


def snapshot(value: Any) -> Any:
    """A copy of a hyperparameter that later writes to the group cannot change."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, tuple):
        return tuple(snapshot(v) for v in value)
    if isinstance(value, list):
        return [snapshot(v) for v in value]
    return value


def describe(i: int, p: torch.Tensor) -> str:
    return f"parameter {i} (shape {tuple(p.shape)}, {p.dtype}, on {_compat.local_tensor(p).device})"


def index_of(params: Sequence[torch.Tensor], param: torch.Tensor) -> int:
    """The position of ``param`` in ``params``, by identity.

    Raises:
        ConfigError: it is not there.
    """
    for i, p in enumerate(params):
        if p is param:
            return i
    from pipeoff._errors import ConfigError

    raise ConfigError(f"a tensor of shape {list(param.shape)} that is not a parameter of "
                      "this optimizer (compare by identity)")


def numel(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def host_alloc(specs: Sequence[tuple[torch.Size, torch.dtype] | tuple[torch.Size, torch.dtype,
                                                                      Sequence[int]]],
               pin: bool) -> list[torch.Tensor]:
    """Host tensors of the given shapes, carved from one (pinned) arena per dtype.

    A spec may carry a memory order (see :func:`memory_order`): the tensor then
    has the strides of a tensor laid out in that order (a channels-last weight's
    state is channels-last too, as torch's own ``zeros_like`` state would be).

    Each tensor sits on a storage of its own that aliases its piece of the
    arena (``UntypedStorage`` slicing; the slice keeps the arena alive), at
    offset 0: torch 2.13 cannot pickle a DTensor whose local tensor is a view at
    a non-zero offset, and ``torch.save`` of a view would write the whole arena.
    """
    total: dict[torch.dtype, int] = collections.defaultdict(int)
    for spec in specs:
        total[spec[1]] += max(1, numel(spec[0]))
    from pipeoff import _accel

    accel = _accel.current()
    arenas = {d: accel.host_empty(n, d, pinned=pin) for d, n in total.items()}
    offs: dict[torch.dtype, int] = collections.defaultdict(int)
    out = []
    for spec in specs:
        shape, dtype = spec[0], spec[1]
        order = tuple(spec[2]) if len(spec) > 2 else tuple(range(len(shape)))  # type: ignore[misc]
        n = numel(shape)
        o = offs[dtype]
        size = dtype.itemsize
        storage = arenas[dtype].untyped_storage()[o * size:(o + n) * size]
        piece = torch.empty(0, dtype=dtype).set_(storage, 0, (n,), (1,))
        if order == tuple(range(len(shape))):
            out.append(piece.view(shape))
        else:
            inverse = [0] * len(order)
            for k, d in enumerate(order):
                inverse[d] = k
            out.append(piece.view([shape[d] for d in order]).permute(inverse))
        offs[dtype] = o + max(1, n)
    return out
