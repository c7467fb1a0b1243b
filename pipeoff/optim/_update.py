"""The chunk update: a pure function stepping parameter slices with the wrapped optimizer's math.

Each chunk owns a private *shadow* optimizer of the wrapped optimizer's class.
Its param groups hold flat slice views of the parameters, with slice views of
the gradients and of the staged state, and the group hyperparameters captured
at ``step()`` time. Stepping it runs the wrapped optimizer's own kernels, so
for element-wise optimizers the result is bitwise what a full step gives. The
wrapped optimizer's param groups are never touched, so the main thread (an LR
scheduler, ``zero_grad``) can use them while chunks run.
"""

from __future__ import annotations

import collections
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pipeoff import _compat
from pipeoff._errors import ConfigError, UnsupportedOptimizerError

__all__ = ["ELEMENTWISE", "ChunkGroup", "check_loaded_entry", "group_of", "make_shadow",
           "required_keys", "state_keys", "step_chunk",
           "StepMarks", "mark_step", "step_count", "wrote_before_failing"]


def _adam_keys(group: Mapping[str, Any]) -> tuple[str, ...]:
    return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group.get("amsgrad") else ())


def _sgd_keys(group: Mapping[str, Any]) -> tuple[str, ...]:
    return ("momentum_buffer",) if group.get("momentum", 0) != 0 else ()


def _rmsprop_keys(group: Mapping[str, Any]) -> tuple[str, ...]:
    return (
        ("square_avg",)
        + (("momentum_buffer",) if group.get("momentum", 0) > 0 else ())
        + (("grad_avg",) if group.get("centered") else ())
    )


_Keys = Callable[[Mapping[str, Any]], tuple[str, ...]]

ELEMENTWISE: Mapping[type[torch.optim.Optimizer], _Keys] = {
    torch.optim.Adam: _adam_keys,
    torch.optim.AdamW: _adam_keys,
    torch.optim.SGD: _sgd_keys,
    torch.optim.Adagrad: lambda g: ("sum",),
    torch.optim.RMSprop: _rmsprop_keys,
}
"""Optimizers whose update of each element reads only that element's parameter,
gradient and state, by exact class, with the per-element state keys a param
group gives them. Everything else in their state (``step``) is a scalar."""

def check_elementwise(opt: torch.optim.Optimizer, asked: str) -> None:
    """Raise :class:`UnsupportedOptimizerError` unless ``opt`` can be stepped in chunks
    (``asked``: the argument that asked for them, as the caller gave it)."""
    if type(opt) not in ELEMENTWISE:
        names = ", ".join(f"torch.optim.{t.__name__}" for t in ELEMENTWISE)
        raise UnsupportedOptimizerError(
            f"{asked} steps the optimizer in chunks of flat parameter slices, which is "
            f"only exact for element-wise optimizers ({names}); {type(opt).__qualname__} is "
            "not one of them. Use mode='single_pass' for it."
        )


def state_keys(opt: torch.optim.Optimizer, group: Mapping[str, Any]) -> tuple[str, ...]:
    """The per-element state keys ``opt`` keeps for parameters of ``group``."""
    return ELEMENTWISE[type(opt)](group)


def required_keys(opt: torch.optim.Optimizer, group: Mapping[str, Any]) -> tuple[str, ...]:
    """The keys a parameter's non-empty state must hold for ``opt``'s step in ``group``
    (torch's load or step raises ``KeyError`` without one); ``()`` for an optimizer not
    in :data:`ELEMENTWISE`, and for SGD (a missing momentum buffer starts afresh)."""
    keys = ELEMENTWISE.get(type(opt))
    if keys is None or type(opt) is torch.optim.SGD:
        return ()
    return ("step", *keys(group))


