"""Knobs people carry over from other offload tools, refused with pipeoff's equivalent.

A keyword argument that neither pipeoff nor the wrapped optimizer takes would
otherwise reach the optimizer class and fail as "AdamW refused ...", which says
nothing about what to do. Each row here says it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from pipeoff._errors import ConfigError
from pipeoff._validate import short_repr

__all__ = ["not_an_optimizer_class", "optimizer_class_of", "refuse_foreign"]

_FULL = "FullOffloadOptimizer"
_STATE = "OffloadOptimizer"

_WHY: dict[str, dict[str, str]] = {
    "offload_gradients": {
        _FULL: "FullOffloadOptimizer always takes the gradients to the host (torchao's "
               "offload_gradients=True, accepted); for state-only offload, with the "
               "gradients on the device, use OffloadOptimizer",
        _STATE: "OffloadOptimizer keeps the gradients on the device (torchao's "
                "offload_gradients=False); for gradients on the host too use "
                "FullOffloadOptimizer (it also accumulates and clips them, which torchao's "
                "does not)",
    },
    "minimal_size": {
        "*": "pipeoff offloads every parameter it optimizes (torchao's minimal_size keeps "
             "small ones on the device): build a plain torch optimizer for those, or leave "
             "them out of the params",
    },
    "device": {
        "*": "the offload target is always host (CPU) memory (DeepSpeed's device='cpu'; "
             "NVMe has no equivalent), and the compute stays on the device the parameters "
             "are on (torchao's device=): keep the model on the accelerator",
    },
    "gradient_clipping": {
        _FULL: "use max_norm= (DeepSpeed's gradient_clipping), or the loop's own "
               "torch.nn.utils.clip_grad_norm_",
        _STATE: "clip in the loop with torch.nn.utils.clip_grad_norm_ before step() "
                "(DeepSpeed's gradient_clipping; the gradients stay on the device)",
    },
    "max_norm": {
        _STATE: "OffloadOptimizer leaves the gradients on the device: clip them in the loop "
                "with torch.nn.utils.clip_grad_norm_ before step() (max_norm= is "
                "FullOffloadOptimizer's, whose gradients are on the host)",
    },
    "offload_optimizer": {
        "*": "pass the keys of DeepSpeed's offload_optimizer dict as pipeoff's own: "
             "pin_memory=, slots= or prefetch= (buffer_count); see docs/migrating.md",
    },
    "offload_param": {
        "*": "pipeoff keeps the compute weights on the device (DeepSpeed's offload_param, "
             "ZeRO-Infinity, has no equivalent); FullOffloadOptimizer moves the FP32 "
             "masters, optimizer state and gradients to the host",
    },
    "slots": {
        _STATE: "slots= is FullOffloadOptimizer's host slot count; OffloadOptimizer's "
                "staging depth is prefetch=",
    },
    "prefetch": {
        _FULL: "prefetch= is OffloadOptimizer's staging depth; FullOffloadOptimizer's is "
               "slots= (host slots a gradient travels through)",
    },
    "mode": {
        _FULL: "FullOffloadOptimizer takes overlap='forward', 'backward' or 'none' "
               "(OffloadOptimizer's mode='overlap' is overlap='forward')",
    },
    # DeepSpeed ZeRO-Offload's offload_optimizer keys.
    "ratio": {
        "*": "use offload_fraction= (the share of the state kept on the host, in [0, 1]; "
             "DeepSpeed's offload_optimizer.ratio), or offload_fraction='auto' with "
             "device_budget_bytes= to let pipeoff choose it",
    },
    "nvme_path": {
        "*": "pipeoff offloads to host memory only (DeepSpeed's ZeRO-Infinity NVMe offload "
             "has no equivalent)",
    },
    "buffer_count": {
        "*": "pipeoff's staging depth is prefetch= (OffloadOptimizer) or slots= "
             "(FullOffloadOptimizer), DeepSpeed's buffer_count",
    },
    "fast_init": {"*": "pipeoff allocates host state at construction (nothing to switch)"},
    # Megatron-Core's optimizer offload (OptimizerConfig).
    "optimizer_offload_fraction": {
        "*": "use offload_fraction= (Megatron's optimizer_offload_fraction: the share on "
             "the host, in [0, 1]), or offload_fraction='auto' with device_budget_bytes=",
    },
    "use_precision_aware_optimizer": {
        _FULL: "FullOffloadOptimizer keeps FP32 masters of BF16/FP16 weights on the host "
               "and steps them there (Megatron's precision-aware optimizer, offloaded): "
               "nothing to switch",
        _STATE: "OffloadOptimizer steps the parameters in their own dtype; for FP32 masters "
                "of BF16 weights, on the host, use FullOffloadOptimizer",
    },
    "overlap_cpu_optimizer_d2h_h2d": {
        "*": "pipeoff always overlaps its copies with the host step (Megatron's "
             "overlap_cpu_optimizer_d2h_h2d=True); overlap= says what the step hides behind",
    },
    "optimizer_cpu_offload": {
        "*": "this is pipeoff's optimizer: the offload is what it does (Megatron's "
             "optimizer_cpu_offload=True)",
    },
    # The HF Trainer's and prime-rl's names.
    "max_grad_norm": {
        _FULL: "use max_norm= (the HF Trainer's max_grad_norm), or the loop's own "
               "torch.nn.utils.clip_grad_norm_",
        _STATE: "clip in the loop with torch.nn.utils.clip_grad_norm_ before step() (the "
                "HF Trainer's max_grad_norm does this already)",
    },
    "grad_acc_on_gpu": {
        _FULL: "use accumulate='gpu' (prime-rl's grad_acc_on_gpu=True) or 'cpu'",
        _STATE: "OffloadOptimizer leaves gradient accumulation on the device (autograd's "
                "own); FullOffloadOptimizer(accumulate=) chooses where",
    },
    # FSDP2's fully_shard(offload_policy=CPUOffloadPolicy(...)).
    "offload_policy": {
        "*": "pass FSDP2's offload_policy to fully_shard, not to the optimizer; with "
             "pipeoff, keep the parameters on the device (no CPUOffloadPolicy) and let "
             "the optimizer hold its state (and under full offload the masters) on the host",
    },
}


def refuse_foreign(kwargs: Mapping[str, Any], where: str) -> None:
    """Refuse a carried-over knob among ``kwargs`` (the optimizer's hyperparameters).

    Raises:
        ConfigError: naming the knob and pipeoff's equivalent.
    """
    for key in kwargs:
        rows = _WHY.get(key)
        if rows is None:
            continue
        why = rows.get(where, rows.get("*"))
        if why is None:
            continue
        if key == "offload_gradients":
            if not isinstance(kwargs[key], bool):
                raise ConfigError(f"{where}(offload_gradients=...) must be True or False "
                                  f"(torchao's flag), got {kwargs[key]!r}")
            if kwargs[key] == (where == _FULL):
                continue  # what the optimizer does (the caller drops the key)
        raise ConfigError(f"{where} does not take {key}=: {why}")


def optimizer_class_of(value: Any) -> Any:
    """``value``, or the ``torch.optim`` class a config file names (``"AdamW"``, any
    case, as torchtitan's ``name`` and HF's ``optim`` give it); other values pass
    through to the caller's own check.

    Raises:
        ConfigError: a string that names no ``torch.optim`` optimizer.
    """
    if not isinstance(value, str):
        return value
    names = {k.lower(): getattr(torch.optim, k) for k in dir(torch.optim)}
    cls = names.get(value.lower().replace("_", ""))
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ConfigError(f"optimizer_class {value!r} names no torch.optim optimizer; give a "
                          "class (torch.optim.AdamW) or its name ('AdamW', 'SGD', 'Adam')")
    return cls


def not_an_optimizer_class(value: Any, instead: str = "") -> ConfigError:
    """The error for an ``optimizer_class`` that is not a ``torch.optim.Optimizer``
    class; an optimizer instance is told to pass its class (and ``instead``, what the
    caller takes in its place)."""
    if isinstance(value, torch.optim.Optimizer):
        got = f"got an instance of {type(value).__name__}: pass the class{instead}"
    else:
        got = f"got {short_repr(value)}"
    return ConfigError("optimizer_class must be a torch.optim.Optimizer class such as "
                       f"torch.optim.AdamW, {got}")
