"""What ``param.grad`` holds under full offload: the gradient sum, for the loop's own calls.

Full offload takes each gradient off the device as autograd finalizes it, so
every call of the training loop that reads ``.grad`` (torch's
``clip_grad_norm_``, ``get_total_norm`` and ``clip_grads_with_norm_``,
accelerate's and Lightning's clipping, Lightning's ``grad_norm``) would see
nothing: no norm, nothing clipped, no error. Instead, from the end of each
backward until the next forward with gradients enabled (or ``step()``,
``zero_grad()``), every parameter with a gradient in the accumulation holds a
:class:`HostGrad` in ``.grad`` (inside a DTensor for a DTensor parameter): a
tensor with the parameter's (local) shape, dtype, strides and device and no
storage, which stands for its FP32 host sum:

* ``torch.linalg.vector_norm`` / ``Tensor.norm`` and ``torch._foreach_norm``
  return the norm of the host sum (FP32, 0-dim, on the parameter's device):
  torch's own ``vector_norm`` of the FP32 sum, so a clip call's total norm is
  torch's bits for the FP32 gradients. The 2-norm is the one the final
  accumulation took while the sum was hot; other orders are taken on demand.
* in-place scaling (``mul_``, ``div_`` by a number or a one-element tensor,
  their ``_foreach_`` forms), clamping (``clamp_``, ``clamp_min_``,
  ``clamp_max_`` and their ``_foreach_`` forms, as ``clip_grad_value_`` uses)
  and ``zero_`` are recorded, and applied to the host sum in the step, in
  order, before the optimizer's math (one clip coefficient goes into the
  native kernel's pass: no extra bytes);
* ``detach()``, ``.data`` and a same-shape ``view`` give another placeholder of
  the same gradient;
* any other operation sees the real gradient: the sum, with what was recorded
  applied, is copied to the device in the parameter's dtype and becomes
  ``param.grad``; a write to that tensor (or a tensor put in ``.grad`` by hand,
  or ``None``) is what ``step()`` steps on.

Reading a placeholder ends the accumulation (as ``opt.grad_norm`` does): a
backward after it, before ``step()``, raises. Each read waits for the host
folds of the gradients (not for the step); under ``overlap="backward"`` the
chunks step during the final backward, so a recorded edit is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from pipeoff import _compat, _faults
from pipeoff._compat import local_tensor as local
from pipeoff._errors import ConfigError, GradientError
from pipeoff.optim._full_offload._edits import FOREACH_CLAMP as _FOREACH_CLAMP
from pipeoff.optim._full_offload._edits import FOREACH_SCALE as _FOREACH_SCALE
from pipeoff.optim._full_offload._edits import SCALE as _SCALE
from pipeoff.optim._full_offload._edits import Edit, apply_edits
from pipeoff.optim._full_offload._edits import value as _value
from pipeoff.optim._full_offload._placeholder import (
    GradSlot,
    HostGrad,
    NeedsRealGradient,
    incoming_of,
    is_placeholder,
    real_of,
    slots_in,
)
from pipeoff.optim._tensors import flat, flat_like, wrap_like

if TYPE_CHECKING:
    from pipeoff.optim._full_offload._common import Accumulation
    from pipeoff.optim._full_offload._device_part import DeviceParam
    from pipeoff.optim._full_offload._fraction import FractionLifecycle
    from pipeoff.optim._full_offload._lifecycle import Lifecycle
    from pipeoff.optim._full_offload._param import OffloadedParam

__all__ = ["HostGrad", "LoopGrads", "NeedsRealGradient", "incoming_of", "is_placeholder"]

aten = torch.ops.aten

_ALIAS = (aten.detach.default, aten.alias.default)


class LoopGrads:
    """The placeholders in ``param.grad`` of one :class:`FullOffloadOptimizer`.

    It owns them: it puts them in at the end of each backward (:meth:`install`),
    takes them out (:meth:`withdraw`) and answers what the loop asks of them,
    calling down into the lifecycle for the host sums (finalizing the
    accumulation, waiting for its folds).

    Args:
        micro: the lifecycle (the accumulation in progress and its executions).
        overlap: the optimizer's overlap mode.
    """

    def __init__(self, micro: Lifecycle, overlap: str) -> None:
        # (The optimizer's lifecycle is a FractionLifecycle: the device part's calls.)
        self.micro: FractionLifecycle = micro  # type: ignore[assignment]
        self.overlap = overlap
        self.slots: dict[int, GradSlot] = {}
        """The placeholders of the accumulation in progress, by parameter position (kept
        until ``step()``: what the loop recorded on them)."""
        self.device_slots: dict[int, GradSlot] = {}
        """The device part's placeholders, by the parameter's ``id()``."""
        self.acc: Accumulation | None = None
        self.showing = False
        """Whether the placeholders are in ``param.grad`` now."""
        self.kept: tuple[Accumulation, dict[tuple[bool, int], torch.Tensor]] | None = None
        """The tensors the loop put or wrote in ``.grad`` that a read made the sums', to be
        ``.grad`` again once that read has waited for the folds (:meth:`restore_kept`)."""

    # -- in and out of param.grad --------------------------------------------------------
    def install(self, acc: Accumulation, params: Sequence[OffloadedParam]) -> None:
        """The end of a backward: a placeholder in the ``.grad`` of every parameter with a
        gradient in ``acc`` whose ``.grad`` is empty (under DDP the wrapper keeps its
        own gradients there between micro-steps)."""
        self._begin(acc)
        for i in sorted(acc.touched):
            rec = params[i]
            p = rec.param
            if p.grad is not None:
                continue
            slot = self.slots.get(i)
            if slot is None or slot.rec is not rec:
                slot = self.slots[i] = GradSlot(self, acc, i, rec)
            p.grad = slot.shown
            slot.out = True
        self.showing = self._any_out()

    def install_device(self, acc: Accumulation, recs: Sequence[DeviceParam]) -> None:
        """The end of a backward with device-part gradients: a placeholder in the ``.grad``
        of each of ``recs`` (those with a sum) whose ``.grad`` is empty."""
        self._begin(acc)
        for dev in recs:
            p = dev.param
            if p.grad is not None:
                continue
            slot = self.device_slots.get(id(p))
            if slot is None or slot.dev is not dev:
                slot = self.device_slots[id(p)] = GradSlot(
                    self, acc, -1, dev, dev)  # type: ignore[arg-type]
            p.grad = slot.shown
            slot.out = True
        self.showing = self._any_out()

    def _any_out(self) -> bool:
        return any(s.out for s in [*self.slots.values(), *self.device_slots.values()])

    def _begin(self, acc: Accumulation) -> None:
        if self.acc is not acc:
            self.slots, self.device_slots = {}, {}
            self.acc = acc
            self.kept = None

    def device_shown(self) -> frozenset[int]:
        """The ``id()`` of the device-part parameters whose ``.grad`` is (or was, until the
        next backward) their sum's placeholder."""
        return frozenset(self.device_slots)

    def clear(self) -> None:
        """Take every placeholder out and forget them (the accumulation was discarded)."""
        for slot in [*self.slots.values(), *self.device_slots.values()]:
            p = slot.rec.param
            if p.grad is not None and p.grad is slot.shown:
                p.grad = None
        self.slots, self.device_slots = {}, {}
        self.acc = None
        self.showing = False
        self.kept = None

    def edited(self) -> bool:
        """Whether the loop dropped or replaced a gradient a placeholder shows (or wrote
        through one): what :meth:`withdraw` would make the sums'."""
        return self.showing and any(
            s.out and (s.incoming is not None or s.rec.param.grad is not s.shown
                       or (s.real is not None and _written(s)))
            for s in [*self.slots.values(), *self.device_slots.values()])

    def withdraw(self, *, stepping: bool, keep: bool = False) -> dict[int, tuple[Edit, ...]]:
        """Take the placeholders out of ``.grad``, before a forward or at ``step()``
        (``stepping``), and make what the loop did to ``.grad`` the sums': a tensor
        put in ``.grad`` or written through is the gradient, ``None`` drops it (all of
        them ``None``: the accumulation is discarded, as by ``zero_grad()``). At
        ``step()``, returns the recorded edits per parameter (the step applies them)
        and forgets the placeholders. ``keep`` (a read ending the accumulation): each
        such tensor is kept for :meth:`restore_kept`.

        Raises:
            GradientError: a gradient put in ``.grad`` by hand is not of the parameter's
                shape, dtype and device; or ``.grad`` was edited after the final backward
                under ``overlap="backward"`` (that backward stepped already).
            ConfigError: the loop edited gradients and the optimizer clips too
                (``max_norm``, ``clip_grad_norm_()``).
        """
        acc = self.acc
        self.kept = None
        if acc is None:
            return {}
        if acc is not self.micro.acc:
            self.clear()  # (the accumulation ended: a failure discarded it)
            return {}
        # Each placeholder by (whether in the device part, its position or id()).
        slots = {**{(False, i): s for i, s in self.slots.items()},
                 **{(True, k): s for k, s in self.device_slots.items()}}
        out = {key: s for key, s in slots.items() if s.out}
        clips = self.micro.config.max_norm is not None or acc.max_norm is not None
        if stepping and clips and any(s.edits or s.applied for s in slots.values()):
            raise ConfigError(
                "the training loop clipped or scaled the gradients (torch.nn.utils."
                "clip_grad_norm_, clip_grad_value_, mul_) and the optimizer clips them too "
                "(max_norm, or opt.clip_grad_norm_()): they would be clipped twice; keep "
                "one (the loop's own call works under full offload)")
        held = self.micro.part.interrupt
        if self.showing:
            dropped: list[tuple[bool, int]] = []
            replaced: dict[tuple[bool, int], torch.Tensor] = {}
            arriving: dict[tuple[bool, int], torch.Tensor] = {}
            for key, slot in out.items():
                g = slot.rec.param.grad
                if slot.incoming is not None:
                    # A backward began without a forward this optimizer saw, and autograd
                    # added its gradient into the placeholder: the hook takes it next.
                    arriving[key] = slot.incoming
                elif g is not None and g is slot.shown:
                    if slot.real is not None and _written(slot):
                        replaced[key] = slot.real  # written through (a read leaves it)
                elif g is None:
                    dropped.append(key)
                else:
                    replaced[key] = local(g)
            everything = len(dropped) == len(out) and not (replaced or arriving)
            checked: dict[tuple[bool, int], torch.Tensor] = {}
            if dropped or replaced:
                self._refuse_late("set to None" if not replaced else
                                  "replaced" if not dropped else "replaced or set to None")
                if clips and not everything:
                    raise ConfigError(
                        f"param.grad of {[slots[k].rec.name for k in [*dropped, *replaced]][:4]} "
                        "was replaced, written or set to None after the backward while the "
                        "optimizer clips with max_norm (whose norm was taken before): clip in "
                        "the loop instead (torch.nn.utils.clip_grad_norm_), or leave .grad as "
                        "it is")
                checked = {k: self._checked(slots[k], t) for k, t in replaced.items()}
            # Checked: now change things. Hazard: a Ctrl-C between two placeholders
            # taken out, or before the sums are edited: a retried step() took the ones
            # gone for dropped gradients (a tester's find). Held back: step() passes it
            # on once the step is launched; elsewhere it is passed on below.
            with held.hold():
                if keep and replaced:
                    self.kept = (acc, {k: g for k in replaced
                                       if (g := slots[k].rec.param.grad) is not None})
                for key, slot in out.items():
                    p = slot.rec.param
                    p.grad = wrap_like(p, arriving[key]) if key in arriving else None
                    slot.incoming = None
                    slot.out = False
                self.showing = False
                if dropped and everything:
                    for key in dropped:
                        slots[key].dropped = True
                    self.micro.discard("every param.grad was set to None after the "
                                       "backward (model.zero_grad())", classify_final=True)
                elif dropped or replaced:
                    self._edit_sums(slots, checked, dropped)
            if not stepping:
                held.deliver("pipeoff: this Ctrl-C was held back while the gradients' "
                             "placeholders were taken out of .grad")
            if dropped and everything:
                return {}
        if not stepping:
            return {}
        with held.hold():  # (the edits returned with the slots forgotten, or neither)
            edits = {i: tuple(s.edits) for i, s in self.slots.items() if s.edits}
            self.slots, self.device_slots, self.acc = {}, {}, None
        return edits

    def restore_kept(self) -> None:
        """After a read that made the loop's tensors in ``.grad`` the sums (:meth:`withdraw`
        with ``keep``) and waited for the folds: each is ``.grad`` again, where its new
        placeholder still is. Hazard: the loop holds that tensor (a list of gradients a
        foreach clip took before the read); its next write to it (``clip_grad_value_``'s
        ``clamp_max_`` after ``clamp_min_``) reached no gradient, and the step stepped
        the sum of before (a tester's find)."""
        kept, self.kept = self.kept, None
        if kept is None or kept[0] is not self.acc:
            return
        for (dev, k), g in kept[1].items():
            slot = (self.device_slots if dev else self.slots).get(k)
            if slot is None or not slot.out or slot.real is not None:
                continue
            p = slot.rec.param
            if p.grad is slot.shown:
                slot.real, slot.shown = local(g), g
                p.grad = g  # (its values are the sum's now: written again, it is replaced)

    def _edit_sums(self, slots: dict[tuple[bool, int], GradSlot],
                   replaced: dict[tuple[bool, int], torch.Tensor],
                   dropped: list[tuple[bool, int]]) -> None:
        """Make the gradients the loop replaced or dropped the sums' (each part's), and
        forget their placeholders."""
        host_r = {k: t for (dev, k), t in replaced.items() if not dev}
        host_d = [k for dev, k in dropped if not dev]
        if host_r or host_d:
            self.micro.edit_sums(host_r, host_d)
        dev_r = {slots[key].dev: t for key, t in replaced.items() if key[0]}
        dev_d = [slots[key].dev for key in dropped if key[0]]
        if dev_r or dev_d:
            self.micro.edit_device_sums(dev_r, dev_d)  # type: ignore[arg-type]
        for dev, k in [*dropped, *replaced]:
            (self.device_slots if dev else self.slots).pop(k)

    def _refuse_late(self, what: str) -> None:
        acc = self.micro.acc
        if self.overlap == "backward" and acc is not None and acc.final is not None:
            raise GradientError(
                f"param.grad was {what} after the final backward under overlap='backward', "
                "whose chunks stepped during that backward: the edit cannot reach the "
                "step; use overlap='forward' (the default) to edit gradients before step()")

    @staticmethod
    def _checked(slot: GradSlot, t: torch.Tensor) -> torch.Tensor:
        rec = slot.rec
        p = local(rec.param)
        if isinstance(t, HostGrad):
            raise GradientError(
                f"param.grad of {rec.name!r} was set by hand to the .grad FullOffloadOptimizer "
                f"shows for {t._slot.rec.name!r} (a placeholder: that gradient's values are "
                "on the host); give it a tensor of its own, e.g. that .grad's clone()")
        if (t.shape != p.shape or t.dtype != p.dtype or t.device != p.device
                or t.layout != torch.strided):
            raise GradientError(
                f"param.grad of {rec.name!r} was set by hand to a tensor of shape "
                f"{tuple(t.shape)}, {t.dtype} on {t.device}; FullOffloadOptimizer takes a "
                f"gradient of the parameter's shape {tuple(p.shape)}, dtype {p.dtype} and "
                f"device {p.device}")
        return t if slot.dev is not None else flat_like(t, rec.order)

    # -- what the loop asks of a placeholder --------------------------------------------------
    def dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """One aten operation with a placeholder among its arguments."""
        if any(s.real is not None for s in slots_in(args, kwargs)):
            return func(*real_of(args), **{k: real_of(v) for k, v in kwargs.items()})
        if func in _ALIAS or (func is aten.view.default and _same_shape(args[0], args[1])):
            return _slot_of(args[0]).alias()
        if func is aten.linalg_vector_norm.default:
            return self.norm(_slot_of(args[0]), *args[1:], **kwargs)
        if func is aten._foreach_norm.Scalar:
            ord_ = args[1] if len(args) > 1 else kwargs.get("ord", 2)
            dtype = args[2] if len(args) > 2 else kwargs.get("dtype")
            return [t._slot.loop_grads().norm(t._slot, ord_, dtype=dtype)
                    if isinstance(t, HostGrad)
                    else torch.linalg.vector_norm(t, ord_, dtype=dtype) for t in args[0]]
        if func in _SCALE:
            self.edit(_slot_of(args[0]), (_SCALE[func], _value(args[1], _SCALE[func])))
            return args[0]
        if func in _FOREACH_SCALE:
            self._foreach(args, _FOREACH_SCALE[func], func)
            return None
        if func in _FOREACH_CLAMP:
            self._foreach(args, _FOREACH_CLAMP[func], func)
            return None
        if func in (aten.clamp_.default, aten.clamp_.Tensor):
            lo = args[1] if len(args) > 1 else kwargs.get("min")
            hi = args[2] if len(args) > 2 else kwargs.get("max")
            self.edit(_slot_of(args[0]), ("clamp", None if lo is None else _value(lo, "clamp_"),
                                          None if hi is None else _value(hi, "clamp_")))
            return args[0]
        if func in (aten.clamp_min_.default, aten.clamp_max_.default,
                    aten.clamp_min_.Tensor, aten.clamp_max_.Tensor):
            kind = "clamp_min" if "min" in func.__name__ else "clamp_max"
            self.edit(_slot_of(args[0]), (kind, _value(args[1], func.__name__)))
            return args[0]
        if func is aten.zero_.default:
            self.edit(_slot_of(args[0]), ("zero",))
            return args[0]
        if func.overloadpacket is aten.set_:
            # ``grad.set_(t)`` (torch gives it no __torch_function__): the real gradient,
            # ``param.grad`` from now on, takes ``t`` (a tester's find: it raised).
            slot = _slot_of(args[0])
            func(self.materialize(slot), *real_of(tuple(args[1:])), **kwargs)
            return args[0]
        if (func is aten.add_.Tensor and _compat.backward_id() >= 0
                and isinstance(args[0], HostGrad)):
            # Autograd accumulating a new gradient into the placeholder (a backward whose
            # forward the optimizer did not see): keep it for the parameter's hook.
            slot = args[0]._slot
            if slot.incoming is not None or isinstance(args[1], HostGrad):
                raise GradientError(f"a second gradient for {slot.rec.name!r} in one backward")
            slot.incoming = args[1]
            return args[0]
        return self._on_real(func, args, kwargs)

    def _foreach(self, args: tuple[Any, ...], kind: str, func: Any) -> None:
        tensors, operand = args[0], args[1]
        listed = isinstance(operand, (list, tuple))
        operands = list(operand) if listed else [operand] * len(tensors)
        # Every operand first: one that needs the gradients' values raises before any
        # edit (a device-part edit is applied at once: it would be taken twice).
        values = [_value(v, func.__name__) if isinstance(t, HostGrad) else v
                  for t, v in zip(tensors, operands)]
        for t, v in zip(tensors, values):
            if isinstance(t, HostGrad):  # (by its own optimizer's LoopGrads)
                t._slot.loop_grads().edit(t._slot, (kind, v))
        plain = [(t, v) for t, v in zip(tensors, values) if not isinstance(t, HostGrad)]
        if plain:
            # The real gradients among them (a clip call over this optimizer's parameters
            # and others'): the same op on those, with their own operands.
            func([t for t, _ in plain], [v for _, v in plain] if listed else operand)

    def _on_real(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        names = sorted({s.rec.name for s in slots_in(args, kwargs)})
        raise NeedsRealGradient(
            f"{func} on the gradient of {names} needs its values, and it reached "
            "FullOffloadOptimizer's placeholder where the real gradient cannot be put "
            "in its place (a DTensor parameter's placeholder, or C++ code such as DDP's "
            "reducer writing .grad): there the placeholder answers norms "
            "(torch.linalg.vector_norm, clip_grad_norm_) and in-place scaling only")

    # -- the host sums ------------------------------------------------------------------------
    def _ready(self, slot: GradSlot, what: str) -> Accumulation:
        """The accumulation ``slot`` stands for, ended and its folds finished."""
        micro = self.micro
        if slot.dropped:  # (set to None with every other .grad: the accumulation discarded)
            raise GradientError(f"this gradient of {slot.rec.name!r} was set to None in .grad "
                                "with every other one: its values are gone")
        if slot.acc is not micro.acc or slot.rec is not self._rec_now(slot):
            raise GradientError(
                f"this gradient of {slot.rec.name!r} belongs to a step already taken or "
                "discarded (a placeholder kept across step() or zero_grad()); read "
                "param.grad again after the next backward")
        if _compat.backward_id() >= 0:
            raise GradientError(
                f"{what} the host gradient of {slot.rec.name!r} inside a backward (a hook, or "
                "a DDP reducer that ran without the model's forward): under "
                "FullOffloadOptimizer the gradient is read after the backward")
        if _faults.disabled("grad_read_wait"):
            micro.finalize()
            return slot.acc
        # Hazard: reading a host sum (or the norm the final fold takes of it) that
        # the accumulate lane is still folding gradients into.
        if micro.current_norm(f"{what} param.grad" if what != "reading" else
                              "param.grad was read") is None:
            steps = micro.config.gradient_accumulation_steps
            counted = "" if steps is None else (
                f" (gradient_accumulation_steps={steps}: backward {steps} of the step; a "
                "step of fewer backwards is ended by step(), and its gradients read after it "
                "are the next step's)")
            raise GradientError(
                f"{what} the gradient of {slot.rec.name!r} before the final backward under "
                f"overlap='backward': its sum is known once that backward has run{counted}")
        if what != "scaling" and not self._current(slot):
            # (A tester's find: a sum dropped or replaced since (the read above took the
            # edit in) was read as garbage, or raised deep inside.)
            raise GradientError(
                f"this gradient of {slot.rec.name!r} was dropped or replaced in .grad "
                "(param.grad = None, or = t) after it was taken from there, and its host "
                "sum with it: its values are gone; read param.grad instead")
        return slot.acc

    def _current(self, slot: GradSlot) -> bool:
        """Whether ``slot`` still stands for its parameter's gradient sum (not dropped or
        replaced in ``.grad`` since)."""
        if slot.dev is not None:
            return self.device_slots.get(id(slot.rec.param)) is slot
        return self.slots.get(slot.i) is slot

    def _rec_now(self, slot: GradSlot) -> Any:
        if slot.dev is not None:
            return slot.rec if self.micro.part.owns(slot.dev.param) is slot.dev else None
        return slot.rec if slot.i < len(self.micro.registry) and (
            self.micro.registry[slot.i] is slot.rec) else None

    def norm(self, slot: GradSlot, ord: Any = 2, dim: Any = None, keepdim: bool = False,
             *, dtype: Any = None) -> torch.Tensor:
        """``torch.linalg.vector_norm`` of the gradient's host sum (edits applied), on the
        parameter's device."""
        if slot.real is not None:
            real: torch.Tensor = torch.linalg.vector_norm(slot.real, ord, dim, keepdim,
                                                          dtype=dtype)
            return real
        acc = self._ready(slot, "the norm of")
        if slot.dev is not None:
            return self.micro.part.norm_of(slot.dev, ord, dim, keepdim, dtype=dtype)
        rec = slot.rec
        device = local(rec.param).device
        if (not slot.edits and not slot.applied and dim is None and not keepdim
                and float(ord) == 2.0 and dtype in (None, torch.float32)
                and slot.i in acc.results.norms):
            out = acc.results.norms[slot.i]  # taken in the final fold, while the sum was hot
        else:
            self._apply_now(slot)
            out = torch.linalg.vector_norm(rec.acc, ord, dim, keepdim, dtype=dtype)
        return out.to(device, copy=True)

    def edit(self, slot: GradSlot, e: Edit) -> None:
        """Record an in-place operation for the step (or apply it to the real gradient).

        Raises:
            ConfigError: under ``overlap="backward"`` (the chunks step during the final
                backward, before the loop's edit).
        """
        if slot.real is not None:
            t = slot.real
            apply_edits(t, [e])
            return
        if slot.dropped:
            return  # (no longer in .grad, its sum discarded: it reaches nothing, as torch's)
        if e[0] in ("mul", "div") and _is_one(e[1]):
            # x * 1.0 is x: a clip call under its max_norm (or with max_norm=inf, as
            # the HF Trainer asks for the norm to log it) changes nothing.
            self._ready(slot, "scaling")
            return
        if self.overlap == "backward":
            raise ConfigError(
                f"the training loop scales or clips the gradient of {slot.rec.name!r} "
                "(torch.nn.utils.clip_grad_norm_, clip_grad_value_, mul_) but "
                "FullOffloadOptimizer(overlap='backward') steps during the final backward, "
                "before the loop's call: use overlap='forward' (the default), under which "
                "the clipping happens in the step (a clip whose coefficient is 1, under "
                "its max_norm, changes nothing and passes; a clamp, whatever its bound, "
                "does not)")
        self._ready(slot, "scaling")
        if not self._current(slot):
            return  # (no longer in .grad: it reaches nothing, as torch's edit of it)
        if slot.dev is not None:
            self.micro.part.scale(slot.dev, [e])  # (its sum is in device memory: now)
            slot.applied = True
            return
        slot.edits.append(e)

    def _apply_now(self, slot: GradSlot) -> None:
        """Apply the recorded edits to the host sum on this thread (a read needs them)."""
        if slot.edits:
            apply_edits(flat(slot.rec.acc, slot.rec.order), slot.edits)
            slot.edits = []
            slot.applied = True

    def materialize(self, slot: GradSlot) -> torch.Tensor:
        """The gradient on the device, in the parameter's dtype, as ``param.grad`` from now
        on (its writes are the gradient ``step()`` takes)."""
        if slot.real is not None:
            return slot.real
        self._ready(slot, "reading")
        self._apply_now(slot)
        rec = slot.rec
        p = rec.param
        loc = local(p)
        real = torch.empty_like(loc, memory_format=torch.preserve_format)
        with torch.no_grad():
            if slot.dev is not None:
                real.copy_(slot.dev.sum)  # type: ignore[arg-type]
            else:
                flat(real, rec.order).copy_(rec.flat_acc)
        slot.real = real
        shown = wrap_like(p, real)
        if p.grad is slot.shown:
            p.grad = shown
        slot.shown = shown
        return real


def _written(slot: GradSlot) -> bool:
    """Whether the loop wrote ``slot.real`` (the real gradient a read made): its values are
    no longer the sum's cast they were made as.

    By values alone, not the version counter: torch bumps none for an in-place foreach
    op under a ``TorchDispatchMode`` (``FlopCounterMode`` around the loop's clip), whose
    write the step missed (a tester's find); and a write that changes no bit (the clip's
    multiply by 1.0 under its threshold, or by a coefficient too close to 1 for a BF16
    gradient) would otherwise step the cast where the same loop under a mode steps the
    FP32 sum (another tester's find). Such a write leaves the FP32 sum to step."""
    real = slot.real
    assert real is not None
    with torch.no_grad():
        if slot.dev is not None:
            return slot.dev.sum is None or not _same_bits(real, slot.dev.sum.to(real.dtype))
        acc = slot.rec.flat_acc
        return not _same_bits(flat(real, slot.rec.order).to(acc.device), acc.to(real.dtype))


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, a NaN equal to any NaN: a read of a NaN gradient is not a write (a NaN
    never equals itself, and a cast on the device may give another NaN payload than
    the host's)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    a, b = a.contiguous(), b.contiguous()
    same = a.view(ints) == b.view(ints)
    if a.is_floating_point():
        same |= a.isnan() & b.isnan()
    return bool(same.all())


def _is_one(v: Any) -> bool:
    return bool(v == 1.0) if isinstance(v, (int, float, torch.Tensor)) else False


def _slot_of(t: Any) -> GradSlot:
    assert isinstance(t, HostGrad)
    return t._slot


def _same_shape(t: Any, shape: Any) -> bool:
    return isinstance(t, HostGrad) and list(shape) == list(t.shape)

