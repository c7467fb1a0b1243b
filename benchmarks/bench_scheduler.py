"""Host overhead per task of building and executing graphs of null tasks.

    python benchmarks/bench_scheduler.py [--sizes 1000 10000 100000]

For each CPU executor it reports microseconds per task for building the
graph, planning it, and launching plus waiting, next to the cost of a bare
tiny torch op. Target: at most 20 us per task on ``threads``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _harness import measure, table  # noqa: E402

import pipeoff  # noqa: E402
from pipeoff import Schedule, TaskGraph, TaskKind  # noqa: E402

KINDS = list(TaskKind)


def build(n: int, lanes: int = 4) -> TaskGraph:
    """A pipeline-shaped graph: each task depends on the one before it on its lane
    and, every fourth task, on one on another lane (a cross-lane event)."""
    g = TaskGraph()
    for i in range(n):
        deps = [f"t{i - lanes}"] if i >= lanes else []
        if i % 4 == 3:
            deps.append(f"t{i - 1}")
        g.add_task(f"t{i}", KINDS[i % lanes], None, deps=deps)
    return g


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 100000])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    x = torch.zeros(8)
    n_ops = 20000
    op = measure(lambda: [x.add_(1) for _ in range(n_ops)], repeats=args.repeats)
    op_us = op.median / n_ops * 1e6

    rows = []
    for n in args.sizes:
        b = measure(lambda: build(n), repeats=args.repeats, label=f"build {n}")
        g = build(n)
        p = measure(lambda: Schedule.pipelined().plan(g), repeats=args.repeats,
                    label=f"plan {n}")
        for backend, sched in (("inline", Schedule.synchronous()),
                               ("threads", Schedule.pipelined())):
            def run() -> None:
                pipeoff.execute(g, sched, backend=backend).wait()  # type: ignore[arg-type]

            e = measure(run, repeats=args.repeats, label=f"{backend} {n}")
            total = b.median + e.median
            rows.append([n, backend, b.median / n * 1e6, p.median / n * 1e6,
                         e.median / n * 1e6, total / n * 1e6, total / n * 1e6 / op_us])
    print(f"bare tiny torch op (x.add_(1) on 8 floats): {op_us:.2f} us\n")
    print(table(["tasks", "backend", "build us/task", "plan us/task (in execute)",
                 "execute+wait us/task", "build+execute us/task", "x tiny op"], rows))


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"\n({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
