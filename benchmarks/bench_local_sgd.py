"""LocalSGD sync time and staging memory: torchft's original path, RFC 0003, pipelined.

    python benchmarks/bench_local_sgd.py [--sizes 8 64] [--repeats 5]
        [--bucket-mib 4] [--budget-mib 8] [--threads N]

A real torchft Lighthouse and two replicas (spawned processes, one rank
each, ProcessGroupGloo on CPU) sync models of ``--sizes`` million fp32
parameters. Each replica runs the three modes on the same Manager,
interleaved sync by sync: the original path,
``offload_to_cpu=True`` with ``schedule="synchronous"`` (RFC
0003) and with ``schedule="pipelined"``. It reports
the mean ``_perform_sync`` time per mode, the ratios, and the extra device
staging high-water (S for the original path's clones, M for the RFC, the
pipelined trace's peak against its budget) and host staging.

It also times the floor in the same rounds: the same bytes all-reduced in
buckets of ``--bucket-mib`` through the same Manager, and nothing else.

Targets on CPU: pipelined <= 1.0x original and <= 0.75x RFC sync; within 1.1x of
the floor.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from _harness import measure, table  # noqa: E402

MiB = 1 << 20


def _model(million: int) -> Any:
    from torch import nn

    width = 1024 if million <= 16 else 2048
    layers = max(1, round(million * 1e6 / (width * width + width)))
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def _replica(replica_id: int, lighthouse: str, args: argparse.Namespace, q: Any) -> None:
    import torch
    import torch.distributed as dist
    from torch import optim
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    import pipeoff.ft

    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(store.port), RANK="0",
                      WORLD_SIZE="1", TORCHFT_LIGHTHOUSE=lighthouse)
    torch.manual_seed(replica_id)
    if args.threads:
        torch.set_num_threads(args.threads)
    modes = {
        "original": {},
        "RFC sync": {"offload_to_cpu": True, "schedule": "synchronous"},
        "pipelined": {"offload_to_cpu": True, "schedule": "pipelined",
                      "bucket_bytes": int(args.bucket_mib * MiB),
                      "device_budget_bytes": int(args.budget_mib * MiB)},
    }
    for million in args.sizes:
        model = _model(million)
        manager = Manager(
            pg=ProcessGroupGloo(timeout=timedelta(seconds=120)), min_replica_size=2,
            load_state_dict=lambda sd: model.load_state_dict(sd), state_dict=model.state_dict,
            replica_id=f"bench{replica_id}_{million}", use_async_quorum=False, init_sync=False,
            timeout=timedelta(seconds=120))
        params = list(model.parameters())
        s_bytes = sum(p.numel() * p.element_size() for p in params)
        m_bytes = max(p.numel() * p.element_size() for p in params)
        syncers: dict[str, Any] = {}
        times: dict[str, list[float]] = {mode: [] for mode in modes}
        for mode, kwargs in modes.items():
            local_sgd = pipeoff.ft.LocalSGD(manager, model, optim.SGD(params, lr=0.1), 1,
                                            **kwargs)
            inner = local_sgd._perform_sync

            def timed(inner: Any = inner, out: list[float] = times[mode]) -> None:
                t0 = time.perf_counter()
                inner()
                out.append(time.perf_counter() - t0)

            local_sgd._perform_sync = timed  # type: ignore[method-assign]
            syncers[mode] = local_sgd

        floor_times: list[float] = []
        bucket = int(args.bucket_mib * MiB) // 4

        def floor() -> None:
            # The floor: the same bytes all-reduced in buckets through the same
            # Manager and process group, all issued, then waited; nothing else.
            manager.start_quorum()
            manager.wait_quorum()
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            t0 = time.perf_counter()
            works = [manager.allreduce(flat[i:i + bucket]) for i in range(0, flat.numel(), bucket)]
            for w in works:
                w.wait()
            floor_times.append(time.perf_counter() - t0)
            assert manager.should_commit()

        def one_round() -> None:
            # Modes interleave round by round, so background load on a shared
            # machine falls on all of them alike.
            floor()
            for local_sgd in syncers.values():
                local_sgd.sync()

        step0 = manager.current_step()
        measure(one_round, warmup=1, repeats=args.repeats)
        # Every sync must have committed, or the timing measured a no-op.
        assert manager.current_step() == step0 + (len(modes) + 1) * (1 + args.repeats), step0
        checksum = float(sum(p.detach().double().sum() for p in params))
        for mode, local_sgd in syncers.items():
            steady = times[mode][1:]  # drop the warm-up (first-use pool allocations)
            trace = local_sgd.last_trace
            if trace is not None and args.trace_dir and replica_id == 0:
                name = mode.replace(" ", "_")
                trace.save(str(Path(args.trace_dir) / f"local_sgd_{million}M_{name}.json"))
            if trace is None:
                dev_peak, host_peak, budget = s_bytes, 0, None  # the clones, all live at once
            else:
                summary = trace.summary()
                dev_peak, host_peak = (summary.peak_device_staging_bytes,
                                       summary.peak_host_staging_bytes)
                budget = modes[mode].get("device_budget_bytes", m_bytes)
            q.put((replica_id, million, mode, statistics.mean(steady),
                   statistics.median(steady), min(steady), max(steady), dev_peak, host_peak,
                   budget, s_bytes, m_bytes, len(params), checksum))
        steady = floor_times[1:]
        q.put((replica_id, million, "floor", statistics.mean(steady), statistics.median(steady),
               min(steady), max(steady), 0, 0, None, s_bytes, m_bytes, len(params), checksum))
        manager.shutdown(wait=False)
    q.put((replica_id, None))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[8, 64],
                    help="model sizes in millions of fp32 parameters")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bucket-mib", type=float, default=4.0)
    ap.add_argument("--budget-mib", type=float, default=8.0)
    ap.add_argument("--trace-dir", default=None,
                    help="save replica 0's last trace per size and offload mode here")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch intra-op threads per replica (0: torch's default)")
    args = ap.parse_args()

    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_replica, args=(i, lighthouse.address(), args, q))
             for i in range(2)]
    for p in procs:
        p.start()
    rows: dict[tuple[int, str], Any] = {}
    checksums: dict[tuple[int, str], set[float]] = {}
    done = 0
    try:
        while done < 2:
            item = q.get(timeout=900)
            if item[1] is None:
                done += 1
            else:
                checksums.setdefault((item[1], item[2]), set()).add(item[-1])
            if item[1] is not None and item[0] == 0:
                rows[item[1], item[2]] = item[3:-1]
                print(f"  {item[1]}M {item[2]}: {item[3] * 1e3:.1f} ms", file=sys.stderr)
    finally:
        for p in procs:
            p.join(60)
        lighthouse.shutdown()

    for key, sums in checksums.items():
        assert len(sums) == 1, f"replicas differ after {key}: {sums}"
    out = []
    for million in args.sizes:
        orig = rows[million, "original"][0]
        rfc = rows[million, "RFC sync"][0]
        flo = rows[million, "floor"][0]
        for mode in ("original", "RFC sync", "pipelined", "floor"):
            mean, median, lo, hi, dev, host, budget, s, m, n = rows[million, mode]
            out.append([
                f"{s / 1e6 / 4:.1f}M ({n} params)", mode, mean * 1e3, median * 1e3,
                f"{lo * 1e3:.1f}-{hi * 1e3:.1f}",
                f"{mean / orig:.2f}x", f"{mean / rfc:.2f}x", f"{mean / flo:.2f}x",
                f"{dev / MiB:.1f} MiB" + ("" if budget is None else f" / {budget / MiB:.1f}"),
                f"{host / MiB:.1f} MiB",
            ])
    print(table(["model", "mode", "mean sync ms", "median ms", "min-max ms", "vs original",
                 "vs RFC sync", "vs floor",
                 "extra device staging / budget", "host staging"], out))
    print(f"\n2 replicas x 1 rank, gloo on CPU ({os.cpu_count()} cores), "
          f"bucket {args.bucket_mib} MiB, device budget {args.budget_mib} MiB, "
          f"{args.repeats} syncs per mode (after 1 warm-up), modes interleaved, "
          f"intra-op threads per replica: {args.threads or 'torch default'}")


if __name__ == "__main__":
    main()
