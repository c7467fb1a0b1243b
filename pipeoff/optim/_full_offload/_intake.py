"""Full offload's gradient intake: the hooks autograd calls, whose backward a gradient
belongs to, and the wrapper policy (DDP, FSDP2, ``no_sync()``: is this backward the
final one?).

:class:`GradientIntake` admits a gradient (the owner, the backward, a dense tensor
of the parameter's dtype) and hands it down to the :class:`Lifecycle`, which
routes it into a micro-step. It calls down only: the model sync
(``_model_sync.py``) at a step's first gradient, then the lifecycle.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from pipeoff import _compat
from pipeoff._contract import Health
from pipeoff._errors import ConfigError, GradientError
from pipeoff._inert import InertHook, inert
from pipeoff.optim._full_offload._common import checked_gradient
from pipeoff.optim._full_offload._config import refuse_environment
from pipeoff.optim._full_offload._fraction import FractionLifecycle
from pipeoff.optim._full_offload._model_sync import ModelSync

__all__ = ["GradientIntake"]

_OWNERS: Any = WeakIdKeyDictionary()  # (torch's: keyed by identity, not tensor equality)
"""Per parameter, the intake (of the newest optimizer over it) that takes its
gradients: an optimizer built to resume from another's ``state_dict()`` on the
same model takes them over, and the old one's hooks let them be."""


class _GradHook:
    """A parameter's post-accumulate-grad hook: :meth:`GradientIntake.on_grad` while the
    optimizer lives. It holds it weakly, so that a deleted optimizer lets go of the
    model's gradients (its hooks are removed when it is collected)."""

    def __init__(self, intake: GradientIntake) -> None:
        self.ref = weakref.ref(intake)

    def __call__(self, p: torch.Tensor) -> None:
        intake = self.ref()
        if intake is not None:
            intake.on_grad(p)


def hook_refusal(p: torch.Tensor, later_backward: bool, intake: Any) -> str | None:
    """Why a post-accumulate-grad hook of the loop's own on ``p`` sees the wrong gradient,
    or ``None``: one that runs after ``intake``'s sees ``None`` (the gradient is taken);
    one before it sees this backward's gradient alone, which is torch's accumulated
    ``.grad`` only in an accumulation's first backward (``later_backward``: not it). An
    older optimizer's hook (it takes nothing now) is neither."""
    ours = False
    for h in _compat.post_accumulate_grad_hooks(p):
        if isinstance(h, _GradHook):
            ours = ours or h.ref() is intake
        elif ours:
            return "runs after full offload's own, which took the gradient: it sees None"
        elif later_backward:
            return ("runs before full offload's own, in a backward after the first of an "
                    "accumulation: it sees that backward's gradient alone")
    return None


def _hook_refused(name: str, why: str) -> ConfigError:
    return ConfigError(
        f"parameter {name!r} has a post-accumulate-grad hook of the loop's own "
        f"(register_post_accumulate_grad_hook) that {why}, never the accumulated .grad "
        "torch's hook sees (full offload takes each gradient off the device in its own "
        "hook); do that work between the backward and step(), where param.grad holds the "
        "sum (clip_grad_value_, clip_grad_norm_ work there), or remove the hook")


def _remove_hooks(handles: dict[int, Any], probe: list[Any]) -> None:
    for handle in list(handles.values()) + probe:
        handle.remove()
    handles.clear()


class _WrapperProbe:
    """The model's forward pre-hook that notices a DDP wrapper (:meth:`GradientIntake.see_wrapper`).
    A copy of the model (``copy.deepcopy``, an EMA) shares it instead of copying the
    optimizer; the copy's forward is no business of it (the wrapper is checked to
    wrap the very module)."""

    def __init__(self, intake: GradientIntake) -> None:
        self.ref = weakref.ref(intake)

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        _opaque_probe()(self, module)

    def __deepcopy__(self, memo: dict[int, Any]) -> _WrapperProbe:
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled (torch.save(model)): the copy belongs to no optimizer.
        return (inert, ())


class _StateDictTaken:
    """The model's state-dict post-hook: under FSDP2 the tensors ``state_dict()`` hands
    out share no version counter with the parameters (DTensor's ``detach()``), so a
    write through them (DCP loading in place, ``.to_local().copy_()``) is seen by
    content instead, at the next step (:meth:`ModelSync.note_state_dict`). Shared by a
    copy of the model, as :class:`_WrapperProbe` is, and checked to be the model's."""

    def __init__(self, intake: GradientIntake) -> None:
        self.ref = weakref.ref(intake)

    def __call__(self, module: torch.nn.Module, *args: Any) -> None:
        intake = self.ref()
        if intake is not None and intake.registry.model is module:
            intake.model_sync.note_state_dict()

    def __deepcopy__(self, memo: dict[int, Any]) -> _StateDictTaken:
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (inert, ())


