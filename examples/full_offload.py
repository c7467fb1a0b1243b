"""Full offload: only BF16 weights on the device; FP32 masters, AdamW state and the
gradient sum in host memory, with gradient accumulation and clipping.

A small BF16 language model trains with 4 micro-steps per optimizer step.
``FullOffloadOptimizer`` takes each gradient to the host as the backward
finalizes it, folds it into an FP32 accumulator on a host lane, clips by the
global norm, steps AdamW on the FP32 masters in chunks, and writes the BF16
weights back while the next forward starts (``overlap="forward"``). With
``fused=True`` the host step is pipeoff's native one-pass kernel where the
machine has a C compiler (bitwise torch's fused AdamW; torch's kernels
otherwise). Prints how the host step runs, each step's loss, the last gradient
norm and the last step's trace summary.

    python examples/full_offload.py --steps 5
"""

from __future__ import annotations

import argparse
import contextlib

import torch
from torch import nn

MAX_NORM = 0.1  # this small model's norms are about 0.2: every step is clipped

class TinyLM(nn.Module):
    def __init__(self, vocab: int = 128, dim: int = 64) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(),
                          nn.Linear(4 * dim, dim)) for _ in range(2))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight  # tied embedding and output
        nn.init.normal_(self.emb.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--micro-steps", type=int, default=4)
    parser.add_argument("--trace", default=None, help="write the last step's trace here")
    args = parser.parse_args()

    from pipeoff.optim import FullOffloadOptimizer, host_step_status

    print(f"host step: {host_step_status()}")
    torch.manual_seed(0)
    model = TinyLM().to(torch.bfloat16)  # on a GPU: .cuda(); only these weights stay there
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, lr=3e-3, weight_decay=0.1, fused=True,
                               accumulate="cpu", overlap="forward", max_norm=MAX_NORM)
    opt.attach()  # each module's forward waits only for its own weights
    # Every step's figures to a logger, once the step has finished: here a list of
    # dicts; wandb.log(stats.as_dict(), step=stats.step) or TensorBoard's
    # add_scalars take the same dict.
    logged: list[dict[str, float]] = []
    opt.register_step_stats_hook(lambda stats: logged.append(stats.as_dict()))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    data = torch.Generator().manual_seed(1)
    # A learnable task: predict the next token of a fixed random sequence.
    seq = torch.randint(0, 128, (4096,), generator=data)
    for step in range(args.steps):
        total = 0.0
        for i in range(args.micro_steps):
            start = torch.randint(0, 4096 - 33, (8,), generator=data)
            tokens = torch.stack([seq[s:s + 33] for s in start.tolist()])
            last = i == args.micro_steps - 1
            with contextlib.nullcontext() if last else opt.no_sync():
                logits = model(tokens[:, :-1])
                loss = nn.functional.cross_entropy(logits.float().reshape(-1, 128),
                                                   tokens[:, 1:].reshape(-1))
                (loss / args.micro_steps).backward()
            total += loss.item() / args.micro_steps
        opt.step()  # returns at once: the chunks run while the next forward starts
        opt.zero_grad()
        sched.step()
        print(f"step {step}: loss {total:.4f}", flush=True)
    opt.wait_for_step()  # before reading the optimizer's results on this thread
    norm = float(opt.grad_norm)  # the total norm before clipping, as torch returns it
    scale = min(1.0, MAX_NORM / (norm + 1e-6))  # torch's clip_grad_norm_ coefficient
    print(f"last gradient norm {norm:.4f}, max_norm {MAX_NORM}: "
          + (f"clipped (the step used the gradients scaled by {scale:.3f})"
             if scale < 1.0 else "not clipped"))
    last = logged[-1]
    print(f"logged {len(logged)} steps' figures; the last: "
          + ", ".join(f"{k.removeprefix('pipeoff/')} {v:.3g}" for k, v in last.items()
                      if isinstance(v, (int, float)) and not isinstance(v, bool)))
    trace = opt.last_trace
    print(f"{len(opt.param_groups[0]['params'])} parameters, "
          f"{opt.host_budget_bytes / 2**20:.1f} MiB host staging budget; the last step:")
    print(trace.summary().format())
    if args.trace:
        print(f"trace written to {trace.save(args.trace)}")


if __name__ == "__main__":
    main()
