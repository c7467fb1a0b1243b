"""Offload a fraction of the optimizer state, checkpoint, and resume at another fraction.

A small language model trains with ``OffloadOptimizer(overlap="forward",
offload_fraction=F)``: about ``F`` of the AdamW state lives in (pinned) host memory
and is stepped in chunks that overlap the next forward; the rest (the first
parameters, in param-group order) stays on the device and is stepped by torch's
own AdamW kernel on the caller's stream, at the same time. The job saves a
checkpoint (``torch.save``), restarts with another fraction, loads it and trains
on. A plain ``torch.optim.AdamW`` run of the same steps checks that the result is
bitwise the same. Prints each step's loss and where the state is
(``memory_stats()``) before and after the restart.

    python examples/offload_fraction.py --steps 4 --fraction 0.5 --resume-fraction 0.25
    python examples/offload_fraction.py --fraction auto --budget-share 0.5

``--fraction auto`` lets the optimizer choose from a device memory budget
(``--budget-share`` of the AdamW state) and prints what it chose and why.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from torch import nn

from pipeoff.optim import OffloadOptimizer


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


def loss_of(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


def adamw(model: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)


def describe(stats: dict[str, int]) -> str:
    total = stats["state_bytes_host"] + stats["state_bytes_device"]
    return (f"state {stats['state_bytes_host'] / 2**10:.0f} KiB in host memory "
            f"({stats['params_host']} params), {stats['state_bytes_device'] / 2**10:.0f} KiB "
            f"on the device ({stats['params_device']} params): "
            f"{stats['state_bytes_host'] / max(total, 1):.0%} offloaded")


def fraction(text: str) -> float | str:
    return text if text == "auto" else float(text)


def make_opt(model: nn.Module, f: float | str, budget_share: float) -> OffloadOptimizer:
    if f != "auto":
        return OffloadOptimizer(adamw(model), overlap="forward", chunk_bytes="64KiB",
                                offload_fraction=f)  # type: ignore[arg-type]
    state = 8 * sum(p.numel() for p in model.parameters())  # AdamW: two fp32 moments
    opt = OffloadOptimizer(adamw(model), overlap="forward", offload_fraction="auto",
                           device_budget_bytes=int(budget_share * state))
    print(f"auto: {opt.offload_choice.reason}")  # type: ignore[union-attr]
    return opt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="steps before the restart")
    parser.add_argument("--resume-steps", type=int, default=3, help="steps after it")
    parser.add_argument("--fraction", type=fraction, default=0.5, help="a number, or auto")
    parser.add_argument("--resume-fraction", type=fraction, default=0.25)
    parser.add_argument("--budget-share", type=float, default=0.5,
                        help="with auto: the device budget, as a share of the state")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 128, (8, 33), generator=g).to(device) for _ in range(2)]
    data = [batches[k % 2] for k in range(args.steps + args.resume_steps)]  # learnable

    torch.manual_seed(0)
    model = TinyLM().to(device)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    opt = make_opt(model, args.fraction, args.budget_share)
    opt.attach(model)
    for step, batch in enumerate(data[:args.steps]):
        loss = loss_of(model, batch)
        loss.backward()
        opt.step()  # returns at once: the chunks run under the next forward
        opt.zero_grad()
        print(f"step {step} loss {loss.item():.4f}")
    print(f"offload_fraction={args.fraction}: {describe(opt.memory_stats())}")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "checkpoint.pt"
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, path)
        # The job restarts with another fraction (say, on a device with less memory).
        ckpt = torch.load(path, weights_only=True)
    model = TinyLM().to(device)
    model.load_state_dict(ckpt["model"])
    opt = make_opt(model, args.resume_fraction, args.budget_share)
    opt.load_state_dict(ckpt["optim"])
    opt.attach(model)
    for step, batch in enumerate(data[args.steps:], start=args.steps):
        loss = loss_of(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"step {step} loss {loss.item():.4f}")
    print(f"resumed at offload_fraction={args.resume_fraction}: "
          f"{describe(opt.memory_stats())}")  # (waits for the step in flight)

    ref = TinyLM().to(device)
    ref.load_state_dict(init)
    ref_opt = adamw(ref)
    for batch in data:
        loss_of(ref, batch).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    same = all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    print(f"bitwise equal to torch.optim.AdamW over {len(data)} steps: {same}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
