"""Small tensor helpers of the offload optimizer: local shards, DTensor wrapping, host arenas."""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence
from typing import Any

import torch

__all__ = ["describe", "host_alloc", "local", "snapshot", "wrap_like"]


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor, or the tensor itself."""
    return getattr(t, "_local_tensor", t) if hasattr(t, "placements") else t


def wrap_like(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a state entry for ``p``: a DTensor like ``p`` if ``p`` is one."""
    if not hasattr(p, "placements"):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape,  # type: ignore[attr-defined]
                              stride=p.stride(), run_check=False)


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
    return f"parameter {i} (shape {tuple(p.shape)}, {p.dtype}, on {local(p).device})"


def numel(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def host_alloc(specs: Sequence[tuple[torch.Size, torch.dtype]], pin: bool) -> list[torch.Tensor]:
    """Host tensors of the given shapes, carved from one (pinned) arena per dtype."""
    total: dict[torch.dtype, int] = collections.defaultdict(int)
    for shape, dtype in specs:
        total[dtype] += max(1, numel(shape))
    arenas = {d: torch.empty(n, dtype=d, pin_memory=pin) for d, n in total.items()}
    offs: dict[torch.dtype, int] = collections.defaultdict(int)
    out = []
    for shape, dtype in specs:
        n = numel(shape)
        o = offs[dtype]
        out.append(arenas[dtype][o:o + n].view(shape))
        offs[dtype] = o + max(1, n)
    return out
