"""The layout of a step: what the live param groups say, checked and frozen at a step boundary.

``OffloadOptimizer`` never trusts what it saw at construction: before every
step it takes a :func:`fingerprint` of the wrapped optimizer's live
``param_groups`` (which parameters, in which groups, their shapes, strides,
dtypes and devices, and the state keys the groups imply). When the fingerprint
changes (a group added, a parameter removed or re-pointed in place, a model
moved to channels-last), :func:`build_layout` checks the new groups and
re-plans, before anything is written. The step graph, the forward waits and the
checkpoint code read only this value, never the optimizer's internals.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from pipeoff._compat import local_tensor as local
from pipeoff._errors import ConfigError
from pipeoff.optim import _update
from pipeoff.optim._offload._device_part import DeviceSplit, split_params
from pipeoff.optim._plan import ChunkPlan, ParamMeta, plan_chunks, planned_numel
from pipeoff.optim._tensors import describe, memory_order

__all__ = ["FUSED_ALIGN", "Layout", "build_layout", "fingerprint"]

FUSED_ALIGN = 128
"""Fused kernels vectorize from a tensor's start: split parameters at multiples of this.
It is also the split granularity of 16-bit parameters (CPU kernels round a bf16
tensor's vectorized body and its scalar tail differently)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """One step's view of the wrapped optimizer's parameters (indices: positions in ``params``)."""

    params: tuple[torch.Tensor, ...]
    """The parameters, each once, in param-group order."""
    group_of: tuple[int, ...]
    """Per parameter, the index of its param group."""
    keys: tuple[tuple[str, ...], ...]
    """Per parameter, the per-element state keys its group implies (``()`` in ``single_pass``)."""
    orders: tuple[tuple[int, ...], ...]
    """Per parameter, the memory order of its local tensor (see ``memory_order``)."""
    device: torch.device
    """The device every parameter (its local shard) lives on."""
    plan: ChunkPlan | None
    """The chunk plan of the host part, or ``None`` in ``single_pass``."""
    chunks_of: tuple[tuple[int, ...], ...]
    """Per parameter, the chunks holding its elements (none for the device part)."""
    last_chunk: tuple[int, ...]
    """Per parameter, the last chunk holding it (-1 in ``single_pass`` and for the
    device part)."""
    split: DeviceSplit
    """Which parameters keep their state on the device (``offload_fraction``)."""
    index: Mapping[int, int]
    """``id()`` of each parameter, and of its local tensor, to its index."""
    signature: tuple[Any, ...]
    """The :func:`fingerprint` this layout was built from."""

    def chunks_for(self, params: Any) -> set[int]:
        """The chunks holding any of ``params`` (tensors not in the layout are ignored)."""
        out: set[int] = set()
        for p in params:
            i = self.index.get(id(p))
            if i is not None:
                out.update(self.chunks_of[i])
        return out


def _keys(inner: torch.optim.Optimizer, group: Mapping[str, Any],
          chunked: bool) -> tuple[str, ...]:
    return _update.state_keys(inner, group) if chunked else ()


def fingerprint(inner: torch.optim.Optimizer, chunked: bool) -> tuple[Any, ...]:
    """What a step's plan depends on, read from the live param groups (cheap: O(parameters))."""
    out: list[Any] = []
    for g in inner.param_groups:
        out.append((_keys(inner, g, chunked), bool(g.get("fused"))))
        for p in g["params"]:
            loc = local(p)
            out.append((id(p), p.shape, loc.shape, loc.stride(), loc.dtype, loc.device))
    return tuple(out)


def build_layout(inner: torch.optim.Optimizer, *, chunked: bool, chunk_bytes: int | None,
                 signature: tuple[Any, ...] | None = None,
                 offload_fraction: float = 1.0) -> Layout:
    """Check the live param groups of ``inner`` and lay them out: split them into a
    device part and a host part at ``offload_fraction``
    (:func:`~pipeoff.optim._offload._device_part.split_params`) and, if ``chunked``,
    plan the host part's chunks.

    Raises:
        ConfigError: no parameters; parameters on several devices; a parameter
            that is not dense in memory (it has no flat view to cut into
            chunks); or, when ``chunked``, a parameter listed twice.
    """
    sig = fingerprint(inner, chunked) if signature is None else signature
    params: list[torch.Tensor] = []
    group_of: list[int] = []
    keys: list[tuple[str, ...]] = []
    seen: dict[int, tuple[int, int]] = {}
    for gi, g in enumerate(inner.param_groups):
        gkeys = _keys(inner, g, chunked)
        for pos, p in enumerate(g["params"]):
            first = seen.get(id(p))
            if first is not None:
                if chunked:
                    raise ConfigError(
                        f"the parameter of shape {tuple(p.shape)} at param_groups[{gi}]"
                        f"['params'][{pos}] is also at param_groups[{first[0]}]['params']"
                        f"[{first[1]}]. torch would update it once per listing, in sequence, "
                        "with a warning; a chunked step updates each parameter "
                        "once. List each parameter once (model.parameters() yields a tied "
                        "weight once), or use mode='single_pass'"
                    )
                continue
            seen[id(p)] = (gi, pos)
            params.append(p)
            group_of.append(gi)
            keys.append(gkeys)
    if not params:
        raise ConfigError("the wrapped optimizer has no parameters")
    dev = local(params[0]).device
    orders: list[tuple[int, ...]] = []
    for i, p in enumerate(params):
        loc = local(p)
        if loc.device != dev:
            raise ConfigError(
                f"{describe(i, p)} is on another device than {describe(0, params[0])}; "
                "an OffloadOptimizer needs all its parameters on one device"
            )
        order = memory_order(loc)
        if order is None:
            raise ConfigError(
                f"{describe(i, p)} has strides {loc.stride()}, which are not dense in memory "
                "(it overlaps itself or has gaps); chunks are flat slices of a parameter's "
                "memory. Give it a dense layout (.contiguous(), or a memory_format)"
            )
        orders.append(order)
    index: dict[int, int] = {}
    for i, p in enumerate(params):
        index[id(p)] = i
        index.setdefault(id(local(p)), i)
    plan = None
    chunks_of: list[tuple[int, ...]] = [()] * len(params)
    last_chunk = [-1] * len(params)
    elementwise = type(inner) in _update.ELEMENTWISE
    nkeys = [len(keys[i]) if chunked else
             len(_update.state_keys(inner, inner.param_groups[group_of[i]])) if elementwise
             else 1 for i in range(len(params))]
    split = split_params([planned_numel(p) * local(p).element_size() * max(1, nkeys[i])
                          for i, p in enumerate(params)], offload_fraction)
    if chunked:
        fused = any(g.get("fused") for g in inner.param_groups)
        host = [i for i in range(len(params)) if i not in split.on_device]
        metas = [ParamMeta(numel=planned_numel(params[i]),
                           itemsize=local(params[i]).element_size(),
                           nkeys=len(keys[i]), group=group_of[i],
                           align=FUSED_ALIGN if local(params[i]).element_size() < 4 else 1)
                 for i in host]
        plan = plan_chunks(metas, chunk_bytes, align=FUSED_ALIGN if fused else 1)
        if split.on_device:  # segments index the host part: index the layout
            plan = dataclasses.replace(plan, chunks=tuple(
                dataclasses.replace(c, segments=tuple(
                    dataclasses.replace(s, param=host[s.param]) for s in c.segments))
                for c in plan.chunks))
        per: list[list[int]] = [[] for _ in params]
        for c in plan.chunks:
            for s in c.segments:
                if not per[s.param] or per[s.param][-1] != c.index:
                    per[s.param].append(c.index)
        chunks_of = [tuple(v) for v in per]
        last_chunk = [v[-1] if v else -1 for v in chunks_of]
    return Layout(params=tuple(params), group_of=tuple(group_of), keys=tuple(keys),
                  orders=tuple(orders), device=dev, plan=plan, chunks_of=tuple(chunks_of),
                  last_chunk=tuple(last_chunk), index=types.MappingProxyType(index),
                  signature=sig, split=split)