def _probe(probe: _WrapperProbe, module: torch.nn.Module) -> None:
    intake = probe.ref()
    if intake is None or intake.registry.model is not module:
        return
    intake.see_wrapper(module)
    life = intake.lifecycle
    if life.config.overlap == "backward" and life.acc is not None and (
            life.acc.final is not None):
        # Hazard: a forward before step() reading (autograd saving) the weights the final
        # backward's chunks still write: stale bits, or autograd's version error later.
        life.settle_final_backward()
    grads = life.grads
    if torch.is_grad_enabled() and grads.showing:
        # The next micro-step's forward: the placeholders leave .grad before autograd
        # (or a DDP reducer) would accumulate into them.
        grads.withdraw(stepping=False)


_OPAQUE_PROBE: Any = None


def _opaque_probe() -> Any:
    # Opaque to Dynamo: under torch.compile it runs eagerly at every forward.
    global _OPAQUE_PROBE
    if _OPAQUE_PROBE is None:
        _OPAQUE_PROBE = _compat.dynamo_disable(_probe)
    return _OPAQUE_PROBE


# (The names models pickled by pipeoff before 2026-12-06 hold.)
_inert_probe, _InertProbe = inert, InertHook


class GradientIntake:
    """The hooks on the model's parameters and the policy that says which backward a
    gradient belongs to.

    Args:
        lifecycle: where admitted gradients go.
        model_sync: called at the first gradient of a step, before it is taken in
            (``param_groups`` followed, outside writes adopted).
    """

    def __init__(self, lifecycle: FractionLifecycle, model_sync: ModelSync) -> None:
        self.lifecycle = lifecycle
        self.model_sync = model_sync
        self.registry = lifecycle.registry
        self.no_sync_depth = 0
        """Open ``opt.no_sync()`` blocks: backwards inside are non-final."""
        self._wrapper_probe: Any = None
        self.grad_hooks: dict[int, Any] = {}
        """The post-accumulate-grad hook of each of the model's parameters, by ``id()``."""
        self._probe_handles: list[Any] = []
        self.had_grad: set[int] = set()
        """The parameters (by ``id()``) whose ``.grad`` torch held at the last ``step()``
        (and keeps after it): ``zero_grad(set_to_none=False)`` zeroes those."""
        self.frozen_at_build: set[int] = set()
        """The parameters (by ``id()``) the model form left out as frozen, not yet warned
        about (see :meth:`trainable_of`)."""
        self.delivered: set[int] = set()
        """The parameters (by ``id()``) a backward's gradient reached since the last
        ``step()`` or ``zero_grad()`` (taken in, so ``.grad`` may not show it)."""
        weakref.finalize(self, _remove_hooks, self.grad_hooks, self._probe_handles)

    def ensure_hooks(self) -> None:
        """A post-accumulate-grad hook on every parameter of the model, once.

        Hooks stay: a parameter removed from ``param_groups`` is ignored by its
        hook (its gradient stays in ``.grad``, as with torch), and one added back,
        or unfrozen, is taken in at once. (A hook registered for the first time
        during a backward does not fire in it: in-place edits are noticed at the
        first gradient of the next backward.) A frozen parameter gets its hook
        with ``requires_grad`` switched on for the call.
        """
        model = self.registry.model
        if self._wrapper_probe is None and model is not None:
            self._wrapper_probe = model.register_forward_pre_hook(_WrapperProbe(self))
            self._probe_handles.append(self._wrapper_probe)
            self._probe_handles.append(
                model.register_state_dict_post_hook(_StateDictTaken(self)))
            if self.lifecycle.ddp is None:
                self.lifecycle.use_wrapper(_compat.data_parallel(model))
        taken = []
        part = self.lifecycle.part
        for rec in [*self.registry, *part.params.values()]:
            before = _OWNERS.get(rec.param)
            owner = before() if before is not None else None
            if owner is not None and owner is not self:
                taken.append(rec.name)
            _OWNERS[rec.param] = weakref.ref(self)
        if taken:
            warnings.warn(
                f"FullOffloadOptimizer: parameter(s) {taken[:4]}{'...' if len(taken) > 4 else ''} "
                "belonged to another FullOffloadOptimizer, which no longer receives their "
                "gradients (the newest optimizer of a parameter takes them; load the old "
                "one's state_dict() into this one to resume)", RuntimeWarning, stacklevel=4)
        for p in (model.parameters() if model is not None
                  else [*self.registry.tensors(), *part.tensors()]):
            if id(p) in self.grad_hooks:
                continue
            frozen = not p.requires_grad
            if frozen:
                p.requires_grad_(True)
            try:
                self.grad_hooks[id(p)] = p.register_post_accumulate_grad_hook(_GradHook(self))
            finally:
                if frozen:
                    p.requires_grad_(False)

    def see_wrapper(self, module: torch.nn.Module) -> None:
        """The model's forward begins: a ``DistributedDataParallel`` put around the model
        after the optimizer was built (as ``accelerate.prepare`` does) may run it."""
        if self.lifecycle.ddp is None:
            ddp = _compat.active_data_parallel()
            if ddp is not None and any(q is module for q in ddp.modules()):
                self.lifecycle.use_wrapper(ddp)

    def trainable_of(self, model: torch.nn.Module | None) -> list[torch.Tensor]:
        """The model form's default parameters: those of ``model`` that require grad. The
        frozen ones are remembered: one that gets a gradient later (unfrozen after a
        warm-up) is in no group, where torch's ``AdamW(model.parameters())`` would step
        it; a warning says so (a tester's find: it was left in ``.grad``, silently)."""
        assert model is not None
        params = list(model.parameters())
        self.frozen_at_build = {id(p) for p in params if not p.requires_grad}
        return [p for p in params if p.requires_grad]

    def explicitly_non_final(self) -> bool:
        """Whether this backward is marked non-final: ``no_sync()``, or the wrapper does
        not reduce gradients in it (FSDP2's ``set_requires_gradient_sync(False)``,
        DDP's ``no_sync()``)."""
        if self.no_sync_depth > 0:
            return True
        model = self.registry.model
        if model is not None and _compat.fsdp_gradient_sync(
                _compat.compiled_original(model)) is False:
            return True
        ddp = self.lifecycle.ddp
        return ddp is not None and not _compat.ddp_gradient_sync(ddp)

    def on_grad(self, p: torch.Tensor) -> None:
        """The post-accumulate-grad hook of every parameter: admit the gradient and hand
        it to the lifecycle (under DDP, leave it to the wrapper: the end of the backward
        takes it)."""
        owner = _OWNERS.get(p)
        if owner is None and id(p) in self.frozen_at_build:
            self.frozen_at_build.discard(id(p))
            warnings.warn(
                f"FullOffloadOptimizer: parameter {self.registry.name_of(p)!r} was frozen "
                "when the optimizer was built from the model, so it is in no param group: "
                "its gradient stays in .grad and nothing steps it (torch's AdamW("
                "model.parameters()) would); add it with opt.add_param_group({'params': "
                "[p]}), or build with params=list(model.parameters())",
                RuntimeWarning, stacklevel=2)
        if owner is None or owner() is not self:
            return  # another (newer) optimizer's parameter, or none's
        if _compat.compiled_autograd_active():  # (turned on after the constructor's check)
            refuse_environment()
        # (This parameter's gradient came in an earlier backward of the step: either part.)
        why = hook_refusal(p, id(p) in self.delivered, self)
        if why is not None:  # (a tester's find: such hooks saw None, silently)
            i = self.registry.position(p)
            rec = self.registry[i] if i is not None else self.lifecycle.part.owns(p)
            raise _hook_refused(rec.name if rec is not None else "?", why)
        lifecycle = self.lifecycle
        if lifecycle.grads.showing:
            # A backward whose forward this optimizer did not see (a submodule called
            # alone): the placeholders leave .grad now; what autograd added into this
            # one is its gradient.
            try:
                lifecycle.grads.withdraw(stepping=False)
            except Exception as err:
                # (what the loop put in .grad was refused, mid-backward: this step's
                # gradients are incomplete; step() refuses until zero_grad())
                lifecycle.fail_current(err)
                raise
        if lifecycle.acc is None and lifecycle.micro is None:
            if self.model_sync.sync():  # the first gradient of a step
                self.ensure_hooks()  # parameters added to param_groups in place
        elif (lifecycle.config.overlap == "backward" and lifecycle.acc is not None
              and lifecycle.acc.final is None
              and (lifecycle.micro is None or lifecycle.micro.ended)):
            # A later backward of the step, which may be the final one, whose chunks
            # step from the masters during it: weights written since the last backward
            # are adopted first (a tester found them refused at step() as late).
            self.model_sync.adopt_outside_writes()
        i = self.registry.position(p)
        dev = lifecycle.part.owns(p) if i is None else None
        if i is None and (dev is None or not lifecycle.part.listed(p)):
            return  # (removed from param_groups: its gradient stays, as torch leaves it)
        name = self.registry[i].name if i is not None else dev.name  # type: ignore[union-attr]
        grad = p.grad
        if grad is None:
            return
        self.delivered.add(id(p))
        if _compat.backward_id() < 0:
            raise GradientError(
                f"a gradient for {name!r} reached FullOffloadOptimizer outside a backward "
                "(a post-accumulate-grad hook called by hand?): gradients are taken in "
                "only from loss.backward()")
        health = lifecycle.health
        if health.stale is not None and health.dirty is None:
            # Hazard: gradients of the stale weights stepping the masters (a final
            # backward under overlap="backward" stepped them at once: a tester's find,
            # 1.7e-2 off; or a step() after refresh_device_weights()).
            health.dirty = GradientError(
                f"the gradient of {name!r} came from a backward on the stale device "
                "weights (a failed copy; refresh_device_weights() was not called first)")
        marked = self.explicitly_non_final  # asked when a micro-step begins
        if dev is not None:
            lifecycle.receive_device(dev, marked=marked)
            return
        assert i is not None
        if lifecycle.ddp is not None:
            lifecycle.receive_reduced_later(i, marked=marked)
            return
        try:
            payload = checked_gradient(self.registry[i], grad)
        except GradientError as err:
            lifecycle.fail_current(err)
            raise
        if lifecycle.health.dirty is not None or lifecycle.health.torn is not None:
            p.grad = None  # dropped: step() refuses until zero_grad()
            return
        lifecycle.receive(i, payload, marked=marked)


