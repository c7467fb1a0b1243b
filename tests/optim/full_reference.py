"""The reference full-offload step (issue 13), written plainly, for bitwise comparison.

Per parameter, the FP32 left fold of its micro-step gradients (each widened
exactly, the first copied, micro-steps without a gradient skipped); then the
optimizer class stepping FP32 master copies on the CPU (after clipping with
``clip_grad_norm_(foreach=False)``); then weights = masters cast to the
compute dtype.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch


class Reference:
    def __init__(self, model: torch.nn.Module, optimizer_class: type, *,
                 groups: Callable[[torch.nn.Module], list[Any]] | None = None,
                 max_norm: float | None = None, **defaults: Any) -> None:
        self.model = copy.deepcopy(model)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.masters = {id(p): p.detach().float().clone().requires_grad_(True)
                        for p in self.params}
        if groups is None:
            spec: list[Any] = [{"params": self.params}]
        else:
            spec = groups(self.model)
        self.groups = [{**g, "params": [self.masters[id(p)] for p in g["params"]]}
                       for g in spec]
        self.opt = optimizer_class(self.groups, **defaults)
        self.max_norm = max_norm
        self.acc: dict[int, torch.Tensor] = {}

    def micro_step(self, loss_fn: Callable[[torch.nn.Module], torch.Tensor]) -> None:
        for p in self.params:
            p.grad = None
        loss_fn(self.model).backward()
        for p in self.params:
            if p.grad is None:
                continue
            g = p.grad.float()  # exact widening
            if id(p) in self.acc:
                self.acc[id(p)] = self.acc[id(p)] + g
            else:
                self.acc[id(p)] = g.clone()  # the first: a copy, never 0 + g
            p.grad = None

    @torch.no_grad()
    def step(self, edit: Callable[[list[torch.Tensor]], Any] | None = None) -> Any:
        """Step; ``edit`` (the loop's clip call, say) first gets the masters that have a
        gradient, in the model's parameter order, and its result is returned."""
        with_grad = []
        for p in self.params:
            m = self.masters[id(p)]
            m.grad = self.acc.get(id(p))
            if m.grad is not None:
                with_grad.append(m)
        out = edit(with_grad) if edit is not None else None
        if self.max_norm is not None:
            torch.nn.utils.clip_grad_norm_(
                [m for g in self.groups for m in g["params"] if m.grad is not None],
                self.max_norm, foreach=False)
        self.opt.step()
        for p in self.params:
            p.copy_(self.masters[id(p)])
            self.masters[id(p)].grad = None
        self.acc = {}
        return out


def assert_same(model: torch.nn.Module, ref: Reference, names: Sequence[str] = ()) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.model.parameters()):
        assert torch.equal(p.detach(), q.detach()), (
            f"{name}: max diff {(p.detach().float() - q.detach().float()).abs().max()}")
