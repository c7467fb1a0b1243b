"""Knobs people carry over from other offload tools, refused with pipeoff's equivalent.

A keyword argument that neither pipeoff nor the wrapped optimizer takes would
otherwise reach the optimizer class and fail as "AdamW refused ...", which says
nothing about what to do. Each row here says it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipeoff._errors import ConfigError

__all__ = ["refuse_foreign"]

_FULL = "FullOffloadOptimizer"
_STATE = "OffloadOptimizer"

_WHY: dict[str, dict[str, str]] = {
    "offload_gradients": {
        _FULL: "FullOffloadOptimizer always takes the gradients to the host (torchao's "
               "offload_gradients=True); for state-only offload, with the gradients on the "
               "device, use OffloadOptimizer",
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
        "*": "pipeoff works on the device the parameters are on (torchao's device=); move "
             "the model there first",
    },
    "pin_memory": {
        _FULL: "FullOffloadOptimizer pins its host memory whenever an accelerator holds the "
               "weights (there is nothing to switch)",
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
        if key == "offload_gradients" and where == _STATE and not kwargs[key]:
            continue  # torchao's default: what OffloadOptimizer does
        raise ConfigError(f"{where}({key}=...): {why}")
