"""The simulator against reality: cpu_here predictions of real threads/inline makespans.

    python benchmarks/bench_sim.py [--repeats 5]

Calibrates ``CostModel.cpu_here()``, runs each validation graph for real
(median makespan from its trace), simulates the same graph and schedule, and
prints the prediction error. Target: within 25%.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import torch  # noqa: E402
from _harness import table  # noqa: E402

import pipeoff  # noqa: E402
from pipeoff.sim import CostModel  # noqa: E402
from pipeoff.sim._validate import validation_cases  # noqa: E402


def measure(repeats: int) -> list[tuple[str, float, float]]:
    cost = CostModel.cpu_here()
    out = []
    for case in validation_cases():
        g = case.build()
        pipeoff.execute(g, case.schedule, backend=case.backend).wait()  # warm the pools
        real = []
        for _ in range(repeats):
            ex = pipeoff.execute(case.build(), case.schedule, backend=case.backend)
            ex.wait()
            real.append(ex.trace.makespan_ns() / 1e6)
        pred = pipeoff.execute(case.build(), case.schedule, backend="sim",
                               cost_model=cost).trace.makespan_ns() / 1e6
        out.append((case.name, statistics.median(real), pred))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    # Lanes, not torch's intra-op threads, are the parallelism being modelled.
    torch.set_num_threads(1)
    rows = [[name, real, pred, f"{100 * (pred - real) / real:+.0f}%"]
            for name, real, pred in measure(args.repeats)]
    c = CostModel.cpu_here()
    print(f"cpu_here: copy {c.h2d_gbps:.2f} GB/s, two copies at once x{c.h2d_bidir_factor:.2f} "
          f"each, copy and update at once x{c.copy_compute_factor:.2f} each, "
          f"update {c.optimizer_elems_per_s / 1e6:.0f} Melem/s, "
          f"launch {c.launch_overhead_s * 1e6:.1f} us\n")
    print(table(["graph", "measured ms", "predicted ms", "error"], rows))


if __name__ == "__main__":
    main()