def _params(intake: GradientIntake) -> list[torch.Tensor]:
    """The host part's parameters and the device part's in ``param_groups``."""
    part = intake.lifecycle.part
    return [*(rec.param for rec in intake.registry),
            *(q for q in part.tensors() if part.listed(q))]


def present(intake: GradientIntake) -> set[int]:
    """The parameters (by ``id()``) whose ``.grad`` torch would hold now, past the last
    step: a ``.grad`` (a placeholder, one set by hand, the zeros below), or a gradient
    taken in that no placeholder shows (one shown and set to ``None`` is dropped): from
    a backward, or set by hand and taken into a sum early (a clip's norm)."""
    life = intake.lifecycle
    shown = {id(s.rec.param) for s in life.grads.slots.values()} | set(life.grads.device_slots)
    taken = {id(rec.param) for rec in life.part.params.values() if rec.sum is not None}
    if life.acc is not None:
        taken |= {id(intake.registry[i].param) for i in life.acc.touched}
    return ({id(p) for p in _params(intake) if p.grad is not None}
            | ((intake.delivered | taken) - shown))


def at_step(intake: GradientIntake) -> None:
    """``step()`` begins (before the placeholders are withdrawn): the model's changes
    followed, and the parameters torch steps (and whose ``.grad`` it keeps) noted."""
    if intake.model_sync.sync():
        intake.ensure_hooks()  # parameters added to param_groups in place
    intake.had_grad, intake.delivered = present(intake), set()


