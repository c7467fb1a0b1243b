"""What full offload says when a trainer drives it without being told (the HF Trainer
clipping ``.grad`` that is on the host)."""

from __future__ import annotations

from typing import Any

__all__ = ["warn_if_unrouted"]


def warn_if_unrouted(opt: Any) -> None:
    """Warn once if a Trainer that clips is stepping ``opt`` without
    :func:`prepare_trainer`: its clipping found no ``.grad`` and its logged
    ``grad_norm`` is 0 (called by ``FullOffloadOptimizer.step()``; ``pipeoff.integrations.hf``
    routes it)."""
    import sys
    import warnings

    trainer_cls = getattr(sys.modules.get("transformers.trainer"), "Trainer", None)
    if trainer_cls is None or getattr(opt, "_routed_clipping", False):
        return
    frame: Any = sys._getframe(1)
    for _ in range(8):
        if frame is None:
            return
        me = frame.f_locals.get("self")
        if isinstance(me, trainer_cls):
            if float(getattr(me.args, "max_grad_norm", 0.0) or 0.0) > 0:
                warnings.warn(
                    "FullOffloadOptimizer in a transformers Trainer that clips "
                    "(max_grad_norm > 0): the Trainer's clip_grad_norm_ reads param.grad, "
                    "which is on the host under full offload, so it clipped nothing and "
                    "logs grad_norm 0; call pipeoff.integrations.hf.prepare_trainer(trainer) "
                    "before train()", RuntimeWarning, stacklevel=2)
            opt._routed_clipping = True  # said once (or nothing to say)
            return
        frame = frame.f_back
