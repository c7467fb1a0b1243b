"""What full offload says when a trainer drives it without being told (the HF Trainer
clipping ``.grad`` that is on the host)."""

from __future__ import annotations

import weakref
from typing import Any

__all__ = ["warn_if_unrouted"]

_SAID: weakref.WeakSet[Any] = weakref.WeakSet()
"""Optimizers whose trainer was looked at already."""


def warn_if_unrouted(opt: Any) -> None:
    """Warn once if a Trainer is stepping ``opt`` without
    :func:`prepare_trainer`: its clipping found no ``.grad`` and its logged
    ``grad_norm`` is 0 (called by ``FullOffloadOptimizer.step()``; ``pipeoff.integrations.hf``
    routes it)."""
    import sys
    import warnings

    trainer_cls = getattr(sys.modules.get("transformers.trainer"), "Trainer", None)
    if trainer_cls is None or opt in _SAID:
        return
    _SAID.add(opt)  # looked at once: the caller of its first step() is its loop
    frame: Any = sys._getframe(1)
    for _ in range(8):
        if frame is None:
            return
        if frame.f_code.co_name != "_inner_training_loop":
            # (Only the Trainer's loop: reading f_locals snapshots a frame's locals
            # into a dict that lives as long as the frame, keeping them alive.)
            frame = frame.f_back
            continue
        me = frame.f_locals.get("self")
        if isinstance(me, trainer_cls):
            routed = getattr(getattr(me.accelerator, "clip_grad_norm_", None),
                             "pipeoff_routes_to", None) is opt
            if not routed:
                warnings.warn(
                    "FullOffloadOptimizer in a transformers Trainer without "
                    "pipeoff.integrations.hf.prepare_trainer(trainer): the Trainer's "
                    "clip_grad_norm_ reads param.grad, which is on the host under full "
                    "offload, so it clips nothing (max_grad_norm) and logs grad_norm 0; "
                    "call prepare_trainer(trainer) before train()", RuntimeWarning,
                    stacklevel=2)
            return
        frame = frame.f_back
