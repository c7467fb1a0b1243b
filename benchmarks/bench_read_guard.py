"""Cost of overlap mode's read guard on an eager forward made of many small ops.

    python benchmarks/bench_read_guard.py [--layers 24] [--width 64] [--batch 8]
        [--iters 5] [--repeats 9]

The read guard (a ``TorchFunctionMode``, see ``pipeoff/optim/_waits.py``) sees
every torch function of the forward that follows an overlap ``step()`` until
every chunk has been waited for. Its cost is Python per op, so it shows most on
a small model with many small ops, where the CPU issues ops faster than they
run. One process, round-robin over the variants:

* ``plain AdamW``: the baseline;
* ``overlap, hooks only``: ``OffloadOptimizer(mode="overlap")`` attached, with
  the guard switched off (``pipeoff.testing.disable("read_guard")``);
* ``overlap, hooks + guard``: the default.

Reports ms per training iteration and the ratios, and the guard's cost per
torch function call (the difference over the ops of one forward).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(Path(__file__).parent))
from _harness import measure, table  # noqa: E402

import pipeoff.testing  # noqa: E402
from pipeoff.optim import OffloadOptimizer  # noqa: E402


class _Count(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.n += 1
        return func(*args, **(kwargs or {}))


def make_model(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.LayerNorm(width), nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*mods)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(args.batch, args.width, generator=g) for _ in range(args.iters)]
    variants = {}
    for name in ("plain AdamW", "overlap, hooks only", "overlap, hooks + guard"):
        model = make_model(args.layers, args.width)
        inner = torch.optim.AdamW(model.parameters(), lr=1e-4)
        opt: torch.optim.Optimizer = inner
        if name != "plain AdamW":
            opt = OffloadOptimizer(inner, mode="overlap", chunk_bytes=64 << 10)
            opt.attach(model)
        ctx = (lambda: pipeoff.testing.disable("read_guard")) if "only" in name else (
            contextlib.nullcontext)
        variants[name] = (model, opt, ctx)

    def loop(model: nn.Module, opt: torch.optim.Optimizer, ctx) -> None:  # type: ignore[no-untyped-def]
        with ctx():
            for x in xs:
                model(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
            if isinstance(opt, OffloadOptimizer):
                opt.wait_for_step()

    for v in variants.values():
        loop(*v)
    times: dict[str, list[float]] = {n: [] for n in variants}
    for r in range(args.repeats):
        for name, v in variants.items():
            t = measure(lambda v=v: loop(*v), warmup=0, repeats=1,
                        label=f"round {r + 1}/{args.repeats} {name}")
            times[name].append(t.median / args.iters)
    counter = _Count()
    with counter, torch.no_grad():
        variants["plain AdamW"][0](xs[0])
    ops = counter.n
    med = {n: statistics.median(ts) for n, ts in times.items()}
    base = med["plain AdamW"]
    rows = [[n, f"{med[n] * 1e3:.2f}", f"{med[n] / base:.3f}x",
             f"{min(times[n]) * 1e3:.2f}-{max(times[n]) * 1e3:.2f}"] for n in variants]
    print(f"model: {args.layers}x (LayerNorm, Linear({args.width}, {args.width}), GELU), "
          f"batch {args.batch}; {ops} torch functions per forward; torch threads "
          f"{torch.get_num_threads()}")
    print(table(["variant", "ms/iter (median)", "vs plain", "range ms"], rows))
    bare, guarded = per_call_cost()
    print(f"per torch function (a tiny add, 20k calls, median of 7): bare {bare * 1e6:.2f} us, "
          f"with the armed read guard {guarded * 1e6:.2f} us: +{(guarded - bare) * 1e6:.2f} us")


def per_call_cost(n: int = 20_000) -> tuple[float, float]:
    """Seconds per ``torch.add`` of two small tensors, bare and with an armed guard."""
    from pipeoff.optim._waits import ForwardWaits

    a, b = torch.zeros(4), torch.ones(4)
    waits = ForwardWaits(lambda: None)
    waits.pending = {id(torch.zeros(1)): (0,)}  # armed, on a tensor the loop never reads
    guard = waits._guard

    def loop() -> None:
        for _ in range(n):
            torch.add(a, b)

    def guarded() -> None:
        with guard:
            loop()

    bare = measure(loop, warmup=1, repeats=7).median / n
    return bare, measure(guarded, warmup=1, repeats=7).median / n


if __name__ == "__main__":
    main()
