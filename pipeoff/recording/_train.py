"""The training loop on the trace: forward, backward, ``step()`` and syncs as spans.

While a region is recorded (:func:`pipeoff.trace.record`), the training thread's
work lands on a ``train`` row next to pipeoff's lanes, each span named with
its step number (``forward 3``, ``backward 3``, ``step 3``, ``sync 3``): the
forward and backward that produce step 3's gradients, step 3's ``step()``
call, the sync that follows it. When nothing records, each hook costs one
list check.

* ``forward``: a pre-forward and a forward hook on the root module of the
  model an optimizer was given (``FullOffloadOptimizer(model)``, or
  ``attach(model)``);
* ``backward``: from the moment autograd reaches the forward's output (a hook
  on the first output tensor that requires grad, or the output's ``.loss``)
  to the end of that backward (a callback queued on autograd's engine);
* ``step`` and ``sync``: around the optimizer's ``step()`` and a LocalSGD or
  DiLoCo sync (:func:`train_span`).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from pipeoff import _compat
from pipeoff._contract import steps_taken
from pipeoff._inert import InertHook, inert
from pipeoff.recording import _recorder

__all__ = ["TRAIN_LANE", "install_train_hooks", "train_span"]

TRAIN_LANE = "train"
"""The row of the training thread's spans."""


@contextmanager
def train_span(what: str, step: int) -> Iterator[None]:
    """Record the block as the training thread's ``"{what} {step}"`` while recording, and
    as a ``pipeoff::train::{what} {step}`` range while ``torch.profiler`` profiles."""
    profiling = _compat.profiler_enabled()
    if not _recorder.active() and not profiling:
        yield
        return
    _recorder.enter_step(step)  # (a recorded region counts its steps by these numbers)
    start = time.perf_counter_ns()
    try:
        if profiling:
            with torch.profiler.record_function(f"pipeoff::train::{what} {step}"):
                yield
        else:
            yield
    finally:
        if _recorder.active():
            _recorder.record_train_span(what, step, start, time.perf_counter_ns())


def _first_grad_tensor(out: Any) -> torch.Tensor | None:
    """The tensor a backward from the forward's output reaches first: ``.loss`` when
    there is one (a transformers output given labels), else the first output tensor
    that requires grad."""
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        return loss
    if isinstance(out, torch.Tensor):
        return out if out.requires_grad else None
    values = out.values() if isinstance(out, Mapping) else (
        out if isinstance(out, (tuple, list)) else ())
    for v in values:
        t = _first_grad_tensor(v)
        if t is not None:
            return t
    return None


class _Spans:
    """The state of one model's train hooks: forwards begun, and the optimizer whose
    step they feed (weakly: the hooks must not keep it, and its gradients, alive)."""

    __slots__ = ("owner", "started")

    def __init__(self, owner: Any) -> None:
        self.started: list[int] = []
        self.owner = weakref.ref(owner)

    def step_of(self) -> int:
        owner = self.owner()
        return (steps_taken(owner) or 0) if owner is not None else 0


class _TrainHook:
    """A forward pre-hook (``post`` False) or forward hook of the root module.

    A model pickled or deep-copied with it gets an inert one: the copy belongs to
    no optimizer.
    """

    __slots__ = ("post", "spans")

    def __init__(self, spans: _Spans, post: bool) -> None:
        self.spans = spans
        self.post = post

    def __call__(self, module: torch.nn.Module, args: Any, out: Any = None) -> None:
        _opaque()(self, out)

    def __reduce__(self) -> tuple[Any, ...]:
        return (inert, ())


# (The names models pickled by pipeoff before 2026-12-06 hold.)
_inert, _Inert = inert, InertHook


_OPAQUE: Any = None


def _opaque() -> Any:
    # Opaque to Dynamo: under torch.compile the hooks run eagerly, as pipeoff's
    # forward hooks do.
    global _OPAQUE
    if _OPAQUE is None:
        _OPAQUE = _compat.dynamo_disable(_run)
    return _OPAQUE


def _run(hook: _TrainHook, out: Any) -> None:
    spans = hook.spans
    if not hook.post:
        if _recorder.active():
            _recorder.enter_step(spans.step_of())
            spans.started.append(time.perf_counter_ns())
        return
    if not spans.started:
        return
    start = spans.started.pop()
    if not _recorder.active():
        return
    step = spans.step_of()
    _recorder.record_train_span("forward", step, start, time.perf_counter_ns())
    t = _first_grad_tensor(out) if torch.is_grad_enabled() else None
    # Only on a tensor of this forward's graph, which the hook goes with: one on a
    # leaf (a forward that returns a parameter) would stay on it for good.
    if t is not None and t.grad_fn is not None:
        t.register_hook(_BackwardStart(step))


class _BackwardStart:
    """A hook on the forward's output: the backward from it has begun; a callback
    queued on autograd's engine records its end."""

    __slots__ = ("begun", "step")

    def __init__(self, step: int) -> None:
        self.step = step
        self.begun: int | None = None

    def __call__(self, grad: torch.Tensor) -> None:
        if self.begun is not None:
            return  # (a second backward through the same graph: the first is timed)
        self.begun = time.perf_counter_ns()
        _compat.queue_backward_callback(self._ended)

    def _ended(self) -> None:
        assert self.begun is not None
        _recorder.record_train_span("backward", self.step, self.begun, time.perf_counter_ns())


_INSTALLED: weakref.WeakKeyDictionary[torch.nn.Module, list[Any]] = (
    weakref.WeakKeyDictionary())
"""Per model, the handles of its train hooks: one set, the latest optimizer's."""


def install_train_hooks(model: torch.nn.Module, owner: Any) -> list[Any]:
    """Hooks on ``model``'s root that record its forward and the backward from its
    output while a region is recorded, for the step ``owner._steps_called`` (an
    optimizer). They replace those an earlier optimizer installed on ``model`` (one
    forward is one span, numbered by the latest optimizer's steps), and go when
    ``owner`` is collected. Returns the handles (``.remove()``)."""
    for h in _INSTALLED.pop(model, ()):
        h.remove()
    spans = _Spans(owner)
    handles = [model.register_forward_pre_hook(_TrainHook(spans, post=False)),
               model.register_forward_hook(_TrainHook(spans, post=True))]
    for h in handles:
        weakref.finalize(owner, h.remove)
    _INSTALLED[model] = handles
    return handles