def check_loaded_entry(where: str, entry: Mapping[str, Any], required: Sequence[str]) -> None:
    """Refuse a loaded state entry that torch's step could not take, before anything of
    the load is written: a tensor without values (meta) or not dense, a ``step`` that is
    not a number, or (in a non-empty entry) a key of ``required`` missing.

    Args:
        where: the parameter, as the error names it.
        entry: its state, as the checkpoint has it.
        required: :func:`required_keys` of its group.

    Raises:
        ConfigError: naming the parameter and the key.
    """
    for key, val in entry.items():
        if isinstance(val, torch.Tensor):
            t = _compat.local_tensor(val)
            if t.is_meta or t.layout is not torch.strided:
                kind = "a meta tensor (no values)" if t.is_meta else f"a {t.layout} tensor"
                raise ConfigError(
                    f"state {key!r} of {where} is {kind}; loaded state must be dense tensors "
                    "with values (a checkpoint loaded with map_location='meta'?); nothing "
                    "was loaded")
        elif key == "step" and not isinstance(val, numbers.Real):  # (NumPy's too, as torch)
            raise ConfigError(f"state 'step' of {where} is {val!r}, not a number or a tensor; "
                              "nothing was loaded")
    missing = [k for k in required if k not in entry] if entry else []
    if missing:
        raise ConfigError(
            f"the state of {where} has no {', '.join(map(repr, missing))}, which its "
            "optimizer steps with (torch's load or step would raise KeyError); nothing "
            "was loaded")


def make_shadow(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A parameter-less optimizer of ``opt``'s class and defaults, for one chunk.

    It is built without ``__init__`` (which insists on parameters) and has no
    hooks: a chunk step must not fire the user's step hooks once per chunk.
    """
    shadow = type(opt).__new__(type(opt))
    shadow.__dict__["defaults"] = opt.defaults
    shadow.__dict__["state"] = collections.defaultdict(dict)
    shadow.__dict__["param_groups"] = []
    _compat.hookless(shadow)
    return shadow


@dataclass(slots=True)
class ChunkGroup:
    """The slices of one param group inside a chunk, ready to step."""

    hyper: Mapping[str, Any]
    """The group's hyperparameters, captured at ``step()`` time."""
    params: list[torch.Tensor] = field(default_factory=list)
    """Flat slice views of the parameters (local shards), updated in place."""
    grads: list[torch.Tensor] = field(default_factory=list)
    """The matching gradient slices."""
    staged: list[dict[str, torch.Tensor]] = field(default_factory=list)
    """Per slice, its per-element state as views of the staging buffer."""
    present: list[tuple[str, ...]] = field(default_factory=list)
    """Per slice, the per-element keys that exist already (the others are created)."""
    scalars: list[dict[str, Any]] = field(default_factory=list)
    """Per slice, the other state entries (``step``), private copies."""
    advanced: bool = False
    """Set by :func:`step_chunk` when it raised: the kernels may have written, because
    some slice's ``step`` count went up (torch's optimizers count before their math),
    or the group is ``fused`` (torch's fused kernels leave the version counters
    alone, and fused SGD counts no step)."""

    def add(self, param: torch.Tensor, grad: torch.Tensor, staged: dict[str, torch.Tensor],
            present: tuple[str, ...], scalars: Mapping[str, Any]) -> dict[str, Any]:
        """Add one slice; returns the private copy of ``scalars`` the step updates (the
        caller commits it once the step has succeeded)."""
        mine = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in scalars.items()}
        self.params.append(param)
        self.grads.append(grad)
        self.staged.append(staged)
        self.present.append(present)
        self.scalars.append(mine)
        return mine


def group_of(groups: dict[int, ChunkGroup], hyper: Sequence[Mapping[str, Any]],
             gi: int) -> ChunkGroup:
    """The :class:`ChunkGroup` of param group ``gi`` in ``groups`` (made on first use)."""
    cg = groups.get(gi)
    if cg is None:
        cg = groups[gi] = ChunkGroup(hyper[gi])
    return cg


def _count(step: Any) -> float:
    """A ``step`` state entry's value (a tensor or a number); 0 when there is none."""
    if step is None:
        return 0.0
    return float(step.item()) if isinstance(step, torch.Tensor) else float(step)


