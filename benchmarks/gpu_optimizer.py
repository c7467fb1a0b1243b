"""OffloadOptimizer on one GPU: step time, memory and host-link bandwidth per mode.

    python benchmarks/gpu_optimizer.py [--quick] [--layers 24] [--width 8192]
        [--chunk-mb 512] [--iters 5] [--out /tmp/gpu_optimizer.md]

Model: ``--layers`` x Linear(width, width) in fp32 (default 1.6B parameters,
12.9 GB of AdamW state), a small batch so the optimizer dominates. For each
variant (no offload: plain AdamW on the GPU; single_pass; chunked; overlap)
it reports, over ``--iters`` timed iterations after two warm-up ones:

* iteration time (forward + backward + step + zero_grad, synchronized);
* step time (``step()`` to the end of its last chunk, synchronized);
* peak allocated and reserved GPU memory during the timed iterations;
* achieved H2D + D2H GB/s during the step (bytes of the step's copy tasks over
  the step's makespan) next to the pinned-copy bandwidth of this GPU, measured
  in the same run with 1 GiB copies each way.

Budget: under 5 minutes on an H200 (pinned allocation of the host state is
most of the set-up); ``--quick`` uses 8 layers (0.54B parameters) and 3
iterations. It needs a CUDA device: without one it says so and exits with code 2.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from _harness import table  # noqa: E402

VARIANTS = ("no offload", "single_pass", "chunked", "overlap")


def pinned_bandwidth(nbytes: int = 1 << 30) -> tuple[float, float]:
    """GB/s of one pinned host -> device copy and one device -> pinned host copy."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = []
    for dst, src in ((dev, host), (host, dev)):
        dst.copy_(src, non_blocking=True)  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(3):
            # Hazard: none; synchronize below ends the timed region.
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        out.append(3 * nbytes / (time.perf_counter() - t0) / 1e9)
    del host, dev
    return out[0], out[1]


def make_model(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    with torch.device("cuda"):
        return nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])


def run_variant(name: str, args: argparse.Namespace) -> list[object]:
    from pipeoff.optim import OffloadOptimizer

    model = make_model(args.layers, args.width)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    opt: torch.optim.Optimizer
    if name == "no offload":
        opt = inner
    else:
        opt = OffloadOptimizer(inner, mode=name, chunk_bytes=int(args.chunk_mb * 2**20))
        opt.attach(model)
    x = torch.randn(args.batch, args.width, device="cuda")

    def iteration() -> float:
        model(x).float().pow(2).mean().backward()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.step()
        if isinstance(opt, OffloadOptimizer):
            opt.wait_for_step()
        torch.cuda.synchronize()
        step_s = time.perf_counter() - t0
        opt.zero_grad()
        return step_s

    for _ in range(2):
        iteration()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step_times = []
    t0 = time.perf_counter()
    for _ in range(args.iters):
        # Overlap mode: time the loop as training sees it (step returns early),
        # and the step alone separately (step_times waits for it).
        step_times.append(iteration())
    iter_ms = (time.perf_counter() - t0) / args.iters * 1e3
    if name == "overlap":
        # The iteration above waited for each step; time the real overlapped loop too.
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        for _ in range(args.iters):
            model(x).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        opt.wait_for_step()  # type: ignore[attr-defined]
        torch.cuda.synchronize()
        iter_ms = (time.perf_counter() - t1) / args.iters * 1e3
    alloc = torch.cuda.max_memory_allocated() / 2**30
    reserved = torch.cuda.max_memory_reserved() / 2**30
    gbps = "-"
    chunks = "-"
    if isinstance(opt, OffloadOptimizer):
        tr = opt.last_trace
        if tr is not None and name != "single_pass":
            moved = sum(t.nbytes for t in tr.tasks if t.kind in ("h2d", "d2h"))
            span = tr.makespan_ns() / 1e9
            gbps = f"{moved / span / 1e9:.1f}" if span else "-"
            chunks = str(len(opt.plan.chunks))
    step_ms = sorted(step_times)[len(step_times) // 2] * 1e3
    return [name, f"{iter_ms:.0f}", f"{step_ms:.0f}", f"{alloc:.1f}", f"{reserved:.1f}",
            chunks, gbps]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--width", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--chunk-mb", type=float, default=512)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--out", type=Path, default=None, help="also write the table here")
    ap.add_argument("--quick", action="store_true", help="8 layers, 3 iterations")
    args = ap.parse_args()
    if args.quick:
        args.layers, args.iters = 8, 3
    if not torch.cuda.is_available():
        print("gpu_optimizer: no CUDA device here (torch.cuda.is_available() is False); "
              "run benchmarks/bench_optimizer.py for the CPU benchmark", file=sys.stderr)
        sys.exit(2)
    t_start = time.perf_counter()
    h2d, d2h = pinned_bandwidth()
    nparams = args.layers * args.width * args.width
    rows = []
    for name in args.variants:
        rows.append(run_variant(name, args))
        gc.collect()  # free the variant's model, grads and state before the next one
        torch.cuda.empty_cache()
        print(f"  {name} done at {time.perf_counter() - t_start:.0f}s", file=sys.stderr, flush=True)
    head = (f"{torch.cuda.get_device_name()}: {args.layers}x Linear({args.width}, {args.width}) "
            f"= {nparams / 1e9:.2f}B fp32 params, AdamW state {nparams * 8 / 1e9:.1f} GB, "
            f"chunk_bytes {args.chunk_mb:g} MiB; pinned copies: H2D {h2d:.1f} GB/s, "
            f"D2H {d2h:.1f} GB/s")
    text = head + "\n" + table(
        ["variant", "iter ms", "step ms", "peak alloc GiB", "peak reserved GiB", "chunks",
         "step H2D+D2H GB/s"], rows)
    print(text)
    print(f"total {time.perf_counter() - t_start:.0f}s", file=sys.stderr)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
