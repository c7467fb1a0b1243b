"""OffloadOptimizer's host layout: the layout of the live param groups (rebuilt when
they change), the host state that follows each parameter's memory order, and the
host tensors and staging reserved ahead of the first step.

:class:`HostLayout` owns three facts: the current :class:`~pipeoff.optim._offload._layout.Layout`,
the host tensors reserved for state that does not exist yet, and the plan whose
staging is reserved. ``OffloadOptimizer`` reads them; only this object writes them.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable
from typing import Any

import torch

from pipeoff._compat import local_tensor as _local
from pipeoff._errors import ConfigError
from pipeoff.optim import _update
from pipeoff.optim._offload._graph_shape import offload_step
from pipeoff.optim._offload._host_state import (
    check_loaded,
    check_state_dtypes,
    loaded_value,
    offload_state,
)
from pipeoff.optim._offload._layout import Layout, build_layout, fingerprint
from pipeoff.optim._offloaded import check_in_model
from pipeoff.optim._tensors import host_alloc, memory_order, relaid
from pipeoff.staging import reserve_for

__all__ = ["HostLayout"]


class HostLayout:
    """The layout of a wrapped optimizer's live param groups and its reserved host memory.

    Args:
        inner: the wrapped optimizer.
        chunked: the optimizer steps in chunks (not ``single_pass``).
        chunk_bytes: the most bytes of one chunk (``None``: one chunk).
        pin_memory: allocate pinned host memory.
        on_change: called when the layout is rebuilt for edited param groups (the
            forward waits learn the new parameters' reads).
        offload_fraction: the share of the state in host memory (the rest, the
            device part, stays on the device).
    """

    def __init__(self, inner: torch.optim.Optimizer, *, chunked: bool, chunk_bytes: int | None,
                 pin_memory: bool, on_change: Callable[[], None],
                 offload_fraction: float = 1.0) -> None:
        self.inner = inner
        self.on_change = on_change
        self.chunked = chunked
        self.chunk_bytes = chunk_bytes
        self.pin_memory = pin_memory
        self.offload_fraction = offload_fraction
        self.reserved: dict[tuple[int, str], torch.Tensor] = {}
        """Host tensors allocated ahead for state that does not exist yet, by
        ``(id(param), key)``: the step takes them (``pop``)."""
        self.staging_reserved: tuple[int, ...] | None = None
        """The signature of the plan whose staging blocks are reserved."""
        self.layout: Layout = build_layout(inner, chunked=chunked, chunk_bytes=chunk_bytes,
                                           offload_fraction=offload_fraction)
        self.adopt(self.layout)

    def pop_reserved(self, param: torch.Tensor, key: str) -> torch.Tensor | None:
        """The host tensor reserved for ``param``'s state ``key`` (taken: the step
        owns it from now), or ``None``."""
        return self.reserved.pop((id(param), key), None)

    def current(self, attached: torch.nn.Module | None) -> Layout:
        """The layout of the live param groups, rebuilt (and checked against
        ``attached``) if they changed.

        Raises:
            ConfigError: the live groups are invalid.
        """
        sig = fingerprint(self.inner, self.chunked)
        if sig == self.layout.signature:
            return self.layout
        self.adopt(self.checked(attached, sig))
        self.on_change()
        return self.layout

    def checked(self, attached: torch.nn.Module | None, sig: tuple[Any, ...] | None = None, *,
                check_state: bool = True) -> Layout:
        """A layout of the live param groups, checked.

        Raises:
            ConfigError: a parameter is not in ``attached``, or (``check_state``) a
                state tensor is of a dtype the chunks cannot step.
        """
        layout = build_layout(self.inner, chunked=self.chunked, chunk_bytes=self.chunk_bytes,
                              signature=sig, offload_fraction=self.offload_fraction)
        if attached is not None:
            check_in_model(layout.params, attached)
        if self.chunked and check_state:
            check_state_dtypes(self.inner, layout)
        return layout

    def adopt(self, layout: Layout) -> None:
        """Make ``layout`` the current one: existing host state, and host tensors
        reserved ahead, follow each parameter's memory order (it changes under
        ``model.to(memory_format=...)``; chunks are flat slices of both at once);
        the device part's state is in device memory."""
        # State with values is copied into the new order (offload_state keeps
        # each element's value); a reserved tensor holds none yet, so it is only
        # re-strided, and one whose parameter changed shape or dtype, or that
        # is in the device part, is dropped.
        offload_state(self.inner, layout, chunked=self.chunked, pin=self.pin_memory)
        for (pid, k), h in list(self.reserved.items()):
            i = layout.index.get(pid)
            if i is None or id(layout.params[i]) != pid:
                continue  # not a parameter now; kept in case it comes back
            loc = _local(layout.params[i])
            if h.shape != loc.shape or h.dtype != loc.dtype or i in layout.split.on_device:
                del self.reserved[(pid, k)]
            elif memory_order(h) != layout.orders[i]:
                self.reserved[(pid, k)] = relaid(h, layout.orders[i])
        self.layout = layout

    def reserve(self, layout: Layout, *, prefetch: int | None, budget: int | None) -> int:
        """Allocate the host memory of every state tensor of ``layout`` that does not
        exist yet, and reserve the staging blocks a step uses. Returns the bytes."""
        staged = 0
        plan = layout.plan
        if plan is not None and self.staging_reserved != plan.signature():
            local = [_local(p) for p in layout.params]
            reserved = reserve_for(*offload_step(
                layout.device, plan, itemsize=[t.element_size() for t in local],
                nkeys=[len(k) for k in layout.keys], local_numel=[t.numel() for t in local],
                present=[len(k) for k in layout.keys], updated=range(len(local)),
                prefetch=prefetch, budget=budget))
            staged = sum(reserved.values())
            self.staging_reserved = plan.signature()
        want = []
        for i, p in enumerate(layout.params):
            if i in layout.split.on_device:
                continue  # its state is made on the device by torch's own step
            st = self.inner.state.get(p, {})
            want += [(i, k) for k in layout.keys[i]
                     if st.get(k) is None and (id(p), k) not in self.reserved]
        hosts = host_alloc([(_local(layout.params[i]).shape, _local(layout.params[i]).dtype,
                             layout.orders[i]) for i, _ in want], self.pin_memory)
        for (i, k), h in zip(want, hosts):
            self.reserved[(id(layout.params[i]), k)] = h
        return staged + sum(h.numel() * h.element_size() for h in hosts)

    def load(self, state_dict: dict[str, Any], attached: torch.nn.Module | None) -> None:
        """Load ``state_dict`` (checked as an optimizer state dict) into the wrapped
        optimizer, its state straight into host memory in the layout. Either all of
        it is loaded or (on any error) nothing is.

        Raises:
            ConfigError: not an optimizer state dict; a per-element state tensor does not
                have its parameter's shape, or the loaded groups are invalid.
            ValueError: torch's own checks (a group of another size).
        """
        if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= state_dict.keys():
            raise ConfigError("load_state_dict expects an optimizer state dict (a dict with "
                              f"'state' and 'param_groups'), got {type(state_dict).__name__}")
        # The wrapped optimizer's load_state_dict would move every state tensor
        # to its parameter's device, all at once: on a GPU, the whole optimizer
        # state this class exists to keep off it. Load the groups through it
        # (its checks, hooks and hyperparameters) and the state straight to host.
        saved = state_dict["state"]
        before = (self.inner.param_groups, self.inner.state)
        old_state = self.inner.state
        try:
            self.inner.load_state_dict({**state_dict, "state": {}})
            self.inner.state = old_state  # the layout checks below read it
            ids = itertools.chain.from_iterable(g["params"] for g in state_dict["param_groups"])
            params = itertools.chain.from_iterable(g["params"] for g in self.inner.param_groups)
            by_id = dict(zip(ids, params))
            group_of = {id(p): g for g in self.inner.param_groups for p in g["params"]}
            # Check everything before anything is written.
            entries: list[tuple[int, Any, Any, bool, tuple[str, ...]]] = []
            for pid, entry in saved.items():
                p = by_id.get(pid)
                if p is None:
                    entries.append((pid, None, entry, False, ()))
                    continue
                group = group_of[id(p)]
                on_device = bool(group.get("fused") or group.get("capturable"))
                keys = _update.state_keys(self.inner, group) if self.chunked else ()
                _update.check_loaded_entry(f"parameter {pid}", entry,
                                           _update.required_keys(self.inner, group))
                for k, v in entry.items():
                    check_loaded(p, k, v, k in keys)
                entries.append((pid, p, entry, on_device, keys))
            # The loaded state is cast to each parameter's dtype: check the rest.
            layout = self.checked(attached, check_state=False)
        except BaseException:
            self.inner.param_groups, self.inner.state = before  # nothing was loaded
            raise
        state: collections.defaultdict[Any, Any] = collections.defaultdict(dict)
        for pid, p, entry, on_device, keys in entries:
            if p is None:
                state[pid] = entry  # as torch does with ids it does not know
                continue
            reuse = old_state.get(p, {})
            dev = layout.index[id(p)] in layout.split.on_device
            state[p] = {k: loaded_value(p, k, v, step_on_device=on_device,
                                        element=k in keys or (dev and _single_element(p, k, v)),
                                        old=reuse.get(k), reserved=self.reserved,
                                        device_part=dev)
                        for k, v in entry.items()}
        # torch's own loader ends with the class's __setstate__: its fix-ups of older
        # formats (a float "step" becomes the tensor its step functions require).
        self.inner.__setstate__({"state": state, "param_groups": self.inner.param_groups})
        self.adopt(layout)


def _single_element(p: torch.Tensor, key: str, value: Any) -> bool:
    """Whether ``value`` is per-element state of ``p`` by its shape (``single_pass``, where
    the state keys are the optimizer's own)."""
    return (key != "step" and isinstance(value, torch.Tensor)
            and _local(value).shape == _local(p).shape)
