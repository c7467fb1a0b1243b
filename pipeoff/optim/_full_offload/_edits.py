"""The loop's in-place edits of a gradient (a clip coefficient, a value clamp), as
recorded on a placeholder and applied to the host sum in the step: the math, kept
apart from the placeholders' bookkeeping (``_grads.py``), which records them, and
read by the lanes (``_lanes.py``), which apply them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pipeoff._compat import local_tensor as local
from pipeoff._errors import GradientError
from pipeoff.optim._full_offload._placeholder import NeedsRealGradient

__all__ = ["FOREACH_CLAMP", "FOREACH_SCALE", "SCALE", "Edit", "apply_edits", "fusable",
           "value"]

aten = torch.ops.aten

Edit = tuple[Any, ...]
"""A recorded in-place operation: ``("mul", v)``, ``("div", v)``, ``("clamp", lo, hi)``,
``("clamp_min", v)``, ``("clamp_max", v)`` or ``("zero",)``; ``v`` a number or a 0-dim
CPU tensor."""


def apply_edits(acc: torch.Tensor, edits: Sequence[Edit]) -> None:
    """Apply recorded in-place operations to a host gradient sum, in order (torch's ops,
    so each is torch's bits on the FP32 sum)."""
    for e in edits:
        kind = e[0]
        if kind == "mul":
            acc.mul_(e[1])
        elif kind == "div":
            acc.div_(e[1])
        elif kind == "clamp":
            acc.clamp_(e[1], e[2])
        elif kind == "clamp_min":
            acc.clamp_min_(e[1])
        elif kind == "clamp_max":
            acc.clamp_max_(e[1])
        elif kind == "zero":
            acc.zero_()
        else:  # pragma: no cover - recorded by LoopGrads only
            raise AssertionError(kind)


def fusable(edits: Sequence[Edit]) -> bool:
    """Whether ``edits`` are one multiplication by an FP32 one-element tensor (a clip
    coefficient), which a kernel may apply inside its pass for the same bits."""
    if len(edits) != 1 or edits[0][0] != "mul":
        return False
    v = edits[0][1]
    return isinstance(v, torch.Tensor) and v.dtype == torch.float32


def value(v: Any, what: str) -> Any:
    """A scaling operand as recorded: a number, or a one-element tensor copied to the CPU."""
    if isinstance(v, bool) or not isinstance(v, (int, float, torch.Tensor)):
        raise GradientError(f"{what} of a FullOffloadOptimizer gradient takes a number or a "
                            f"one-element tensor, got {type(v).__name__}")
    if isinstance(v, torch.Tensor):
        v = local(v)
        if v.numel() != 1:
            # Element-wise (a mask): run on the real gradient, as any other operation
            # that needs its values (a tester's find: it was refused).
            raise NeedsRealGradient(f"{what} of a gradient by a tensor of shape "
                                    f"{tuple(v.shape)} needs its values")
        return v.detach().to("cpu", copy=True).reshape(())
    return v


SCALE = {aten.mul_.Tensor: "mul", aten.mul_.Scalar: "mul",
          aten.div_.Tensor: "div", aten.div_.Scalar: "div"}
FOREACH_SCALE = {
    aten._foreach_mul_.Scalar: "mul", aten._foreach_mul_.Tensor: "mul",
    aten._foreach_mul_.ScalarList: "mul", aten._foreach_mul_.List: "mul",
    aten._foreach_div_.Scalar: "div", aten._foreach_div_.Tensor: "div",
    aten._foreach_div_.ScalarList: "div", aten._foreach_div_.List: "div"}
FOREACH_CLAMP = {aten._foreach_clamp_min_.Scalar: "clamp_min",
                  aten._foreach_clamp_max_.Scalar: "clamp_max",
                  aten._foreach_clamp_min_.ScalarList: "clamp_min",
                  aten._foreach_clamp_max_.ScalarList: "clamp_max"}