def zero_grads(intake: GradientIntake, held: set[int], set_to_none: bool) -> None:
    """``zero_grad()``'s ``.grad``: ``None``; or, with ``set_to_none=False``, a zero
    tensor for each of ``held`` (:func:`present` before the micro-steps were discarded,
    and what the last ``step()`` kept), which the next backward accumulates into and
    ``step()`` takes like a gradient set by hand.

    Hazard: a parameter that then gets no gradient (an unused branch, an expert not
    routed to) left unstepped, where torch steps it with a zero gradient (momentum
    decay, weight decay, the step count)."""
    intake.had_grad = set() if set_to_none else held | intake.had_grad
    intake.delivered = set()
    for p in _params(intake):
        p.grad = None if set_to_none or id(p) not in held else torch.zeros_like(p)


@contextlib.contextmanager
def refuse_if_torn(health: Health, what: str) -> Iterator[None]:
    """Raise :class:`~pipeoff.StepFailedError` at the end of the block if the block tore
    the step (``zero_grad()`` abandoning a final backward whose chunks had stepped).

    Hazard: the loop training on, quietly, on weights a failed final backward had
    partly stepped (``step()`` refused only after the next forward and backward)."""
    before = health.torn
    yield
    if before is None and health.torn is not None:
        health.check(what, stale=False)
