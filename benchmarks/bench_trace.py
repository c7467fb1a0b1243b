"""What recording costs: executions with ``pipeoff.trace.record`` off and on, side by side.

    python benchmarks/bench_trace.py [--tasks 1000] [--executions 50]

Off, ``execute`` checks one empty list; on, it appends the execution to the
recorder. Per-task timestamps are taken either way (they are what
``Execution.trace`` is built from), so the cost of recording is registering
executions plus building the merged trace once at the end, reported apart.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _harness import measure, table  # noqa: E402

import pipeoff  # noqa: E402
from pipeoff import TaskGraph, TaskKind  # noqa: E402

KINDS = list(TaskKind)


def build(n: int) -> TaskGraph:
    g = TaskGraph()
    for i in range(n):
        g.add_task(f"t{i}", KINDS[i % 4], None, deps=[f"t{i - 4}"] if i >= 4 else [])
    return g


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=1000)
    ap.add_argument("--executions", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    g = build(args.tasks)

    def run_all() -> None:
        for _ in range(args.executions):
            pipeoff.execute(g).wait()

    built: list[float] = []

    def recorded() -> None:
        with pipeoff.trace.record() as rec:
            run_all()
        t0 = time.perf_counter()
        _ = rec.trace  # merging is paid once, when the trace is read
        built.append(time.perf_counter() - t0)

    off = measure(run_all, repeats=args.repeats, label="off")
    on = measure(recorded, repeats=args.repeats, label="on")
    per = args.executions
    build_s = sorted(built)[len(built) // 2]
    rows = [
        ["off", off.median / per * 1e3, "-", "1.00x"],
        ["on (executions only)", (on.median - build_s) / per * 1e3, "-",
         f"{(on.median - build_s) / off.median:.2f}x"],
        ["on (with building the trace)", on.median / per * 1e3, build_s * 1e3,
         f"{on.median / off.median:.2f}x"],
    ]
    print(f"{args.executions} executions of {args.tasks} null tasks on `threads`, "
          f"median of {args.repeats}\n")
    print(table(["recording", "ms per execution", "trace build ms (once)", "vs off"], rows))


if __name__ == "__main__":
    main()
