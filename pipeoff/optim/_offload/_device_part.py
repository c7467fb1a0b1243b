"""The device part of a step: parameters whose optimizer state stays in device memory.

``OffloadOptimizer(..., offload_fraction=f)`` keeps about ``f`` of the optimizer
state in host memory (the *host part*, stepped in pipelined chunks on pipeoff's
lanes) and the rest on the device (the *device part*, stepped by torch's own
kernel for the wrapped optimizer on the caller's stream). ``f = 1`` is the whole
state on the host (no device part), ``f = 0`` all of it on the device.

[Note: the two parts of a step]

A step launches the host part's graph first, then steps the device part on the
caller's stream, so the two run at once (on CUDA the lanes wait only for the
work enqueued before the launch: the backward; on the CPU the caller computes
the device part while the lanes run the chunks). They touch disjoint
parameters, gradients and state, so nothing orders one part after the other;
what needs ordering is their *readers*, and the step is the join of both:

* the host part's readers wait for its chunks, as without a device part: the
  forward waits (hooks, read guard) for the chunks holding the parameters they
  read, and ``wait_for_step()`` for the execution;
* the device part's readers on the caller's stream (the next forward, backward,
  a clip) are ordered by the stream itself: a device-part parameter needs no
  forward wait. A reader off that stream (another thread, a stream of its own,
  the host after a chunked ``step()`` or ``wait_for_step()``, FSDP2's
  all-gather streams) waits for the event recorded after the device part's
  kernels: ``wait_for_step()`` synchronizes it (:meth:`DevicePart.wait`, switch
  ``"device_part_wait"``), and FSDP2's post-optimizer event is recorded after it;
* a failure of either part is reported once both have finished: a device part
  that raises waits for the host part first (switch ``"host_part_join"``), since
  whether the step can be retried depends on whether a chunk wrote.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from pipeoff import _accel, _compat, _faults
from pipeoff._compat import local_tensor as local
from pipeoff._held_interrupt import HeldInterrupt
from pipeoff.optim import _update
from pipeoff.optim._tensors import wrap_like
from pipeoff.optim._update import mark_step, wrote_before_failing

if TYPE_CHECKING:
    from pipeoff.optim._offload._layout import Layout

__all__ = ["DEVICE_PART_TASK", "DevicePart", "DeviceSplit", "resident", "split_params",
           "state_bytes", "to_device"]

DEVICE_PART_TASK = "device_part"
"""The name :mod:`pipeoff.testing`'s hooks (``fail_task``, ``fail_work``, ``hold_task``)
match for the device part's step, as they match a task's."""
_LANE = "caller"


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceSplit:
    """Which parameters keep their optimizer state on the device (indices in the layout).

    The split is a pure function of the parameters' planned sizes (global shapes,
    so every rank splits alike) and the fraction: parameters are taken in
    param-group order, the order a forward reads most models in and the order
    the host part's chunks run in, and each joins the device part while the
    device part's weight stays within ``(1 - fraction)`` of the total. The first
    layers thus step on the device: the next forward starts on them with no wait
    while the host part's chunks, which hold the later layers, land.
    """

    fraction: float
    """The ``offload_fraction``: about this share of the state is in host memory."""
    on_device: frozenset[int]
    """The parameters of the device part."""
    weights: tuple[int, ...]
    """Per parameter, its weight in bytes: planned elements x bytes per element x
    per-element state tensors (1 for a state-less optimizer, and in ``single_pass``
    for an optimizer that is not element-wise)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"fraction {self.fraction!r} is not in [0, 1]")
        if any(i < 0 or i >= len(self.weights) for i in self.on_device):
            raise ValueError("on_device indexes a parameter that has no weight")

    @property
    def device_weight(self) -> int:
        """Bytes (by weight) of the device part."""
        return sum(self.weights[i] for i in self.on_device)


def split_params(weights: Sequence[int], fraction: float) -> DeviceSplit:
    """The :class:`DeviceSplit` of parameters of these ``weights`` at ``fraction``.

    ``fraction == 1`` has no device part (not even zero-byte parameters): exactly
    the optimizer without a fraction.
    """
    on_device: list[int] = []
    if fraction < 1.0:
        budget = (1.0 - fraction) * sum(weights)
        used = 0
        for i, w in enumerate(weights):
            if used + w <= budget:
                on_device.append(i)
                used += w
    return DeviceSplit(fraction=float(fraction), on_device=frozenset(on_device),
                       weights=tuple(weights))


def resident(t: torch.Tensor, device: torch.device) -> bool:
    """Whether ``t`` is in the device memory of ``device`` (on a machine without an
    accelerator: on ``device``)."""
    accel = _accel.current()
    if accel.is_device(device):
        return accel.on_device(t)
    return t.device == device


