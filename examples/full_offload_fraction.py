"""Full offload of a fraction: masters, optimizer state and gradient sums split between
host and device memory; checkpoint, and resume at another fraction.

A small BF16 language model trains with ``FullOffloadOptimizer(offload_fraction=F)``,
two micro-steps of gradient accumulation per step and gradient clipping (the loop's own
``torch.nn.utils.clip_grad_norm_(model.parameters(), 0.4)`` call, as the HF Trainer
makes it; ``--clip optimizer``: the optimizer's ``max_norm=0.4``): about ``F``
of the FP32 masters, AdamW state and FP32 gradient sums live in host memory (the host
part, stepped on host lanes while the next forward runs), the rest (the first
parameters, in param-group order) in device memory, stepped by torch's own AdamW on
the device. The job saves a checkpoint (``torch.save``), restarts with another
fraction, loads it and trains on. A run of the same steps with everything offloaded
(``offload_fraction=1.0``, no restart) checks that the result is bitwise the same.
Prints each step's loss and gradient norm, and where the memory is
(``memory_stats()``) before and after the restart.

    python examples/full_offload_fraction.py --steps 4 --fraction 0.5 --resume-fraction 0.0

After each backward every parameter's ``.grad``, in both parts, holds a placeholder
for its FP32 gradient sum (``pipeoff.optim.HostGrad``): the loop's clip call takes the
norm over both parts and its coefficient clips both.

``--fraction auto`` lets the optimizer choose the first run's fraction from a device
memory budget (``--device-budget-bytes``; default on CUDA the free memory, elsewhere
half of the masters, state and sums) and prints its choice (``offload_choice``).

    python examples/full_offload_fraction.py --fraction auto --resume-fraction 0.0
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from pathlib import Path

import torch
from torch import nn

from pipeoff.optim import FullOffloadOptimizer


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 128, dim: int = 64) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(),
                          nn.Linear(4 * dim, dim)) for _ in range(3))
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def new_model(device: torch.device) -> TinyLM:
    torch.manual_seed(0)
    return TinyLM().to(device, torch.bfloat16)


def loss_of(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1]).float()
    return nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


CLIP = "loop"
"""Where the gradients are clipped: ``"loop"`` (torch's call on ``model.parameters()``)
or ``"optimizer"`` (``max_norm``)."""


def optimizer(model: nn.Module, fraction: float | str,
              budget: int | None = None) -> FullOffloadOptimizer:
    extra = {} if budget is None else {"device_budget_bytes": budget}
    return FullOffloadOptimizer(model, torch.optim.AdamW, lr=3e-3, weight_decay=0.1,
                                max_norm=0.4 if CLIP == "optimizer" else None,
                                offload_fraction=fraction, **extra)


def fraction_arg(text: str) -> float | str:
    return text if text == "auto" else float(text)


def train(model: nn.Module, opt: FullOffloadOptimizer, data: list[list[torch.Tensor]],
          first: int, verbose: bool) -> None:
    for step, micro_batches in enumerate(data, start=first):
        total = 0.0
        for i, batch in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            with contextlib.nullcontext() if last else opt.no_sync():
                loss = loss_of(model, batch) / len(micro_batches)
                loss.backward()
            total += loss.item()
        if CLIP == "loop":
            # Both parts' FP32 sums: the norm over all of them, the coefficient on all.
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.4)
        opt.step()  # returns once the host part's chunks are launched
        opt.zero_grad()
        if CLIP == "optimizer":
            norm = opt.grad_norm
        if verbose:
            print(f"step {step} grad norm {float(norm):.4f} loss {total:.4f}")
    opt.wait_for_step()


def describe(stats: dict[str, int]) -> str:
    host = stats["master_bytes_host"] + stats["state_bytes_host"] + stats["grad_sum_bytes_host"]
    device = stats["master_bytes_device"] + stats["state_bytes_device"]
    return (f"{host / 2**10:.0f} KiB of masters, state and sums in host memory "
            f"({stats['params_host']} params), {device / 2**10:.0f} KiB on the device "
            f"({stats['params_device']} params)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="steps before the restart")
    parser.add_argument("--resume-steps", type=int, default=3, help="steps after it")
    parser.add_argument("--fraction", type=fraction_arg, default=0.5,
                        help="a number in [0, 1], or auto")
    parser.add_argument("--device-budget-bytes", type=int, default=None,
                        help="with --fraction auto: the device part's budget")
    parser.add_argument("--resume-fraction", type=float, default=0.0)
    parser.add_argument("--clip", choices=("loop", "optimizer"), default="loop",
                        help="clip in the loop (torch's call) or in the optimizer (max_norm)")
    args = parser.parse_args()
    global CLIP
    CLIP = args.clip
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 128, (8, 33), generator=g).to(device) for _ in range(2)]
    data = [[batches[0], batches[1]] for _ in range(args.steps + args.resume_steps)]

    model = new_model(device)
    budget = args.device_budget_bytes
    if args.fraction == "auto" and budget is None and device.type != "cuda":
        budget = 16 * sum(p.numel() for p in model.parameters()) // 2  # AdamW: 16 B each
    opt = optimizer(model, args.fraction, budget if args.fraction == "auto" else None)
    if opt.offload_choice is not None:
        print(f"auto: {opt.offload_choice.reason}")
    train(model, opt, data[:args.steps], 0, verbose=True)
    print(f"offload_fraction={opt.offload_fraction:.4g}: {describe(opt.memory_stats())}")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "checkpoint.pt"
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, path)
        # The job restarts with another fraction (say, on a device with more memory).
        ckpt = torch.load(path, weights_only=True)
    model = new_model(device)
    model.load_state_dict(ckpt["model"])
    opt = optimizer(model, args.resume_fraction)
    opt.load_state_dict(ckpt["optim"])
    train(model, opt, data[args.steps:], args.steps, verbose=True)
    print(f"resumed at offload_fraction={args.resume_fraction}: "
          f"{describe(opt.memory_stats())}")

    ref = new_model(device)
    train(ref, optimizer(ref, 1.0), data, 0, verbose=False)
    same = all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    print(f"bitwise equal to offload_fraction=1.0 over {len(data)} steps: {same}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
