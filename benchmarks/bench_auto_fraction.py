"""``offload_fraction="auto"`` checked against the step times it predicts.

    python benchmarks/bench_auto_fraction.py [--layers 8] [--width 4096]
        [--budget-share 0.5] [--rounds 3] [--device cuda|cpu] [--optimizer offload|full]

Model: ``--layers`` x Linear(width, width) in fp32 (AdamW: 8 B of state per
parameter). ``OffloadOptimizer(mode="chunked", offload_fraction="auto",
device_budget_bytes=share x the state)`` measures its rates (pinned copies each
way, the device's AdamW step) and chooses; this script then times a chunked
``step()`` (synchronized) at the fractions 0, 0.25, 0.5, 0.75, 1 and the chosen
one, in interleaved rounds, beside the model's prediction for each, and says
whether the chosen fraction is the fastest measured one within the budget. The
rates (GB/s, elements/s) and the choice are what the first lent GPU checks
(``gpu_suite.py``).

``--optimizer full``: the same for ``FullOffloadOptimizer`` (BF16 weights; the
device part holds FP32 masters, AdamW state and gradient sums: 16 B a parameter,
the budget a share of that), one model copy per fraction (each optimizer owns its
model's weights), gradients set in ``param.grad`` before each timed
``step()`` with ``overlap="none"`` (the whole step, both parts, in the timing).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from _harness import table  # noqa: E402

from pipeoff.optim import FullOffloadOptimizer, OffloadOptimizer  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--budget-share", type=float, default=0.5,
                    help="device budget as a share of the AdamW state (default 0.5)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--optimizer", choices=("offload", "full"), default="offload")
    args = ap.parse_args()
    dev = torch.device(args.device)
    if args.optimizer == "full":
        return full(args, dev)

    torch.manual_seed(0)
    with torch.device(dev):
        model = nn.Sequential(*[nn.Linear(args.width, args.width, bias=False)
                                for _ in range(args.layers)])
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    state = 8 * sum(p.numel() for p in model.parameters())
    budget = int(args.budget_share * state)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    auto = OffloadOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4), mode="chunked",
                            offload_fraction="auto", device_budget_bytes=budget)
    choice = auto.offload_choice
    assert choice is not None
    print(f"device {dev}: {args.layers} x {args.width}^2 fp32, AdamW state {state / 2**20:.0f} "
          f"MiB, budget {budget / 2**20:.0f} MiB")
    report_rates(choice)
    opts = {c.fraction: auto if c.fraction == choice.fraction else OffloadOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-4), mode="chunked",
        offload_fraction=c.fraction, chunk_bytes=choice.chunk_bytes, prefetch=choice.prefetch)
        for c in choice.candidates}
    times = timed({f: opt.step for f, opt in opts.items()}, sync, args.rounds)
    report(choice, times)
    return 0


def report_rates(choice: Any) -> None:
    r = choice.rates
    print(f"measured: H2D {r.h2d_bytes_per_s / 1e9:.1f} GB/s, D2H {r.d2h_bytes_per_s / 1e9:.1f} "
          f"GB/s, device step {r.step_elements_per_s / 1e9:.2f} G elements/s"
          + (f", host step {r.host_step_elements_per_s / 1e9:.2f} G elements/s"
             if r.host_step_elements_per_s else ""))
    print(f"auto chose {choice.reason}")


def timed(steps: dict[float, Callable[[], Any]], sync: Callable[[], None],
          rounds: int) -> dict[float, list[float]]:
    """Milliseconds of each step, in interleaved rounds after one warm-up step each (the
    state is created, the pools filled)."""
    times: dict[float, list[float]] = {f: [] for f in steps}
    for step in steps.values():
        step()
    for _ in range(rounds):
        for f, step in steps.items():
            sync()
            t0 = time.perf_counter()
            step()
            sync()
            times[f].append(1e3 * (time.perf_counter() - t0))
    return times


def full(args: argparse.Namespace, dev: torch.device) -> int:
    """``--optimizer full``: FullOffloadOptimizer's auto against its measured steps."""
    def net() -> nn.Module:
        torch.manual_seed(0)
        with torch.device(dev):
            return nn.Sequential(*[nn.Linear(args.width, args.width, bias=False)
                                   for _ in range(args.layers)]).to(torch.bfloat16)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    numel = args.layers * args.width * args.width
    budget = int(args.budget_share * 16 * numel)
    kw: dict[str, Any] = {"lr": 1e-4, "overlap": "none"}
    auto_model = net()
    auto = FullOffloadOptimizer(auto_model, torch.optim.AdamW, offload_fraction="auto",
                                device_budget_bytes=budget, **kw)
    choice = auto.offload_choice
    assert choice is not None
    print(f"device {dev}: {args.layers} x {args.width}^2 bf16, masters + state + sums "
          f"{16 * numel / 2**20:.0f} MiB, budget {budget / 2**20:.0f} MiB")
    report_rates(choice)
    pairs = {}
    for c in choice.candidates:
        if c.fraction == choice.fraction:
            pairs[c.fraction] = (auto_model, auto)
        else:
            m = net()
            pairs[c.fraction] = (m, FullOffloadOptimizer(m, torch.optim.AdamW,
                                                         offload_fraction=c.fraction, **kw))

    def stepper(model: nn.Module, opt: FullOffloadOptimizer) -> Callable[[], None]:
        def step() -> None:
            for p in model.parameters():
                p.grad = torch.full_like(p, 1e-3)  # (set by hand: this step's gradients)
            opt.step()
            opt.wait_for_step()
        return step

    times = timed({f: stepper(m, o) for f, (m, o) in pairs.items()}, sync, args.rounds)
    report(choice, times)
    return 0


def report(choice: Any, times: dict[float, list[float]]) -> None:
    rows = []
    for c in choice.candidates:
        ts = times[c.fraction]
        rows.append([f"{c.fraction:.3g}" + (" (auto)" if c.fraction == choice.fraction else ""),
                     f"{c.device_bytes / 2**20:.1f}", "yes" if c.fits else "no",
                     f"{c.step_ms:.2f}", f"{min(ts):.2f}", f"{statistics.median(ts):.2f}",
                     f"{max(ts):.2f}", f"{statistics.median(ts) / c.step_ms:.2f}"])
    print(table(["fraction", "device MiB", "fits", "predicted ms", "min ms", "median ms",
                 "max ms", "measured/predicted"], rows))
    fits = [c.fraction for c in choice.candidates if c.fits]
    best = min(fits, key=lambda f: statistics.median(times[f]))
    print(f"fastest measured within the budget: {best:.3g} "
          f"({statistics.median(times[best]):.2f} ms); auto's: {choice.fraction:.3g} "
          f"({statistics.median(times[choice.fraction]):.2f} ms, "
          f"{statistics.median(times[choice.fraction]) / statistics.median(times[best]):.2f}x)")


if __name__ == "__main__":
    raise SystemExit(main())
