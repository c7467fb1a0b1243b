"""An offload optimizer's state in host memory: moved there, loaded there, checked.

Functions over the wrapped optimizer's ``state`` and a step's
:class:`~pipeoff.optim._offload._layout.Layout`; :class:`~pipeoff.optim.OffloadOptimizer`
calls them between steps, on the caller's thread.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

import torch

from pipeoff import _accel
from pipeoff._compat import local_tensor as local
from pipeoff._errors import ConfigError
from pipeoff.optim._offload._device_part import resident, to_device
from pipeoff.optim._offload._layout import Layout
from pipeoff.optim._tensors import describe, host_alloc, index_of, memory_order, wrap_like

__all__ = ["check_loaded", "check_state_dtypes", "host_tensor", "loaded_value",
           "offload_state"]


def offload_state(inner: torch.optim.Optimizer, layout: Layout, *, chunked: bool,
                  pin: bool) -> None:
    """Move per-element state of the host part that is not in host memory there (pinned
    if ``pin``, in the parameter's memory order, so that chunks are flat slices of
    both), and that of the device part that is not in device memory there (laid out
    as its parameter, as torch's own state is)."""
    todo: list[tuple[int, str, torch.Tensor]] = []
    accel = _accel.current()
    on_device = layout.split.on_device
    for i, p in enumerate(layout.params):
        st = inner.state.get(p)
        if not st:
            continue
        for k, v in st.items():
            if not isinstance(v, torch.Tensor):
                continue
            loc = local(v)
            element = (k in layout.keys[i]) if chunked else (
                k != "step" and loc.shape == local(p).shape)
            if element and i in on_device:
                if not resident(loc, layout.device):
                    st[k] = to_device(p, v)
                continue
            if element and (accel.on_device(loc)
                            or memory_order(loc) != layout.orders[i]
                            or (pin and not accel.is_pinned(loc))):
                todo.append((i, k, loc))
    hosts = host_alloc([(t.shape, t.dtype, layout.orders[i]) for i, _, t in todo], pin)
    for (i, k, t), h in zip(todo, hosts):
        h.copy_(t)
        p = layout.params[i]
        inner.state[p][k] = wrap_like(p, h)


def check_state_dtypes(inner: torch.optim.Optimizer, layout: Layout) -> None:
    """Chunks stage state in the parameter's dtype: refuse state of another one.

    Raises:
        ConfigError: naming the parameter, the state and both dtypes.
    """
    for i, p in enumerate(layout.params):
        st = inner.state.get(p)
        if not st or i in layout.split.on_device:  # torch's own kernel steps it
            continue
        dtype = local(p).dtype
        for k in layout.keys[i]:
            v = st.get(k)
            if isinstance(v, torch.Tensor) and local(v).dtype != dtype:
                raise ConfigError(
                    f"{describe(i, p)} has state {k!r} of dtype {local(v).dtype}, not "
                    f"its own {dtype} (the model's dtype changed after the optimizer made "
                    "state: model.to(dtype)). torch mixes the two dtypes here or refuses, "
                    "depending on the optimizer; a chunked step stages state in the "
                    "parameter's dtype. Cast the state (save and load_state_dict, which "
                    "casts it), or change the dtype before the first step"
                )


def check_loaded(p: torch.Tensor, key: str, value: Any, element: bool) -> None:
    """Raise :class:`ConfigError` for a per-element entry whose shape is not the parameter's."""
    if element and isinstance(value, torch.Tensor) and local(value).shape != local(p).shape:
        raise ConfigError(
            f"state {key!r} of a parameter of shape {tuple(p.shape)} has (local) shape "
            f"{tuple(local(value).shape)}, not the parameter's {tuple(local(p).shape)}: the "
            "checkpoint does not belong to these parameters"
        )


def loaded_value(p: torch.Tensor, key: str, value: Any, *, step_on_device: bool,
                 element: bool, old: Any,
                 reserved: MutableMapping[tuple[int, str], torch.Tensor],
                 device_part: bool = False) -> Any:
    """A loaded state value in host memory. A per-element one is copied into the host
    tensor that already holds that state (``old``), or into a ``reserved`` one, where
    they fit: loading then takes no second copy of the (pinned) state. Otherwise
    torch's dtype policy: ``step`` kept as it is, or a float32 tensor on the
    parameter's device for fused and capturable optimizers. A per-element value of
    the ``device_part`` goes to device memory instead (into ``old`` where it fits)."""
    if element and device_part and isinstance(value, torch.Tensor):
        reserved.pop((id(p), key), None)  # host memory it will not use
        dst = local(old) if isinstance(old, torch.Tensor) else None
        if (dst is not None and resident(dst, local(p).device)
                and dst.shape == local(p).shape and dst.dtype == local(p).dtype
                and memory_order(dst) == memory_order(local(p))):
            dst.copy_(local(value).detach())
            return wrap_like(p, dst)
        return to_device(p, value.detach())
    if element and isinstance(value, torch.Tensor):
        for dst in (old, reserved.pop((id(p), key), None)):
            if (isinstance(dst, torch.Tensor) and not _accel.current().on_device(local(dst))
                    and local(dst).shape == local(p).shape
                    and local(dst).dtype == local(p).dtype
                    and memory_order(local(dst)) == memory_order(local(p))):
                local(dst).copy_(local(value).detach())
                return wrap_like(p, local(dst))
    if not isinstance(value, torch.Tensor):
        return value
    if key == "step":
        return value.to(dtype=torch.float32, device=p.device) if step_on_device else value
    loc = local(value).detach()
    dtype = local(p).dtype if p.is_floating_point() else loc.dtype
    loc = loc.to(device="cpu", dtype=dtype, copy=True)
    return wrap_like(p, loc) if hasattr(value, "placements") else loc


def host_tensor(inner: torch.optim.Optimizer, layout: Layout, param: torch.Tensor, key: str,
                inflight: Mapping[int, Mapping[str, torch.Tensor]], *,
                chunked: bool = True) -> torch.Tensor:
    """The local host tensor of ``param``'s per-element state ``key``: the one the step in
    flight writes (``inflight``, by parameter index, new state included), else the
    committed one. ``chunked``: the layout lists the per-element keys (outside
    ``mode="single_pass"``, whose per-element state is any tensor of the parameter's
    shape but ``"step"``, as :func:`offload_state` takes it).

    Raises:
        ConfigError: ``param`` is not in ``layout``, is in the device part (its state
            is in device memory), or has no such per-element state (scalar state such
            as ``"step"`` is committed when a step ends: read it after waiting).
    """
    i = index_of(layout.params, param)
    if i in layout.split.on_device:
        raise ConfigError(f"{describe(i, param)} is in the device part (offload_fraction="
                          f"{layout.split.fraction}): its state {key!r} is in device memory, "
                          "not host memory; read it from opt.state after wait_for_step()")
    host = inflight.get(i, {}).get(key)
    if host is None:
        value = inner.state.get(param, {}).get(key)
        if isinstance(value, torch.Tensor) and (key in layout.keys[i] if chunked else (
                key != "step" and local(value).shape == local(param).shape)):
            host = local(value)
    if host is None:
        raise ConfigError(
            f"{describe(i, param)} has no per-element state {key!r} "
            f"(it has {sorted(layout.keys[i])}); scalar state such as 'step' is "
            "committed when a step ends: read opt.state after wait_for_step()")
    return host
