"""The HF transformers ``Trainer`` with a :class:`~pipeoff.optim.FullOffloadOptimizer`.

The Trainer clips with ``accelerator.clip_grad_norm_(model.parameters(),
max_grad_norm)``, which reads ``param.grad``; under full offload the gradients
are on the host, so torch's function finds none, clips nothing and returns 0
(the logged ``grad_norm``). :func:`prepare_trainer` routes that call to the
optimizer's :meth:`~pipeoff.optim.FullOffloadOptimizer.clip_grad_norm_`, which
clips in the step and returns the true norm. ``OffloadOptimizer`` keeps the
gradients in ``.grad`` and needs nothing.

Example::

    opt = FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-4)
    trainer = Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, None))
    prepare_trainer(trainer)
    trainer.train()
"""

from __future__ import annotations

from typing import Any

from pipeoff._errors import ConfigError

__all__ = ["prepare_trainer"]


def _full_offload_of(optimizer: Any) -> Any:
    from pipeoff.optim import FullOffloadOptimizer

    seen = 0
    while optimizer is not None and seen < 8:  # accelerate's wrappers hold it as .optimizer
        if isinstance(optimizer, FullOffloadOptimizer):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
        seen += 1
    return None


def prepare_trainer(trainer: Any) -> Any:
    """Make ``trainer`` clip (``args.max_grad_norm``) and log ``grad_norm`` through its
    :class:`~pipeoff.optim.FullOffloadOptimizer`; returns ``trainer``. Call it after
    building the Trainer, before ``train()``. A Trainer with another optimizer is
    returned unchanged.

    Raises:
        ConfigError: ``trainer`` is not a Trainer, or the optimizer has
            ``overlap="backward"`` with ``args.max_grad_norm > 0`` (the chunks step
            during the backward, before the norm is known) or with
            ``gradient_accumulation_steps > 1`` (each backward would be final).
    """
    accelerator = getattr(trainer, "accelerator", None)
    if accelerator is None or not hasattr(trainer, "args"):
        raise ConfigError(f"prepare_trainer expects a transformers Trainer, got "
                          f"{type(trainer).__name__}")
    opt = _full_offload_of(getattr(trainer, "optimizer", None))
    if opt is None:
        return trainer
    accumulation = int(getattr(trainer.args, "gradient_accumulation_steps", 1) or 1)
    if accumulation > 1 and opt.overlap == "backward":
        raise ConfigError(
            f"gradient_accumulation_steps={accumulation} with overlap='backward': that "
            "overlap steps during every backward not marked by no_sync(), and the Trainer "
            "marks none in a single process; use overlap='forward' (the default), under "
            "which gradients accumulate until step()")
    max_grad_norm = float(trainer.args.max_grad_norm or 0.0)
    if max_grad_norm > 0 and opt.overlap == "backward":
        raise ConfigError(
            f"the Trainer clips (max_grad_norm={max_grad_norm}) and the optimizer has "
            "overlap='backward', which steps during the backward, before the norm is "
            "known: use overlap='forward' (the default), or max_grad_norm=0")

    def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2.0) -> Any:
        return opt.clip_grad_norm_(max_norm, norm_type)

    clip_grad_norm_.pipeoff_routes_to = opt  # type: ignore[attr-defined]
    accelerator.clip_grad_norm_ = clip_grad_norm_
    return trainer

