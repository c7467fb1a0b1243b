"""FullOffloadOptimizer on one GPU, side by side with no offload and a naive offloader.

    python benchmarks/gpu_full_offload.py [--quick] [--layers 16] [--width 4096]
        [--micro 1 4 8] [--iters 3] [--out /tmp/gpu_full_offload.md]

Model: ``--layers`` x Linear(width, width) in BF16 (default 268M parameters),
a small batch so the optimizer and the transfers dominate. Setups:

* ``no offload``: FP32 parameters on the GPU, BF16 autocast, fused AdamW on
  the GPU (16 bytes per parameter of HBM);
* ``naive``: BF16 weights on the GPU; after each backward, every gradient is
  copied to the host synchronously and added to an FP32 sum; after the last,
  one CPU AdamW per parameter and a synchronous copy back (torchao's style);
* ``cpu`` / ``gpu``: ``FullOffloadOptimizer(accumulate=..., overlap="backward")``;
* ``forward+clip``: ``accumulate="cpu", overlap="forward", max_norm=1.0`` with
  ``attach()``.

For each, at 1, 4 and 8 micro-steps (``--micro``): step time (all micro-steps
and the step, synchronized, median of ``--iters``), peak HBM allocated, pinned
host bytes, PCIe bytes per step against the link's measured bandwidth, and the
exposed drain: from the end of the last backward (synchronized) to the step's
end. Budget: under 6 minutes on an H200; ``--quick`` uses 4 layers and 2
iterations. Without a CUDA device it says so and exits with code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from _harness import table  # noqa: E402

SETUPS = ("no offload", "naive", "cpu", "gpu", "forward+clip")


def link_gbps(nbytes: int = 1 << 30) -> float:
    """GB/s of pinned device -> host copies (the direction gradients take)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host.copy_(dev, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        host.copy_(dev, non_blocking=True)
    torch.cuda.synchronize()
    return 3 * nbytes / (time.perf_counter() - t0) / 1e9


def make_model(layers: int, width: int, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    with torch.device("cuda"):
        return nn.Sequential(*[nn.Linear(width, width, bias=False)
                               for _ in range(layers)]).to(dtype)


class Naive:
    """The naive baseline: synchronous copies, per-parameter CPU optimizers."""

    def __init__(self, model: nn.Module) -> None:
        self.params = list(model.parameters())
        self.masters = [p.detach().float().cpu().requires_grad_(True) for p in self.params]
        self.opts = [torch.optim.AdamW([m], lr=1e-5, fused=True) for m in self.masters]
        self.acc: list[torch.Tensor | None] = [None] * len(self.params)

    def after_backward(self) -> None:
        for k, p in enumerate(self.params):
            g = p.grad.float().cpu()  # type: ignore[union-attr]  # synchronous
            self.acc[k] = g if self.acc[k] is None else self.acc[k].add_(g)  # type: ignore[union-attr]
            p.grad = None

    def step(self) -> None:
        for p, m, opt, a in zip(self.params, self.masters, self.opts, self.acc):
            m.grad = a
            opt.step()
            with torch.no_grad():
                p.copy_(m.to(p.dtype))  # synchronous copy back
        self.acc = [None] * len(self.params)


def run(setup: str, micro: int, args: argparse.Namespace, gbps: float) -> list[object]:
    from pipeoff.optim import FullOffloadOptimizer

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    fp32 = setup == "no offload"
    model = make_model(args.layers, args.width, torch.float32 if fp32 else torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    x = torch.randn(args.batch, args.width, device="cuda")
    opt: Any = None
    naive = None
    pinned = 0
    if setup == "no offload":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    elif setup == "naive":
        naive = Naive(model)
    else:
        kw: dict[str, Any] = {"accumulate": "gpu" if setup == "gpu" else "cpu",
                              "overlap": "forward" if setup == "forward+clip" else "backward"}
        if setup == "forward+clip":
            kw["max_norm"] = 1.0
        opt = FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-5, fused=True, **kw)
        opt.attach()
        pinned = 16 * n + opt.host_budget_bytes

    def forward_backward(last: bool) -> None:
        ctx = (opt.no_sync() if (not last and isinstance(opt, FullOffloadOptimizer))
               else contextlib.nullcontext())
        with ctx:
            if fp32:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    y = model(x)
            else:
                y = model(x.to(torch.bfloat16))
            y.float().pow(2).mean().backward()
        if naive is not None:
            naive.after_backward()

    def iteration() -> tuple[float, float]:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for k in range(micro):
            forward_backward(k == micro - 1)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        if naive is not None:
            naive.step()
        else:
            opt.step()
            if isinstance(opt, FullOffloadOptimizer):
                opt.wait_for_step()
            opt.zero_grad()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        return t2 - t0, t2 - t1

    for _ in range(2):
        iteration()
    torch.cuda.reset_peak_memory_stats()
    times = [iteration() for _ in range(args.iters)]
    step_s = statistics.median(t for t, _ in times)
    drain_s = statistics.median(d for _, d in times)
    peak = torch.cuda.max_memory_allocated() / 2**30
    if setup == "no offload":
        pcie = 0
    elif setup == "gpu":
        pcie = n * (4 + 2)
    else:
        pcie = n * (2 * micro + 2) if setup != "naive" else n * (4 * micro + 2)
    return [setup, micro, f"{step_s * 1e3:.1f}", f"{peak:.2f}", f"{pinned / 2**30:.2f}",
            f"{pcie / 2**30:.2f}", f"{pcie / step_s / 1e9:.1f} / {gbps:.1f}",
            f"{drain_s * 1e3:.1f}"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--micro", type=int, nargs="*", default=[1, 4, 8])
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_full_offload: no CUDA device here; run it on a machine with a GPU",
              file=sys.stderr)
        return 2
    if args.quick:
        args.layers, args.iters = 4, 2
    gbps = link_gbps()
    rows = []
    for micro in args.micro:
        for setup in SETUPS:
            rows.append(run(setup, micro, args, gbps))
            gc.collect()  # the setup's model, optimizer and pinned state
    text = (f"{args.layers} x Linear({args.width}, {args.width}), BF16 compute, batch "
            f"{args.batch}; {torch.cuda.get_device_name()}\n\n"
            + table(["setup", "micro-steps", "step ms", "peak HBM GiB", "pinned GiB",
                     "PCIe GiB/step", "PCIe GB/s used / link", "drain ms"], rows) + "\n")
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
