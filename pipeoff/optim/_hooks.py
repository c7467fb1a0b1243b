"""Forward hooks: before a module's forward, wait only for the chunks its forward reads.

On FSDP2 each FSDP module gets a ``prepend=True`` pre-forward hook (so it runs
before FSDP's own, which issues the all-gathers). It waits for the chunks of
the module's own parameters and of the modules it prefetches, whose
all-gathers FSDP issues inside this module's pre-forward. On a plain module
tree each module that owns parameters gets a hook for its own parameters, and
so does the attached root. Every hook also waits for the parameters that its
module's forward was seen to read without calling their module
(:class:`~pipeoff.optim._waits.ForwardWaits` learns them).

Hooks are opaque to Dynamo (``torch.compiler.disable``): under ``torch.compile``
they run, eagerly, at every call, exactly where an eager forward would run
them. torch.distributed is imported only when the model is an FSDP2 model.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch

from pipeoff import _accel, _compat, _faults
from pipeoff._inert import InertHook, inert
from pipeoff.optim._waits import ForwardWaits

__all__ = ["install", "set_post_optim_event", "unwrap"]


def _fsdp_module_type() -> type[torch.nn.Module] | None:
    if "torch.distributed.fsdp" not in sys.modules and not torch.distributed.is_available():
        return None
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch built without distributed
        return None
    return FSDPModule  # type: ignore[return-value]  # a mixin of nn.Module subclasses


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module a ``torch.compile`` wrapper (``OptimizedModule``) compiles, else ``model``."""
    return _compat.compiled_original(model)


def install(waits: ForwardWaits, model: torch.nn.Module,
            params: Sequence[torch.Tensor], *, reads_grads: bool = True) -> list[Any]:
    """Install the forward waits of ``params`` on ``model``; returns the hook handles.
    ``reads_grads=False``: the steps waited for never read the parameters' gradients
    (DiLoCo's write-back), so no backward waits for them (no hook at the forward's
    end: under ``torch.compile``, no graph break there).

    Every handle is registered or none is (a failure removes those already in).
    """
    root = unwrap(model)
    fsdp = _fsdp_module_type()
    names = {m: _compat.uncompiled_name(n) or type(root).__name__ for n, m in root.named_modules()}
    plan: list[tuple[torch.nn.Module, Any, bool]] = []  # (module, hook, with_kwargs)
    plain = {id(p) for p in params}
    if fsdp is not None and any(isinstance(m, fsdp) for m in root.modules()):
        fsdp_modules = [m for m in root.modules() if isinstance(m, fsdp)]
        plan += [(m, _ForwardWait(waits, names[m], fsdp=True), True) for m in fsdp_modules]
        # Parameters no FSDP module manages (a plain head outside every
        # fully_shard unit, under a root that is not sharded) get plain hooks.
        managed = {id(p) for m in fsdp_modules
                   for p in _compat.fsdp_sharded_params(_compat.fsdp_state(m))}
        plain -= managed
    hooked = {m for m, _, _ in plan}
    for m in root.modules():
        if m in hooked:
            continue
        if m is root or any(id(p) in plain for p in m.parameters(recurse=False)):
            plan.append((m, _ForwardWait(waits, names[m], fsdp=False), False))
    handles: list[Any] = []
    try:
        for m, hook, kw in plan:
            handles.append(m.register_forward_pre_hook(hook, prepend=True, with_kwargs=kw))
        # Hazard: the backward after this forward writing gradients in a bucket
        # (DDP's gradient_as_bucket_view) that the step in flight still reads; the
        # read guard sees a backward call, but it may be off (read_guard=False).
        if reads_grads:
            handles.append(root.register_forward_hook(_BeforeBackward(waits)))
        # Hazard: code torch.compile traced before these hooks existed (a warm-up
        # forward) keeps running without them, reading parameters that a step is
        # still writing.
        _compat.recompile_with_hooks(root.modules())
    except BaseException:
        for h in handles:
            h.remove()
        raise
    waits.set_modules(root, [m for m, _, _ in plan])
    return handles




