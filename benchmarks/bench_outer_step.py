"""DiLoCo's outer step on the host: pipeoff's native SGD and AdamW beside torch's (CPU).

The outer optimizers DiLoCo takes, stepping FP32 host parameters with FP32
pseudo-gradients as a sync's host step does: ``sgd`` (DiLoCo's own: lr 0.7,
momentum 0.9, Nesterov) and ``adamw`` (lr 0.7, betas (0.9, 0.95), weight decay
0.1). All variants of one optimizer run in one process on tensors of the same
values (each its own parameters and state, the pseudo-gradients shared), in
interleaved rounds (A B C D A B C D ...), at each thread count:

* ``floor``: the in-place memory stream (``a[i] *= s``, native, 8 bytes per
  element) over as many bytes as the native step moves: SGD 20 per parameter
  (read the gradient, read and write the buffer and the parameter), AdamW 44
  (moments 20, torch's square root of the second moment 8, the update 16);
* ``native``: what DiLoCo's host outer step runs (``pipeoff_sgd_step``; for
  AdamW ``pipeoff_adam_moments``, ``torch.sqrt``, ``pipeoff_adam_apply``);
* ``torch for-loop``: ``foreach=False``, torch's default for CPU tensors and the
  step the native one is bitwise equal to (SGD 44 B in five passes, AdamW 80 B
  in nine);
* ``torch foreach``: ``foreach=True`` (the same passes, batched).

Before timing, two steps of ``native`` and of ``torch for-loop`` from the same
state are compared bit for bit (and the script fails if they differ). With
``--load`` everything is measured again with a CPU-bound process on every core
(a node's other ranks) and reported loaded/quiet.

    python benchmarks/bench_outer_step.py --numel 33554432 --params 2 --rounds 7 --load
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

BYTES = {
    "sgd": {"floor": 20, "native": 20, "torch for-loop": 44, "torch foreach": 44},
    "adamw": {"floor": 44, "native": 44, "torch for-loop": 80, "torch foreach": 80},
}
"""Logical bytes per parameter each variant moves, per optimizer."""

OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, object]]] = {
    # DiLoCo's outer optimizer (Douillard et al., 2023)
    "sgd": (torch.optim.SGD, {"lr": 0.7, "momentum": 0.9, "nesterov": True}),
    "adamw": (torch.optim.AdamW, {"lr": 0.7, "betas": (0.9, 0.95), "weight_decay": 0.1}),
}
"""The optimizer class and its hyperparameters, per ``--optimizer``."""


def build(name: str, total: int, params: int) -> dict[str, Callable[[int], None]]:
    from pipeoff import _native
    from pipeoff.ft import _outer_kernel

    kernel = _outer_kernel.outer_kernel()
    lib = _native.library()
    if kernel is None or lib is None:
        raise SystemExit(f"no native kernel here: {_outer_kernel.outer_step_status()}")
    cls, kwargs = OPTIMIZERS[name]
    n = total // params
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(n, generator=gen) for _ in range(params)]
    grads = [torch.randn(n, generator=gen) * 1e-2 for _ in range(params)]
    # the group as torch fills it in, so the kernel decides from what torch would see
    group = cls([torch.zeros(1)], **kwargs).param_groups[0]  # type: ignore[arg-type]
    hyper = _outer_kernel.outer_hyper(cls, group)
    if hyper is None:
        raise SystemExit(f"the native outer step does not take {name} {kwargs}")

    def torch_step(foreach: bool) -> Callable[[int], None]:
        ps = [p.clone() for p in start]
        opt = cls(ps, foreach=foreach, **kwargs)  # type: ignore[arg-type]
        for p, g in zip(ps, grads):
            p.grad = g

        def step(t: int) -> None:
            torch.set_num_threads(t)
            opt.step()
        return step

    native_ps = [p.clone() for p in start]
    native_state: list[dict[str, torch.Tensor]] = [{} for _ in range(params)]

    def native(t: int) -> None:
        # the native passes use t threads; AdamW's torch.sqrt between them too
        torch.set_num_threads(t)
        for p, g, st in zip(native_ps, grads, native_state):
            kernel.step(p, g, st, hyper, threads=t)

    floor_buf = torch.randn(BYTES[name]["floor"] * total // 8, generator=gen)

    def floor(t: int) -> None:
        lib.pipeoff_scale(floor_buf.data_ptr(), floor_buf.numel(), 1.0, t)

    _check_bitwise(cls, kwargs, start[:1], grads[:1], kernel, hyper)
    return {"floor": floor, "native": native, "torch for-loop": torch_step(False),
            "torch foreach": torch_step(True)}


def _check_bitwise(cls: type[torch.optim.Optimizer], kwargs: dict[str, object],
                   start: list[torch.Tensor], grads: list[torch.Tensor], kernel: object,
                   hyper: object) -> None:
    """Two steps of the native kernel and of torch's for-loop step from the same state."""
    ref = [p.clone() for p in start]
    opt = cls(ref, foreach=False, **kwargs)  # type: ignore[arg-type]
    mine = [p.clone() for p in start]
    state: list[dict[str, torch.Tensor]] = [{} for _ in mine]
    for _ in range(2):
        for r, g in zip(ref, grads):
            r.grad = g
        opt.step()
        for p, g, st in zip(mine, grads, state):
            kernel.step(p, g, st, hyper, threads=2)  # type: ignore[attr-defined]
    for a, b in zip(mine, ref):
        if not torch.equal(a.view(torch.int32), b.view(torch.int32)):
            raise SystemExit(f"the native outer step differs from {cls.__name__}'s bits")


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