def to_device(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` copied into new device memory laid out as ``param`` (its strides, its
    dtype), wrapped as ``param`` is (a DTensor's local shard)."""
    out = torch.empty_like(local(param))
    out.copy_(local(value))
    return wrap_like(param, out)


class DevicePart:
    """Steps the device part on the caller's stream, and is the join's wait for it.

    Created once per optimizer; its event (CUDA) is created at the first device
    part and recorded again at every step. Written and read on the caller's thread.
    """

    __slots__ = ("_event", "_pending", "interrupt", "written")

    def __init__(self) -> None:
        self._event: Any = None
        """Recorded on the caller's stream after the device part's kernels."""
        self._pending = False
        """The event is recorded and nobody has waited for it yet."""
        self.written = False
        """Whether the last device part may have written parameters (also when it raised:
        a version counter or a ``step`` count moved, or a fused kernel ran)."""
        self.interrupt = HeldInterrupt()
        """A Ctrl-C held back while the device part stepped, until the step passes it on."""

    def step(self, layout: Layout, inner: torch.optim.Optimizer) -> int:
        """Step the parameters of the device part that have a gradient, with torch's own
        kernel for ``inner`` (its class, its group's settings: ``fused`` or
        ``foreach`` as configured), on the caller's (current) stream.

        Their state is ``inner.state``'s, on the device; state a first step makes is
        committed once the kernels have run. Returns how many parameters were
        stepped; :attr:`written` says whether any was written.

        Ctrl-C is held back meanwhile (:attr:`interrupt`; the optimizer passes it on).

        Raises:
            BaseException: what the wrapped optimizer raised; :attr:`written` then
                says whether it may have written parameters before.
        """
        # Hazard: a KeyboardInterrupt between two parameters' updates leaves the
        # device part half-stepped: a torn step for one Ctrl-C.
        with self.interrupt.hold():
            return self._step(layout, inner)

    def _step(self, layout: Layout, inner: torch.optim.Optimizer) -> int:
        params = [layout.params[i] for i in sorted(layout.split.on_device)
                  if layout.params[i].grad is not None]
        self.written = False
        if not params:
            return 0
        by_group: dict[int, list[torch.Tensor]] = collections.defaultdict(list)
        for p in params:
            by_group[layout.group_of[layout.index[id(p)]]].append(p)
        shadow = _update.make_shadow(inner)
        shadow.param_groups = [
            {**{k: v for k, v in inner.param_groups[g].items() if k != "params"}, "params": ps}
            for g, ps in sorted(by_group.items())]
        state: collections.defaultdict[torch.Tensor, dict[str, Any]] = (
            collections.defaultdict(dict))
        for p in params:
            state[p] = dict(inner.state.get(p, {}))
        shadow.state = state
        accel = _accel.current()
        # The parameters themselves: a DTensor's local tensor bumps no version counter
        # when the DTensor is written in place (its wrapper does, except for foreach).
        marks = mark_step(params, [state[p] for p in params], accel.on_device)
        hooks = _faults.snapshot() if _faults.installed() else ()
        # The step hooks already ran around OffloadOptimizer.step: the body only.
        body = _compat.step_body(type(shadow))
        _faults.run_hooks(DEVICE_PART_TASK, _LANE, hooks=hooks)  # (raises: nothing written)
        try:
            with _faults.failing_work(DEVICE_PART_TASK, _LANE, hooks):
                # No compile-session guard (eager_math): this runs on the caller's
                # thread inside step(), where that thread cannot be compiling.
                body(shadow)
        except BaseException:
            self.written = wrote_before_failing(shadow, marks, params,
                                                [state[p] for p in params])
            raise
        finally:
            shadow.state = collections.defaultdict(dict)
            shadow.param_groups = []
        for p in params:
            if state.get(p):  # new state (a first step's), and scalars; none: no entry
                inner.state[p].update(state[p])
        self.written = True
        self._record(layout.device)
        return len(params)

    def mark(self, inner: torch.optim.Optimizer) -> None:
        """State was loaded (``load_state_dict``) into the device part on the caller's
        stream: the next :meth:`wait` (``wait_for_step()``) waits for those copies too."""
        params = [p for g in inner.param_groups for p in g["params"]]
        if params:
            self._record(local(params[0]).device)

    def _record(self, device: torch.device) -> None:
        accel = _accel.current()
        if accel.is_device(device):
            if self._event is None:
                self._event = accel.new_event()
            # Hazard: none here; this marks the end of the device part's kernels (or
            # loaded copies) on the caller's stream for the readers off it (wait()).
            self._event.record(accel.current_stream(device))
            self._pending = True

    def wait(self) -> None:
        """Block the host until the last device part's kernels have run (nothing to do on
        the CPU, where they ran inside ``step()``). The join's wait for the device part."""
        if not self._pending:
            return
        if not _faults.disabled("device_part_wait"):
            # Hazard: a reader off the caller's stream (another thread, a stream of
            # its own, the host reading state after wait_for_step() or a chunked
            # step) reading device-part parameters or state the caller's stream
            # has not written yet.
            self._event.synchronize()
        self._pending = False


def state_bytes(inner: torch.optim.Optimizer, layout: Layout,
                reserved: dict[tuple[int, str], torch.Tensor]) -> dict[str, int]:
    """Bytes of optimizer state by where it is: ``state_bytes_host`` (the host part's
    state, host tensors reserved for state a first step makes included) and
    ``state_bytes_device`` (the device part's); and the parameters of each part
    (``params_host``, ``params_device``). Scalar state (``step``) counts where it is
    on an accelerator (a fused optimizer's is on the device), else with its part."""
    host = sum(t.numel() * t.element_size() for t in reserved.values())
    device = 0
    accel = _accel.current()
    on_device = layout.split.on_device
    for i, p in enumerate(layout.params):
        for k, v in inner.state.get(p, {}).items():
            if not isinstance(v, torch.Tensor):
                continue
            t = local(v)
            nbytes = t.numel() * t.element_size()
            element = (k in layout.keys[i]) if layout.keys[i] else (
                k != "step" and t.shape == local(p).shape)
            if (accel.on_device(t) if accel.is_device(layout.device) and not element
                    else i in on_device):
                device += nbytes
            else:
                host += nbytes
    return {"state_bytes_host": host, "state_bytes_device": device,
            "params_host": len(layout.params) - len(on_device),
            "params_device": len(on_device)}
