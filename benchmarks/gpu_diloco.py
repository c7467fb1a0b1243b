"""DiLoCo's sync on one GPU: torchft's path against pipeoff's offloaded synchronous and
pipelined syncs, with the device memory each holds.

    python benchmarks/gpu_diloco.py [--quick] [--layers 16] [--width 4096]
        [--rounds 3] [--bucket-mib 64] [--budget-mib 128] [--out FILE]

Model: ``--layers`` x Linear(width, width) in FP32 (default 268M parameters),
one fragment, AdamW inside and torchtitan's outer optimizer (SGD, lr 0.7,
momentum 0.9, Nesterov). One replica: the all-reduce is a stand-in on a stream
of its own with NCCL's stream rules (it waits for the caller's stream, and
``wait()`` makes the caller's stream wait), so what is measured is the sync's
own device work, copies and host step, and its device memory. Each round
runs every variant once (interleaved): a few inner steps, then one sync
(``prepare_sync`` + ``perform_sync``, synchronized), timed. Reported per
variant: sync time (min/median/max), the device memory a sync adds at its peak
(``max_memory_allocated`` during it, over what was allocated before), and
what stays allocated for the whole run (torchft's outer momentum). Without a
CUDA device it says so and exits with code 2 (``--simulated`` runs it on
pipeoff's simulated device, for the tests: times and memory are then
meaningless).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any
from unittest.mock import create_autospec

import torch
from torch import nn, optim

sys.path.insert(0, str(Path(__file__).parent))
from _harness import table  # noqa: E402

MiB = 1 << 20


class _Work:
    """A collective's handle with NCCL's stream semantics."""

    def __init__(self, done: Any, accel: Any) -> None:
        self._done, self._accel = done, accel

    def wait(self, timeout: Any = None) -> bool:
        self._done.wait(self._accel.current_stream())
        return True


def fake_manager(device: torch.device) -> Any:
    """A one-replica torchft Manager: the average of one participant, on a side stream."""
    from torchft.manager import Manager

    from pipeoff import _accel

    accel = _accel.current()
    stream = accel.new_stream(device, name="nccl")
    step = [0]

    def allreduce(t: torch.Tensor, should_quantize: bool = False) -> _Work:
        ready = accel.new_event()
        ready.record(accel.current_stream())
        stream.wait_event(ready)
        accel.launch(stream, lambda: t.div_(1))  # touches every element, as a reduction does
        done = accel.new_event()
        done.record(stream)
        return _Work(done, accel)

    def should_commit(*_: Any, **__: Any) -> bool:
        step[0] += 1
        return True

    manager = create_autospec(Manager)
    manager._use_async_quorum = False
    manager.errored.return_value = None
    manager.allreduce.side_effect = allreduce
    manager.should_commit.side_effect = should_commit
    manager.current_step.side_effect = lambda: step[0]
    return manager


def run(args: argparse.Namespace, device: torch.device, real: bool) -> list[list[object]]:
    import pipeoff.ft
    from pipeoff import _accel

    accel = _accel.current()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])
    model = model.to(device) if real else model
    params = list(model.parameters())
    s_bytes = sum(p.numel() * p.element_size() for p in params)
    inner = optim.AdamW(params, lr=1e-4)
    bucket, budget = int(args.bucket_mib * MiB), int(args.budget_mib * MiB)
    variants = {
        "torchft": {},
        "synchronous": {"offload_to_cpu": True, "schedule": "synchronous", "bucket_bytes": bucket},
        "pipelined": {"offload_to_cpu": True, "bucket_bytes": bucket,
                      "device_budget_bytes": budget},
    }
    x = torch.randn(8, args.width)
    x = x.to(device) if real else x
    rows: dict[str, dict[str, list[float]]] = {v: {"ms": [], "peak": [], "kept": []}
                                               for v in variants}
    for r in range(1 + args.rounds):  # round 0: warm-up
        for name, kwargs in variants.items():
            accel.synchronize(device)
            before = torch.cuda.memory_allocated() if real else 0
            outer = optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)
            diloco = pipeoff.ft.DiLoCo(fake_manager(device), [model], inner, outer,
                                       sync_every=2, **kwargs)
            for _ in range(2):  # inner steps (the hooks are not entered: sync by hand)
                inner.zero_grad()
                model(x).pow(2).mean().backward()
                inner.step()
            inner.zero_grad(set_to_none=True)
            frag = diloco._fragments[0]
            for _ in range(2):  # the second sync has the outer state of the first
                accel.synchronize(device)
                start = torch.cuda.memory_allocated() if real else 0
                if real:
                    torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                frag.prepare_sync()
                frag.perform_sync()
                diloco.wait_for_sync()  # the whole sync: its outer step and writes too
                accel.synchronize(device)
                elapsed = time.perf_counter() - t0
            if r > 0:
                rows[name]["ms"].append(elapsed * 1e3)
                if real:
                    rows[name]["peak"].append(torch.cuda.max_memory_allocated() - start)
                    rows[name]["kept"].append(torch.cuda.memory_allocated() - before)
            del diloco, frag, outer
    out = []
    base = statistics.median(rows["torchft"]["ms"])
    for name, fig in rows.items():
        ms = fig["ms"]
        mem = (f"{max(fig['peak']) / MiB:.0f} MiB" if fig["peak"] else "-")
        kept = (f"{max(fig['kept']) / MiB:.0f} MiB" if fig["kept"] else "-")
        out.append([f"{s_bytes / 4e6:.0f}M", name,
                    "/".join(f"{v:.1f}" for v in (min(ms), statistics.median(ms), max(ms))),
                    f"{statistics.median(ms) / base:.2f}x", mem, kept])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4 layers, 2 rounds")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bucket-mib", type=float, default=64)
    ap.add_argument("--budget-mib", type=float, default=128)
    ap.add_argument("--out", default=None, help="also write the table here")
    ap.add_argument("--simulated", action="store_true",
                    help="run on pipeoff's simulated CUDA device (tests only)")
    args = ap.parse_args()
    if args.quick:
        args.layers, args.rounds = 4, 2
    if args.simulated:
        import pipeoff.testing

        with pipeoff.testing.simulated_cuda() as sim:
            rows = run(args, sim.device, real=False)
    else:
        if not torch.cuda.is_available():
            print("gpu_diloco: no CUDA device here; run it on a machine with a GPU",
                  file=sys.stderr)
            return 2
        rows = run(args, torch.device("cuda"), real=True)
    text = table(["model", "variant", "sync ms min/med/max", "x torchft (median)",
                  "device memory a sync adds (peak)", "kept for the run"], rows)
    text += (f"\n\n{args.layers} x Linear({args.width}) fp32, bucket {args.bucket_mib} MiB, "
             f"budget {args.budget_mib} MiB, {args.rounds} interleaved rounds after a warm-up; "
             "one replica (a stand-in all-reduce on its own stream)\n")
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
