"""The HF transformers ``Trainer`` with pipeoff's optimizers.

Nothing is needed: under :class:`~pipeoff.optim.FullOffloadOptimizer`,
``param.grad`` holds placeholders for the host gradient sums
(:class:`~pipeoff.optim.HostGrad`), so the Trainer's own
``accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)`` clips (in
the step) and returns the true norm that it logs. Either hand the Trainer an
optimizer, or let it build one with its own decay / no-decay groups::

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      optimizer_cls_and_kwargs=(FullOffloadOptimizer, {
                          "optimizer_class": torch.optim.AdamW, "lr": 1e-4}))

:func:`prepare_trainer`, which routed the clip call before, is kept as a no-op.
"""

from __future__ import annotations

import warnings
from typing import Any

__all__ = ["prepare_trainer"]


def prepare_trainer(trainer: Any) -> Any:
    """Return ``trainer`` unchanged: no longer needed (the Trainer's own clipping works
    under full offload). Deprecated; it warns once per call with ``FutureWarning``."""
    warnings.warn("pipeoff.integrations.hf.prepare_trainer() is no longer needed: the "
                  "Trainer's own clip_grad_norm_ works under FullOffloadOptimizer; remove "
                  "the call", FutureWarning, stacklevel=2)
    return trainer
