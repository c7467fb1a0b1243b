"""StateTransfer on the CPU: a host->"device" transfer in bounded rounds against a raw copy_.

In one process, on the same tensors (FP32 host sources, targets declared
``"device"`` on the CPU stand-in, so the copies run on the ``h2d`` lane as they
would on a GPU):

* ``raw copy_``: ``target.copy_(source)`` for every tensor, the bytes' floor;
* ``StateTransfer`` at each budget: the preflight, the plan and every round
  (one process: the runs are local, copied directly, round by round).

Also the plan time of ``--plan-tensors`` tensors sharded over 2 ranks.

Targets (issue 14): at least 0.8x of the raw copy at 16 MiB; plan time of
10,000 tensors under 1 s.

    python benchmarks/bench_transfer.py --mib 256 --tensors 16 --repeats 5
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import measure, table  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="MiB moved in all")
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--budgets-mib", type=int, nargs="*", default=[1, 16, 64])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--plan-tensors", type=int, default=10_000)
    args = parser.parse_args()

    import warnings

    from pipeoff.transfer import LiveTensor, Piece, StateTransfer, plan_transfer

    warnings.simplefilter("ignore", RuntimeWarning)  # no pinned memory on this machine
    n = (args.mib << 20) // 4 // args.tensors
    gen = torch.Generator().manual_seed(0)
    srcs = [torch.randn(n, generator=gen) for _ in range(args.tensors)]
    dsts = [torch.empty(n) for _ in range(args.tensors)]
    nbytes = sum(t.numel() * 4 for t in srcs)
    print(f"{nbytes / 2**20:.0f} MiB in {args.tensors} FP32 tensors; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")

    def raw() -> None:
        for d, s in zip(dsts, srcs):
            d.copy_(s)

    rows = []
    base = measure(raw, repeats=args.repeats, label="raw copy_")
    rows.append(("raw copy_", "-", nbytes / base.median / 1e9, 1.0, "-"))
    for mib in args.budgets_mib:
        budget = mib << 20
        t = StateTransfer({f"p{k}": LiveTensor(s) for k, s in enumerate(srcs)},
                          {f"p{k}": LiveTensor(d, residency="device")
                           for k, d in enumerate(dsts)},
                          host_budget_bytes=budget, device_budget_bytes=budget)
        tm = measure(t.run, repeats=args.repeats, label=f"transfer {mib} MiB")
        assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))
        assert t.last_plan is not None
        rows.append((f"StateTransfer, {mib} MiB budget", len(t.last_plan.rounds),
                     nbytes / tm.median / 1e9, base.median / tm.median, "0.8x at 16 MiB"))
    print(table(["path", "rounds", "GB/s", "x raw copy_", "target"], rows))

    shapes = [(64, 33 + k % 7) for k in range(args.plan_tensors)]
    sources: list[list[Piece]] = [[], []]
    for k, s in enumerate(shapes):
        for r in (0, 1):
            sources[r].append(Piece(key=f"p{k}", global_shape=s, offsets=(32 * r, 0),
                                    sizes=(32, s[1]), dtype=torch.float32))
    targets = [[Piece(key=f"p{k}", global_shape=s, offsets=(0, 0), sizes=s,
                      dtype=torch.float32) for k, s in enumerate(shapes)]] * 2
    t0 = time.perf_counter()
    plan = plan_transfer(sources, targets, capacity=[8 << 20] * 2)
    dt = time.perf_counter() - t0
    print(f"plan of {args.plan_tensors} tensors (Shard(0) over 2 ranks -> replicated on both, "
          f"8 MiB rounds): {dt:.3f} s, {len(plan.rounds)} rounds (target: under 1 s)")


if __name__ == "__main__":
    main()