class _ForwardWait:
    """A forward pre-hook waiting for the chunks a module's forward reads.

    ``__call__`` is traced by Dynamo, and calls the wait through a function
    opaque to it (a graph break), so compiled code runs the wait at every call.
    A model pickled or deep-copied with these hooks gets inert ones: the copy is
    not attached to this optimizer.
    """

    __slots__ = ("fsdp", "name", "waits")

    def __init__(self, waits: ForwardWaits, name: str, fsdp: bool) -> None:
        self.waits = waits
        self.name = name
        self.fsdp = fsdp

    def __call__(self, module: torch.nn.Module, args: Any, kwargs: Any = None) -> None:
        _opaque_wait()(self, module)

    def __reduce__(self) -> tuple[Any, ...]:
        return (inert, ())


class _BeforeBackward:
    """A forward hook on the root: a backward may follow a forward under grad mode
    (:meth:`~pipeoff.optim._waits.ForwardWaits.before_backward`)."""

    __slots__ = ("waits",)

    def __init__(self, waits: ForwardWaits) -> None:
        self.waits = waits

    def __call__(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        _opaque("before_backward", _before_backward)(self.waits)

    def __reduce__(self) -> tuple[Any, ...]:
        return (inert, ())


# (The names models pickled by pipeoff before 2026-12-06 hold.)
_inert_hook, _Inert = inert, InertHook


_OPAQUE: dict[str, Any] = {}


def _opaque(name: str, fn: Any) -> Any:
    """``fn`` opaque to Dynamo (a graph break), wrapped once."""
    out = _OPAQUE.get(name)
    if out is None:
        out = _OPAQUE[name] = _compat.dynamo_disable(fn)
    return out


def _opaque_wait() -> Any:
    return _opaque("wait", _wait)


def _before_backward(waits: ForwardWaits) -> None:
    if torch.is_grad_enabled():
        waits.before_backward()


def _wait(hook: _ForwardWait, module: torch.nn.Module) -> None:
    if hook.fsdp:
        _fsdp_wait(hook.waits, module, hook.name)
    else:
        hook.waits.on_module(module, module.parameters(recurse=False), hook.name)


# What a Dynamo error names when a fullgraph=True region contains a forward wait.
_wait.__qualname__ = _wait.__name__ = (
    "pipeoff_OffloadOptimizer_forward_wait__a_graph_break__"
    "compile_without_fullgraph_or_compile_inside_the_hooked_modules")


def _fsdp_wait(waits: ForwardWaits, module: Any, name: str) -> None:
    state = _compat.fsdp_state(module)
    # Read the prefetch list now: set_modules_to_forward_prefetch may change it.
    mine = _compat.fsdp_sharded_params(state)
    for other in _compat.fsdp_prefetch_states(state):
        mine += _compat.fsdp_sharded_params(other)
    streams: tuple[Any, ...] | None = None
    if waits.cuda:
        # The all-gathers read the shards on these streams, which do not
        # sync with the compute stream again after the root's pre-forward.
        gathers = () if _faults.disabled("fsdp_gather_wait") else (
            _compat.fsdp_all_gather_streams(state))
        streams = (_accel.current().current_stream(waits.device), *gathers)
    waits.on_module(module, mine, name, streams)


def set_post_optim_event(root: Any, device: torch.device) -> None:
    """Give an FSDP2 root an event recorded now on ``device``'s current stream, to wait
    for instead of the whole current stream (``FSDPModule.set_post_optim_event``)."""
    accel = _accel.current()
    ev = accel.new_event()
    # Hazard: FSDP's all-gather streams waiting on compute enqueued after the
    # step (a false dependency); the forward hooks carry the real ones.
    # Recorded on the parameters' device, whichever device is current.
    ev.record(accel.current_stream(device))
    root.set_post_optim_event(ev)
