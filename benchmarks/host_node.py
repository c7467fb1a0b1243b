"""The host node as the simulator's host-node model sees it: DRAM bandwidth per rank.

R processes (ranks) at once, each with ``cores // R`` threads, stream in place over
a buffer of their own (native ``pipeoff_scale``, 8 bytes per element read and
written), for R in ``--ranks``; the table gives each rank's and the node's GB/s
beside ``HostNode.h200_node()``'s assumptions (61.4 GB/s per rank, 491.5 in all,
12 GB/s one core alone). Runs anywhere (CPU only); ``gpu_suite.py`` runs it on the
lent GPU's host.

    python benchmarks/host_node.py --mib 1024 --ranks 1 2 8 --rounds 5
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import table  # noqa: E402


def _rank(mib: int, threads: int, rounds: int, start: multiprocessing.synchronize.Barrier,
          out: multiprocessing.Queue) -> None:
    import torch

    from pipeoff import _native

    lib = _native.library()
    if lib is None:
        out.put(None)
        start.wait()
        return
    buf = torch.ones(mib << 18)  # mib MiB of FP32
    lib.pipeoff_scale(buf.data_ptr(), buf.numel(), 1.0, threads)  # warm (pages faulted in)
    rates = []
    for _ in range(rounds):
        start.wait()  # every rank streams at once
        t0 = time.perf_counter()
        lib.pipeoff_scale(buf.data_ptr(), buf.numel(), 1.0, threads)
        rates.append(2 * buf.numel() * 4 / (time.perf_counter() - t0) / 1e9)
    out.put(rates)


def measure(ranks: int, cores: int, mib: int, rounds: int) -> list[list[float]] | None:
    """Per rank, its GB/s in each round, all ``ranks`` streaming at once."""
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(ranks)
    out: multiprocessing.Queue = ctx.Queue()
    threads = max(1, cores // ranks)
    procs = [ctx.Process(target=_rank, args=(mib, threads, rounds, start, out))
             for _ in range(ranks)]
    for p in procs:
        p.start()
    got = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    if any(g is None for g in got):
        return None
    return got  # type: ignore[return-value]


def main() -> int:
    from pipeoff import _native
    from pipeoff.sim import HostNode

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1024, help="buffer per rank, MiB")
    ap.add_argument("--ranks", type=int, nargs="*", default=[1, 2, 8])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if _native.library() is None:
        print(f"no native kernel here: {_native.unavailable_reason()}", file=sys.stderr)
        return 2
    cores = len(os.sched_getaffinity(0))
    node = HostNode.h200_node()
    rows = []
    for r in [1, *args.ranks] if 1 not in args.ranks else args.ranks:
        got = measure(r, cores, args.mib, args.rounds)
        assert got is not None
        per_round_total = [sum(x) for x in zip(*got)]
        per_rank = [x for g in got for x in g]
        rows.append([str(r), str(max(1, cores // r)),
                     "/".join(f"{f(per_rank):.1f}" for f in (min, statistics.median, max)),
                     f"{statistics.median(per_round_total):.1f}"])
    one = measure(1, 1, args.mib, args.rounds)
    assert one is not None
    print(f"host of {cores} CPUs, {args.mib} MiB per rank, {args.rounds} rounds; in-place "
          "stream (8 B per element)")
    print(table(["ranks at once", "threads each", "GB/s per rank min/med/max",
                 "node GB/s (median round)"], rows))
    print(f"\none core alone: {statistics.median(one[0]):.1f} GB/s (h200_node assumes "
          f"{node.core_gbps:g}); h200_node assumes {node.rank_gbps:.1f} GB/s per rank with "
          f"{node.ranks} ranks, {node.dram_gbps:.1f} GB/s per node")
    return 0


if __name__ == "__main__":
    sys.exit(main())
