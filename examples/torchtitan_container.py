"""torchtitan's optimizer container with pipeoff's optimizers: one call swapped.

A torchtitan training loop builds its optimizers with
``config.optimizer.build(model_parts=...)``; here
``pipeoff.integrations.torchtitan.build_optimizers(model_parts, config.optimizer,
full_offload=...)`` builds the same container with the optimizer state (and, under
full offload, the FP32 masters and gradient sums) in host memory. The loop is
torchtitan's ``train_step``: zero the gradients, two micro-batches, torchtitan's
``clip_grad_norm_`` over every model part, ``step()``, the LR schedulers' ``step()``.

It trains a tiny model (CPU, FP32) with torchtitan's own container, then with each
of pipeoff's, prints every step's loss and gradient norm, and checks that the
weights and the checkpoint (torchtitan's flat ``state_dict()``) are those of
torchtitan's run, bit for bit.

    python examples/torchtitan_container.py --steps 4
"""

from __future__ import annotations

import argparse
import copy
from typing import Any

import torch
from torch import nn

MAX_NORM = 0.5  # torchtitan's training.max_norm (its default is 1.0); it clips here


class Stage(nn.Module):
    """A model part with torchtitan's names (``layers.<i>``)."""

    def __init__(self, dim: int = 32, n_layers: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({
            str(i): nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(),
                                  nn.Linear(4 * dim, dim)) for i in range(n_layers)})
        self.output = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = x + layer(x)
        return self.output(x)


def train(model_parts: list[nn.Module], optimizers: Any, lr_schedulers: Any,
          batches: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> list[tuple[float, float]]:
    """torchtitan's Trainer.train_step, once per batch; (loss, grad_norm) per step."""
    from torchtitan.distributed import utils as dist_utils

    logged = []
    for micro_batches in batches:
        # training.disable_cuda_graphs=True, as pipeoff's optimizers need on CUDA
        optimizers.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for x, y in micro_batches:  # gradient_accumulation_steps=2
            loss = nn.functional.mse_loss(model_parts[0](x), y) / len(micro_batches)
            loss.backward()
            loss_sum += float(loss.detach())
        grad_norm = dist_utils.clip_grad_norm_(
            [p for m in model_parts for p in m.parameters()], MAX_NORM, foreach=True)
        optimizers.step()
        lr_schedulers.step()
        logged.append((loss_sum, float(grad_norm)))
    return logged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()

    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

    from pipeoff.integrations.torchtitan import build_optimizers

    optimizer_config = default_adamw(lr=3e-3)  # AdamW, betas (0.9, 0.95), weight decay 0.1
    lr_config = LRSchedulersContainer.Config(warmup_steps=2)
    torch.manual_seed(0)
    model = Stage()
    g = torch.Generator().manual_seed(1)
    target = torch.randn(32, 1, generator=g) / 32**0.5  # learn y = x @ target
    batches = [[(x, x @ target) for x in (torch.randn(16, 32, generator=g) for _ in range(2))]
               for _ in range(args.steps)]

    runs: dict[str, tuple[list[nn.Module], Any]] = {}
    for name in ("torchtitan", "OffloadOptimizer", "FullOffloadOptimizer"):
        model_parts = [copy.deepcopy(model)]
        if name == "torchtitan":
            optimizers = optimizer_config.build(model_parts=model_parts)
        else:  # the one call swapped
            optimizers = build_optimizers(model_parts, optimizer_config,
                                          full_offload=name == "FullOffloadOptimizer")
        lr_schedulers = lr_config.build(optimizers=optimizers, training_steps=args.steps)
        print(f"{name}: {type(optimizers.optimizers[0]).__name__} per model part")
        for step, (loss, norm) in enumerate(train(model_parts, optimizers, lr_schedulers,
                                                  batches), start=1):
            print(f"  step {step}  loss {loss:.6f}  grad_norm {norm:.6f}")
        runs[name] = (model_parts, optimizers)

    ref_parts, ref_opt = runs["torchtitan"]
    ref_sd = ref_opt.state_dict()
    for name in ("OffloadOptimizer", "FullOffloadOptimizer"):
        parts, opt = runs[name]
        weights = all(torch.equal(p.view(torch.int32), q.view(torch.int32))
                      for p, q in zip(parts[0].parameters(), ref_parts[0].parameters()))
        sd = opt.state_dict()
        checkpoint = sd.keys() == ref_sd.keys() and all(
            torch.equal(v, ref_sd[k]) if isinstance(v, torch.Tensor) else v == ref_sd[k]
            for k, v in sd.items())
        print(f"{name}: weights bitwise torchtitan's: {weights}; checkpoint "
              f"({len(sd)} keys) equal to torchtitan's: {checkpoint}")


if __name__ == "__main__":
    main()
