"""A small shared harness: warm-up, repeats, median/min/max, progress, tables."""

from __future__ import annotations

import contextlib
import multiprocessing
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Timing:
    median: float
    min: float
    max: float
    repeats: int


def measure(fn: Callable[[], object], *, warmup: int = 1, repeats: int = 5,
            label: str | None = None) -> Timing:
    """Run ``fn`` ``warmup`` times, then time ``repeats`` runs (seconds)."""
    for _ in range(warmup):
        fn()
    times = []
    for r in range(repeats):
        if label:
            print(f"\r  {label}: run {r + 1}/{repeats}", end="", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    if label:
        print("\r" + " " * (len(label) + 20) + "\r", end="", file=sys.stderr, flush=True)
    return Timing(statistics.median(times), min(times), max(times), repeats)


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub-flavoured markdown table."""
    cells = [[str(c) for c in headers]] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(cells[0], widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells[1:]]
    return "\n".join(lines)


def _fmt(c: object) -> str:
    if isinstance(c, float):
        return f"{c:.3g}" if abs(c) < 100 else f"{c:.0f}"
    return str(c)


def _spin() -> None:
    while True:
        pass


@contextlib.contextmanager
def competing_load(n: int) -> Iterator[None]:
    """``n`` CPU-bound processes for the duration of the block (a training host's
    dataloader workers, or the other ranks of a node)."""
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_spin, daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    try:
        time.sleep(0.5)  # let them get scheduled
        yield
    finally:
        for p in procs:
            p.kill()
            p.join()
