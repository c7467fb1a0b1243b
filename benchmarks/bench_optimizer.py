"""Training-step time of plain AdamW against OffloadOptimizer's three modes, on the CPU.

    python benchmarks/bench_optimizer.py [--layers 8] [--width 1024] [--batch 64]
        [--chunk-mb 8] [--iters 3] [--repeats 7] [--inner both|for-loop|fused]
        [--fractions 0,0.25,0.5,0.75,1 [--modes chunked,overlap]]

With ``--fractions``, the variants are plain AdamW and, per mode of ``--modes``,
one per ``offload_fraction``: the step time against the share of the state kept
in host memory (min/median/max over the interleaved rounds), with where the state
is (``memory_stats()``).

One process, one model per variant, same data, timed round-robin (each round
runs every variant once). Each timed run is ``--iters`` training iterations
(forward, backward, ``step()``, ``zero_grad()``); the
table reports the median time per iteration, the ratio to plain AdamW with the
same kernel (torch's for-loop default, and ``fused=True``, side by side), and
the peak device staging of the last step against ``chunk_bytes``.

On a CPU-only torch the "device" is host memory, so the copies buy nothing:
this measures pipeoff's overhead, and how much of the optimizer ``overlap``
hides behind the next forward (target: overlap <= 1.05x plain).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from _harness import Timing, measure, table  # noqa: E402

from pipeoff.optim import OffloadOptimizer  # noqa: E402


def make_model(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*mods)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--chunk-mb", type=float, default=8.0)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--inner", choices=("both", "for-loop", "fused"), default="both",
                    help="the AdamW kernel every variant uses (both: side by side)")
    ap.add_argument("--fractions", default=None,
                    help="comma-separated offload_fraction values: sweep them instead")
    ap.add_argument("--modes", default="chunked,overlap",
                    help="with --fractions: the modes to sweep (comma-separated)")
    args = ap.parse_args()
    fractions = ([float(f) for f in args.fractions.split(",")] if args.fractions
                 else [1.0])
    modes = (args.modes.split(",") if args.fractions
             else ["single_pass", "chunked", "overlap"])
    chunk = int(args.chunk_mb * 2**20)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(args.batch, args.width, generator=g) for _ in range(args.iters)]

    kernels = ("for-loop", "fused") if args.inner == "both" else (args.inner,)
    variants: dict[str, tuple[nn.Module, torch.optim.Optimizer]] = {}
    baseline: dict[str, str] = {}  # variant -> the plain AdamW with its kernel
    for kernel in kernels:
        for mode, f in [("plain AdamW", 1.0)] + [(m, f) for m in modes for f in fractions]:
            name = (f"{mode} ({kernel})" if not args.fractions or mode == "plain AdamW"
                    else f"{mode} f={f:g} ({kernel})")
            model = make_model(args.layers, args.width)
            inner = torch.optim.AdamW(model.parameters(), lr=1e-4,
                                      fused=kernel == "fused")
            if mode == "plain AdamW":
                opt: torch.optim.Optimizer = inner
            else:
                opt = OffloadOptimizer(inner, mode=mode, chunk_bytes=chunk,  # type: ignore[arg-type]
                                       offload_fraction=f)
                opt.attach(model)
            variants[name] = (model, opt)
            baseline[name] = f"plain AdamW ({kernel})"
    nparams = sum(p.numel() for p in make_model(args.layers, args.width).parameters())

    def loop(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        for x in xs:
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        if isinstance(opt, OffloadOptimizer):
            opt.wait_for_step()  # the last step counts too

    # Round-robin: each round times every variant once, so load from other
    # processes on the machine hits all variants alike.
    for model, opt in variants.values():
        loop(model, opt)  # warm-up: state, staging pools, lane threads
    times: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(args.repeats):
        for name, (model, opt) in variants.items():
            t = measure(lambda m=model, o=opt: loop(m, o), warmup=0, repeats=1,
                        label=f"round {r + 1}/{args.repeats} {name}")
            times[name].append(t.median)
    rows = []
    for name, (_, opt) in variants.items():
        ts = sorted(times[name])
        t = Timing(statistics.median(ts), ts[0], ts[-1], len(ts))
        per_iter = t.median / args.iters * 1e3
        base = statistics.median(times[baseline[name]]) / args.iters * 1e3
        staging = "-"
        chunks = "-"
        if isinstance(opt, OffloadOptimizer) and opt.mode == "single_pass":
            staging = "all state (no staging bound)"
            chunks = "1 (all)"
        elif isinstance(opt, OffloadOptimizer):
            tr = opt.last_trace
            assert tr is not None
            peak = tr.summary().peak_device_staging_bytes
            staging = f"{peak / 2**20:.1f} MiB ({peak / chunk:.2f}x chunk)"
            chunks = str(len(opt.plan.chunks))
        where = "-"
        if isinstance(opt, OffloadOptimizer):
            ms = opt.memory_stats()
            where = (f"{ms['state_bytes_device'] / 2**20:.1f} / "
                     f"{ms['state_bytes_host'] / 2**20:.1f}")
        row = [name, f"{per_iter:.1f}", f"{per_iter / base:.2f}x",
               f"{t.min / args.iters * 1e3:.1f}-{t.max / args.iters * 1e3:.1f}"]
        rows.append(row + ([where, chunks] if args.fractions else [chunks, staging]))
    print(f"model: {args.layers}x Linear({args.width}, {args.width}) = "
          f"{nparams / 1e6:.1f}M params, "
          f"AdamW state {nparams * 8 / 2**20:.0f} MiB, batch {args.batch}, "
          f"chunk_bytes {args.chunk_mb:g} MiB, torch threads {torch.get_num_threads()}")
    print(table(["variant", "ms/iter (median)", "vs plain (same kernel)", "range ms (min-max)"]
                + (["state MiB device / host", "chunks"] if args.fractions
                   else ["chunks", "peak device staging"]), rows))


if __name__ == "__main__":
    main()