def step_chunk(shadow: torch.optim.Optimizer, groups: Sequence[ChunkGroup]) -> None:
    """Apply one optimizer step to the slices in ``groups``; pure math, no bookkeeping.

    Per-element state that the optimizer creates on a first step is copied into
    the staging views, so ``staged`` always holds the result. ``scalars`` are
    updated in place with the entries the step leaves (an incremented ``step``).
    """
    shadow.param_groups = [
        {**g.hyper, "params": list(g.params)} for g in groups if g.params
    ]
    state: collections.defaultdict[torch.Tensor, dict[str, Any]] = collections.defaultdict(dict)
    for g in groups:
        for v, grad, staged, present, scalars in zip(
            g.params, g.grads, g.staged, g.present, g.scalars
        ):
            v.grad = grad
            st = dict(scalars)
            st.update({k: staged[k] for k in present})
            state[v] = st
    shadow.state = state
    counts = {id(v): _count(state[v].get("step")) for g in groups for v in g.params}
    # The class's step is wrapped by torch.optim's hook machinery; call the body.
    body = _compat.step_body(type(shadow))
    try:
        # Hazard: torch.compile on another thread flipping torch.compiler.is_compiling()
        # (one process-wide flag) under these kernels, which then take their
        # compiled-code branches and give different bits.
        with _compat.eager_math():
            body(shadow)
        for g in groups:
            for v, staged, scalars in zip(g.params, g.staged, g.scalars):
                after = state[v]
                for k, t in staged.items():
                    new = after.get(k)
                    if new is not None and new is not t:
                        t.copy_(new)  # first step: the optimizer allocated it
                for k, val in after.items():
                    if k not in staged:
                        scalars[k] = val
    except BaseException:
        for g in groups:
            # A torch fused kernel bumps no version counter, and SGD counts no step:
            # a failure inside a fused step may have written (torn, conservatively).
            g.advanced = bool(g.hyper.get("fused")) or any(
                _count(state[v].get("step")) > counts[id(v)] for v in g.params)
        raise
    finally:
        for g in groups:
            for v in g.params:
                v.grad = None
        shadow.state = collections.defaultdict(dict)
        shadow.param_groups = []


def step_count(step: Any) -> float:
    """A ``step`` state entry's value (a tensor or a number); 0 when there is none."""
    if step is None:
        return 0.0
    return float(step.item()) if isinstance(step, torch.Tensor) else float(step)


@dataclass(frozen=True)
class StepMarks:
    """What a torch optimizer's step may change, read before it: whether it had written
    anything when it raised (:func:`wrote_before_failing`)."""

    versions: tuple[int, ...]
    """The parameters' version counters."""
    state: tuple[tuple[torch.Tensor, int], ...]
    """The state's tensors before the step, with their version counters (tensors the
    step adds or puts in their place live in the step's own state dicts, which the
    callers drop when it raises)."""
    counts: tuple[float | None, ...]
    """Per parameter, its step count (:func:`step_count`), or ``None`` where it is not
    read (in device memory: ``.item()`` would block the host on the stream)."""


def mark_step(params: Sequence[torch.Tensor], states: Sequence[Mapping[str, Any]],
              on_device: Callable[[torch.Tensor], bool]) -> StepMarks:
    """:class:`StepMarks` of a step of ``params`` (the tensors it writes: a DTensor itself,
    whose local tensor bumps no version counter) whose state dicts, in the same order,
    are ``states`` (the ones the step writes into)."""
    return StepMarks(
        tuple(p._version for p in params),
        tuple((v, v._version) for st in states for v in st.values()
              if isinstance(v, torch.Tensor)),
        tuple(None if isinstance(s, torch.Tensor) and on_device(s) else step_count(s)
              for s in (st.get("step") for st in states)))


def wrote_before_failing(opt: torch.optim.Optimizer, marks: StepMarks,
                         params: Sequence[torch.Tensor],
                         states: Sequence[Mapping[str, Any]]) -> bool:
    """Whether ``opt``'s step that raised may have written its parameters or their state
    (then it is not retried: a retry would step twice what it had stepped).

    Written: a fused kernel ran (it bumps no version counter, and fused SGD counts no
    step); a parameter's or a state tensor's version counter moved (SGD's momentum,
    written before a failure at ``-lr``); a step count moved or is not read. Where
    torch's in-place foreach ops bump no version counter, under a ``TorchDispatchMode``
    (``FlopCounterMode`` around the step) or on ``DTensor`` parameters (FSDP2), an
    optimizer that keeps no step count (SGD) may have written whatever the counters
    say. State the step added (a first step's, up to an out-of-memory error while
    making it) is the step's own: the callers drop it, so it is not a write.
    """
    if any(g.get("fused") for g in opt.param_groups):
        return True
    if tuple(p._version for p in params) != marks.versions or any(
            v._version != n for v, n in marks.state):
        return True
    if any(c is None or step_count(st.get("step")) > c
           for c, st in zip(marks.counts, states, strict=True)):
        return True
    blind = _compat.dispatch_mode_active() or any(
        _compat.local_tensor(p) is not p for p in params)
    return blind and isinstance(opt, torch.optim.SGD)
