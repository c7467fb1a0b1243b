"""The host side of full offload's final micro-step, its alternatives side by side (CPU).

Per parameter: an FP32 master, two AdamW moments, the FP32 gradient sum of the
earlier micro-steps, the last micro-step's BF16 gradient, and the BF16 weight
buffer the step casts into. All variants run in one process on the same
tensors, in interleaved rounds (A B C ... A B C ...), at each thread count:

* ``floor``: the in-place memory stream (``a[i] *= s``, native, 8 bytes per
  element), scaled to the 32 bytes per parameter a one-pass final micro-step
  moves at least;
* ``fused AdamW``: torch's fused CPU AdamW alone on ready FP32 gradients (28 B);
* ``pipeoff one pass``: what FullOffloadOptimizer runs with ``fused=True`` when the
  final backward is marked and nothing needs the norm before the step (the
  default there, issue 35): the last BF16 gradient held until the step and folded
  inside the native AdamW + cast, which takes the logged norm in the same pass
  (``adam_step(last_grad=..., sumsq=True)``); 32 B;
* ``one pass, one backward``: the same for a step of one backward
  (``gradient_accumulation_steps=1``): no earlier FP32 sum to read (28 B, fused
  AdamW's own bytes, and the cast);
* ``pipeoff clip``: the same with clipping: the native fold of the last gradient
  taking torch's norm of the sum in its pass (``fold_norm``, 10 B), then the
  native step scaled by the clip coefficient + cast (30 B); 40 B;
* ``pipeoff``: the previous path (still what runs when the final backward is not
  marked): the native fold (10 B), torch's norm of the sum (4 B), then the native
  step + cast (30 B); 44 B;
* ``pipeoff kernels``: that without the norm (40 B);
* ``pipeoff step+cast``: the native step and cast alone (30 B), beside fused AdamW;
* ``one pass (kernel)``: the fold-step kernel without the norm (32 B);
* ``three passes``: torch's path (the fold in 256K pieces, the norm, the fused
  AdamW kernel through the chunk step, the cast): 48 B;
* ``naive``: prime-rl/torchao style: a whole-tensor mixed-dtype add, one fused
  AdamW per parameter, a whole-tensor cast (44 B, and a temporary).

And the non-final micro-step's fold alone (10 B per parameter): the floor, the
native fold, torch's fold in 256K pieces (today's fallback), a whole-tensor add.

With ``--load`` it measures everything again with a CPU-bound process busy on
every core (the dataloader workers of a training host) and reports loaded/quiet.

    python benchmarks/bench_host_step.py --numel 33554432 --params 8 --rounds 7 --load
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import competing_load, table  # noqa: E402

BYTES = {"floor": 32, "fused AdamW": 28, "pipeoff one pass": 32,
         "one pass, one backward": 28, "pipeoff clip": 40,
         "pipeoff": 44, "pipeoff kernels": 40,
         "pipeoff step+cast": 30, "one pass (kernel)": 32,
         "three passes": 48, "naive": 44,
         "fold floor": 10, "fold: native": 10, "fold: torch pieces": 10, "fold: whole add": 10}
"""Logical bytes per parameter each variant moves (the floors: the one-pass minimum)."""


def build(total: int, params: int) -> dict[str, dict[str, Callable[[int], None]]]:
    from pipeoff import _native
    from pipeoff.optim import _update
    from pipeoff.optim._full_offload import _accumulate, _fold_norm, _host_kernel

    kernel = _host_kernel.host_kernel()
    lib = _native.library()
    if kernel is None or lib is None:
        raise SystemExit(f"no native kernel here: {_host_kernel.unavailable_reason()}")
    n = total // params
    gen = torch.Generator().manual_seed(0)
    masters = [torch.randn(n, generator=gen) for _ in range(params)]
    sums = [torch.randn(n, generator=gen) * 1e-3 for _ in range(params)]
    grads = [(torch.randn(n, generator=gen) * 1e-3).to(torch.bfloat16) for _ in range(params)]
    weights = [torch.empty(n, dtype=torch.bfloat16) for _ in range(params)]
    exp_avg = [torch.randn(n, generator=gen) * 1e-4 for _ in range(params)]
    exp_avg_sq = [torch.rand(n, generator=gen) * 1e-8 for _ in range(params)]
    floor_buf = torch.randn(4 * total, generator=gen)  # 32 B per parameter, in FP32 elements
    lr, wd = 1e-4, 0.1
    hyper = _host_kernel.AdamHyper(lr=lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=wd,
                                   decoupled=True, maximize=False)
    group = {"lr": lr, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": wd,
             "amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
             "differentiable": False, "fused": True, "decoupled_weight_decay": True}
    probe = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=lr, weight_decay=wd,
                              fused=True)
    steps = [torch.tensor(1.0) for _ in range(params)]
    naive_opts = [torch.optim.AdamW([m], lr=lr, weight_decay=wd, fused=True) for m in masters]

    def floor(t: int) -> None:
        # 4 * total elements, read and written: 32 bytes per parameter.
        lib.pipeoff_scale(floor_buf.data_ptr(), floor_buf.numel(), 1.0, t)

    def fused_alone(t: int) -> None:
        torch.set_num_threads(t)
        torch._fused_adamw_(masters, sums, exp_avg, exp_avg_sq, [], steps, lr=lr, beta1=0.9,
                            beta2=0.999, weight_decay=wd, eps=1e-8, amsgrad=False,
                            maximize=False)

    def pipeoff_kernels(t: int) -> None:
        for s, g in zip(sums, grads):
            _host_kernel.fold(s, g, first=False, threads=t)
        for m, s, a, v, w in zip(masters, sums, exp_avg, exp_avg_sq, weights):
            kernel.adam_step(m, s, a, v, w, hyper, step=1.0, scale=None, threads=t)

    def step_cast(t: int) -> None:
        for m, s, a, v, w in zip(masters, sums, exp_avg, exp_avg_sq, weights):
            kernel.adam_step(m, s, a, v, w, hyper, step=1.0, scale=None, threads=t)

    def one_pass(t: int) -> None:
        for m, s, g, a, v, w in zip(masters, sums, grads, exp_avg, exp_avg_sq, weights):
            kernel.adam_step(m, s, a, v, w, hyper, step=1.0, scale=None, threads=t,
                             last_grad=g)

    def pipeoff_one_pass(t: int) -> None:
        for m, s, g, a, v, w in zip(masters, sums, grads, exp_avg, exp_avg_sq, weights):
            kernel.adam_step(m, s, a, v, w, hyper, step=1.0, scale=None, threads=t,
                             last_grad=g, sumsq=True)

    def one_backward(t: int) -> None:
        for m, g, a, v, w in zip(masters, grads, exp_avg, exp_avg_sq, weights):
            kernel.adam_step(m, None, a, v, w, hyper, step=1.0, scale=None, threads=t,
                             last_grad=g, sumsq=True)

    def pipeoff_clip(t: int) -> None:
        norms = []
        for s, g in zip(sums, grads):
            norm = _fold_norm.fold_norm(s, g, first=False, threads=t,
                                        lanes=_fold_norm.new_lanes(), offset=0,
                                        total=s.numel(), last=True)
            assert isinstance(norm, torch.Tensor), "no fold with the norm here"
            norms.append(norm)
        total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
        clip = float(torch.clamp(1.0 / (total + 1e-6), max=1.0))
        for m, s, a, v, w in zip(masters, sums, exp_avg, exp_avg_sq, weights):
            kernel.adam_step(m, s, a, v, w, hyper, step=1.0, scale=clip, threads=t)

    def pipeoff(t: int) -> None:
        torch.set_num_threads(t)
        for s, g in zip(sums, grads):
            _host_kernel.fold(s, g, first=False, threads=t)
            _accumulate.norm(s)
        for m, s, a, v, w in zip(masters, sums, exp_avg, exp_avg_sq, weights):
            kernel.adam_step(m, s, a, v, w, hyper, step=1.0, scale=None, threads=t)

    def three(t: int) -> None:
        torch.set_num_threads(t)
        for s, g in zip(sums, grads):
            _accumulate.fold(s, g, first=False)
            _accumulate.norm(s)
        cg = _update.ChunkGroup(group, masters, sums,
                                [{"exp_avg": a, "exp_avg_sq": v} for a, v in zip(exp_avg,
                                                                                 exp_avg_sq)],
                                [("exp_avg", "exp_avg_sq")] * params,
                                [{"step": s} for s in steps])
        _update.step_chunk(_update.make_shadow(probe), [cg])
        for w, m in zip(weights, masters):
            _accumulate.cast_into(w, m)

    def naive(t: int) -> None:
        torch.set_num_threads(t)
        for m, s, g, opt, w in zip(masters, sums, grads, naive_opts, weights):
            s.add_(g)  # whole-tensor mixed-dtype add (an FP32 temporary of g)
            m.grad = s
            opt.step()
            m.grad = None
            w.copy_(m)

    fold_buf = torch.randn(10 * total // 8, generator=gen)  # 10 B per parameter

    def fold_floor(t: int) -> None:
        lib.pipeoff_scale(fold_buf.data_ptr(), fold_buf.numel(), 1.0, t)

    def fold_native(t: int) -> None:
        for s, g in zip(sums, grads):
            _host_kernel.fold(s, g, first=False, threads=t)

    def fold_torch(t: int) -> None:
        torch.set_num_threads(t)
        for s, g in zip(sums, grads):
            _accumulate.fold(s, g, first=False)

    def fold_whole(t: int) -> None:
        torch.set_num_threads(t)
        for s, g in zip(sums, grads):
            s.add_(g)

    step_variants = {"floor": floor, "fused AdamW": fused_alone,
                     "pipeoff one pass": pipeoff_one_pass, "one pass, one backward":
                     one_backward, "pipeoff clip": pipeoff_clip,
                     "pipeoff": pipeoff,
                     "pipeoff kernels": pipeoff_kernels, "pipeoff step+cast": step_cast,
                     "one pass (kernel)": one_pass,
                     "three passes": three, "naive": naive}
    fold_variants = {"fold floor": fold_floor, "fold: native": fold_native,
                     "fold: torch pieces": fold_torch, "fold: whole add": fold_whole}
    return {"step": step_variants, "fold": fold_variants}  # type: ignore[return-value]


def rounds(variants: dict[str, Callable[[int], None]], threads: int,
           n: int) -> dict[str, list[float]]:
    """Seconds per variant per round, the variants interleaved within each round."""
    times: dict[str, list[float]] = {k: [] for k in variants}
    for fn in variants.values():
        fn(threads)  # warm-up
    for _ in range(n):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn(threads)
            times[name].append(time.perf_counter() - t0)
    return times


def mmm(xs: list[float], fmt: str = "{:.2f}") -> str:
    return "/".join(fmt.format(x) for x in (min(xs), statistics.median(xs), max(xs)))


def report(total: int, threads: int, load: str, times: dict[str, list[float]],
           floor_name: str, base_name: str | None) -> list[list[str]]:
    """Per variant: its time; its logical bandwidth; the floor's time over its time (the
    one-pass minimum's share it reaches); its time over ``base_name``'s; each
    min/median/max over the rounds (a ratio within a round, then over rounds)."""
    rows = []
    floor = times[floor_name]
    base = times[base_name] if base_name else None
    for name, ts in times.items():
        gbs = [BYTES[name] * total / t / 1e9 for t in ts]
        x_floor = [f / t for f, t in zip(floor, ts)]
        x_base = mmm([t / b for b, t in zip(base, ts)]) if base else "-"
        rows.append([str(threads), load, name, mmm([t * 1e3 for t in ts], "{:.1f}"),
                     f"{statistics.median(gbs):.1f}", mmm(x_floor), x_base])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=32 << 20, help="parameters in all")
    parser.add_argument("--params", type=int, default=8, help="tensors they are split into")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, nargs="*", default=[1, 2])
    parser.add_argument("--load", action="store_true",
                        help="measure again with a CPU-bound process on every core")
    args = parser.parse_args()
    total = args.numel // args.params * args.params
    groups = build(total, args.params)
    cpus = len(os.sched_getaffinity(0))
    print(f"{total / 1e6:.1f}M parameters in {args.params} tensors, {args.rounds} interleaved "
          f"rounds; torch {torch.__version__}, dispatch level "
          f"{torch.backends.cpu.get_cpu_capability()}, {cpus} CPUs")
    loads = [("quiet", 0)] + ([(f"{cpus} busy procs", cpus)] if args.load else [])
    rows: dict[str, list[list[str]]] = {"step": [], "fold": []}
    medians: dict[tuple[str, int, str], float] = {}
    for label, procs in loads:
        with competing_load(procs) if procs else contextlib.nullcontext():
            for t in args.threads:
                for kind, variants in groups.items():
                    times = rounds(variants, t, args.rounds)
                    floor_name, base = (("floor", "fused AdamW") if kind == "step"
                                        else ("fold floor", None))
                    rows[kind] += report(total, t, label, times, floor_name, base)
                    for name, ts in times.items():
                        medians[(label, t, name)] = statistics.median(ts)
    torch.set_num_threads(cpus)
    print("\nThe final micro-step (floor: 32 B per parameter at the in-place stream's rate)")
    print(table(["threads", "load", "variant", "ms min/med/max", "GB/s (logical, median)",
                 "x one-pass floor min/med/max", "x fused AdamW time min/med/max"],
                rows["step"]))
    print("\nThe fold of a non-final micro-step (floor: 10 B per parameter)")
    print(table(["threads", "load", "variant", "ms min/med/max", "GB/s (logical, median)",
                 "x floor min/med/max", "-"], rows["fold"]))
    if args.load:
        print()
        lrows = []
        for t in args.threads:
            for variants in groups.values():
                for name in variants:
                    q = medians[("quiet", t, name)]
                    b = medians[(loads[1][0], t, name)]
                    lrows.append([str(t), name, f"{q * 1e3:.1f}", f"{b * 1e3:.1f}",
                                  f"{b / q:.2f}x"])
        print(table(["threads", "variant", "quiet ms (median)", "loaded ms (median)",
                     "loaded / quiet"], lrows))


if __name__ == "__main__":
    main()