def report(opt: str, total: int, threads: int, load: str,
           times: dict[str, list[float]]) -> list[list[str]]:
    """Per variant: its time, logical bandwidth, the floor's share it reaches, and how
    many times faster than each torch step it is (ratios within a round, then
    min/median/max over the rounds)."""
    rows = []
    for name, ts in times.items():
        gbs = [BYTES[opt][name] * total / t / 1e9 for t in ts]
        x_floor = [f / t for f, t in zip(times["floor"], ts)]
        vs = [mmm([b / t for b, t in zip(times[base], ts)])
              for base in ("torch for-loop", "torch foreach")]
        rows.append([opt, str(threads), load, name, mmm([t * 1e3 for t in ts], "{:.1f}"),
                     f"{statistics.median(gbs):.1f}", mmm(x_floor), *vs])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=32 << 20, help="parameters in all")
    parser.add_argument("--params", type=int, default=2,
                        help="tensors they are split into (each larger than the L3 cache, "
                        "as a fragment's parameters are)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, nargs="*", default=[1, 2])
    parser.add_argument("--optimizer", nargs="*", choices=sorted(OPTIMIZERS),
                        default=["sgd", "adamw"], help="outer optimizers to measure")
    parser.add_argument("--load", action="store_true",
                        help="measure again with a CPU-bound process on every core")
    args = parser.parse_args()
    total = args.numel // args.params * args.params
    variants = {name: build(name, total, args.params) for name in args.optimizer}
    cpus = len(os.sched_getaffinity(0))
    print(f"{total / 1e6:.1f}M parameters in {args.params} tensors, {args.rounds} interleaved "
          f"rounds; torch {torch.__version__}, dispatch level "
          f"{torch.backends.cpu.get_cpu_capability()}, {cpus} CPUs; native == torch "
          f"for-loop bitwise ({', '.join(args.optimizer)}): checked")
    loads = [("quiet", 0)] + ([(f"{cpus} busy procs", cpus)] if args.load else [])
    rows: list[list[str]] = []
    medians: dict[tuple[str, str, int, str], float] = {}
    for label, procs in loads:
        with competing_load(procs) if procs else contextlib.nullcontext():
            for opt, vs in variants.items():
                for t in args.threads:
                    times = rounds(vs, t, args.rounds)
                    rows += report(opt, total, t, label, times)
                    for name, ts in times.items():
                        medians[(label, opt, t, name)] = statistics.median(ts)
    torch.set_num_threads(cpus)
    print("\nDiLoCo's outer step (SGD with Nesterov momentum, AdamW; floor: the native "
          "step's bytes per parameter at the in-place stream's rate)")
    print(table(["optimizer", "threads", "load", "variant", "ms min/med/max",
                 "GB/s (logical, median)", "x floor min/med/max",
                 "x faster than for-loop min/med/max", "x faster than foreach min/med/max"],
                rows))
    if args.load:
        print()
        lrows = []
        for opt, vs in variants.items():
            for t in args.threads:
                for name in vs:
                    q = medians[("quiet", opt, t, name)]
                    b = medians[(loads[1][0], opt, t, name)]
                    lrows.append([opt, str(t), name, f"{q * 1e3:.1f}", f"{b * 1e3:.1f}",
                                  f"{b / q:.2f}x"])
        print(table(["optimizer", "threads", "variant", "quiet ms (median)",
                     "loaded ms (median)", "loaded / quiet"], lrows))


if __name__ == "__main__":
    main()
