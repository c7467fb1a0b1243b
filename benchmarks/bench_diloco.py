"""DiLoCo sync time and device memory: torchft's DiLoCo, pipeoff's offloaded synchronous
and pipelined syncs, and the floor (a bare bucketed all-reduce of the same bytes).

    python benchmarks/bench_diloco.py [--sizes 8 64] [--repeats 5]
        [--bucket-mib 4] [--budget-mib 8] [--threads N] [--alpha 0.0]

A real torchft Lighthouse and two replicas (spawned processes, one rank each,
ProcessGroupGloo on CPU) sync one-fragment models of ``--sizes`` million fp32
parameters, with torchtitan's outer optimizer (SGD, lr 0.7, momentum 0.9,
Nesterov). Each replica runs the variants on the same Manager and model,
interleaved sync by sync (A B C D A B C D ...):

* ``floor``: the pseudo-gradients' bytes all-reduced in buckets of
  ``--bucket-mib`` through ``manager.allreduce``, all issued, then waited;

* ``torchft``: ``pipeoff.ft.DiLoCo(offload_to_cpu=False)``, which is
  torchft's DiLoCo (its ``prepare_sync`` and ``perform_sync``);
* ``synchronous``, ``pipelined``: ``offload_to_cpu=True``.

Each sync is timed from ``prepare_sync`` to the end of ``perform_sync`` (the
quorum is started and waited before the clock starts, as for the floor); all
commit. Device memory is the figure that matters on a GPU: torchft keeps the
outer optimizer's momentum on the device for the whole run (S) and, during a
sync, the pseudo-gradients (S) and a snapshot of the local parameters (S);
pipeoff keeps none of it, and its sync's device staging is the trace's peak
(within ``--budget-mib``). On this CPU machine "device" memory is host memory,
so only the time ratios and the staging peak are measured here.

Then the training loop around it: ``--loop-steps`` inner steps (a forward and
backward of a batch of 8, an SGD step) per round with ``fragment_sync_delay=1``
(the all-reduce runs under the last inner step), each variant in turn, timed
whole.

Targets on CPU: pipelined <= 1.0x torchft; both within 1.1x of the floor.
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
from _harness import table  # noqa: E402

MiB = 1 << 20
KEY = "StreamingDiLoCoFragment_0"


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
    if args.threads:
        torch.set_num_threads(args.threads)
    bucket, budget = int(args.bucket_mib * MiB), int(args.budget_mib * MiB)
    modes: dict[str, dict[str, Any]] = {
        "torchft": {},
        "synchronous": {"offload_to_cpu": True, "schedule": "synchronous",
                        "bucket_bytes": bucket},
        "pipelined": {"offload_to_cpu": True, "schedule": "pipelined", "bucket_bytes": bucket,
                      "device_budget_bytes": budget},
    }
    for million in args.sizes:
        torch.manual_seed(0)  # DiLoCo's replicas start from the same global parameters
        model = _model(million)
        manager = Manager(
            pg=ProcessGroupGloo(timeout=timedelta(seconds=120)), min_replica_size=2,
            load_state_dict=lambda sd: model.load_state_dict(sd), state_dict=model.state_dict,
            replica_id=f"bench{replica_id}_{million}", use_async_quorum=False, init_sync=False,
            timeout=timedelta(seconds=120))
        params = list(model.parameters())
        s_bytes = sum(p.numel() * p.element_size() for p in params)
        inner = optim.SGD(params, lr=0.1)
        syncs: dict[str, Any] = {}
        for mode, kwargs in modes.items():
            # Three DiLoCos on one Manager (a benchmark only): each registers
            # its checkpoint functions under the same key.
            manager._load_state_dict_fns.pop(KEY, None)
            manager._user_state_dicts.pop(KEY, None)
            outer = optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)
            syncs[mode] = pipeoff.ft.DiLoCo(manager, [model], inner, outer, sync_every=2,
                                            fragment_update_alpha=args.alpha, **kwargs)
        # The floor first: each round ends on a DiLoCo sync, after which both
        # replicas hold the same global parameters (the checksum below).
        times: dict[str, list[float]] = {m: [] for m in ["floor", *modes]}
        gen = torch.Generator().manual_seed(replica_id)

        def drift() -> None:
            # The inner steps' work, in effect: every replica's parameters move.
            with torch.no_grad():
                for p in params:
                    p.add_(torch.randn(p.shape, generator=gen), alpha=1e-3)

        def one_sync(mode: str, record: bool) -> None:
            if mode != "floor":
                # Each DiLoCo has its own backup: start it from the global
                # parameters the previous sync left (with alpha 0, the parameters).
                backup = syncs[mode]._fragments[0].original_parameters
                with torch.no_grad():
                    for (name, _), p in zip(model.named_parameters(), params):
                        backup[name].copy_(p)
                drift()  # (the floor leaves the parameters as they are)
            manager.start_quorum()
            manager.wait_quorum()
            t0 = time.perf_counter()
            if mode == "floor":
                flat = torch.cat([p.detach().reshape(-1) for p in params])
                works = [manager.allreduce(flat[i:i + bucket // 4])
                         for i in range(0, flat.numel(), bucket // 4)]
                for w in works:
                    w.wait()
                elapsed = time.perf_counter() - t0
                assert manager.should_commit()
            else:
                frag = syncs[mode]._fragments[0]
                frag.prepare_sync()
                assert frag.perform_sync() is not False
                syncs[mode].wait_for_sync()  # the whole sync: its outer step and writes too
                elapsed = time.perf_counter() - t0
            if record:
                times[mode].append(elapsed)

        step0 = manager.current_step()
        for r in range(1 + args.repeats):  # round 0: warm-up (first-use allocations)
            for mode in times:
                one_sync(mode, record=r > 0)
        assert manager.current_step() == step0 + len(times) * (1 + args.repeats), step0

        # The training loop around it: sync_every inner steps (a forward and backward
        # of a batch of 8, an SGD step) with fragment_sync_delay=1, so that the
        # all-reduce runs under the last inner step, timed whole.
        loop: dict[str, list[float]] = {m: [] for m in modes}
        x = torch.randn(8, params[0].shape[1], generator=gen)
        loopers = {}
        for mode, kwargs in modes.items():
            manager._load_state_dict_fns.pop(KEY, None)
            manager._user_state_dicts.pop(KEY, None)
            outer = optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)
            loopers[mode] = pipeoff.ft.DiLoCo(manager, [model], inner, outer,
                                              sync_every=args.loop_steps, fragment_sync_delay=1,
                                              fragment_update_alpha=args.alpha, **kwargs)
        for r in range(1 + args.repeats):
            for mode, d in loopers.items():
                backup = d._fragments[0].original_parameters
                with torch.no_grad():
                    for (name, _), p in zip(model.named_parameters(), params):
                        backup[name].copy_(p)
                t0 = time.perf_counter()
                with d:
                    for _ in range(args.loop_steps):
                        inner.zero_grad()
                        model(x).pow(2).mean().backward()
                        inner.step()  # the last two steps prepare and perform the sync
                if r > 0:
                    loop[mode].append(time.perf_counter() - t0)
        checksum = float(sum(p.detach().double().sum() for p in params))
        for mode in times:
            d = syncs.get(mode)
            trace = d.last_trace if d is not None else None
            if trace is not None and args.trace_dir and replica_id == 0:
                trace.save(str(Path(args.trace_dir) / f"diloco_{million}M_{mode}.json"))
            peak = trace.summary().peak_device_staging_bytes if trace is not None else None
            q.put((replica_id, million, mode, times[mode], peak, s_bytes, len(params),
                   loop.get(mode), checksum))
        manager.shutdown(wait=False)
    q.put((replica_id, None))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[8, 64],
                    help="model sizes in millions of fp32 parameters")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bucket-mib", type=float, default=4.0)
    ap.add_argument("--budget-mib", type=float, default=8.0)
    ap.add_argument("--alpha", type=float, default=0.0, help="fragment_update_alpha")
    ap.add_argument("--loop-steps", type=int, default=4,
                    help="inner steps per round of the training-loop measurement (sync_every)")
    ap.add_argument("--trace-dir", default=None,
                    help="save replica 0's last trace per size and offloaded mode here")
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
    checksums: dict[int, set[float]] = {}
    done = 0
    try:
        while done < 2:
            item = q.get(timeout=900)
            if item[1] is None:
                done += 1
                continue
            checksums.setdefault(item[1], set()).add(item[-1])
            if item[0] == 0:
                rows[item[1], item[2]] = item[3:-1]
    finally:
        for p in procs:
            p.join(60)
        lighthouse.shutdown()
    for million, sums in checksums.items():
        assert len(sums) == 1, f"replicas differ after {million}M: {sums}"

    out, loops = [], []
    for million in args.sizes:
        base = rows[million, "torchft"][0]
        floor = rows[million, "floor"][0]
        base_loop = rows[million, "torchft"][4]
        for mode in ("torchft", "synchronous", "pipelined", "floor"):
            ts, peak, s, n, lp = rows[million, mode]
            if lp is not None:
                ratio = [a / b for a, b in zip(lp, base_loop)]
                loops.append([f"{s / 1e6 / 4:.1f}M", mode,
                              "/".join(f"{x * 1e3:.1f}" for x in (min(lp), statistics.median(lp),
                                                                  max(lp))),
                              "/".join(f"{x:.2f}" for x in (min(ratio), statistics.median(ratio),
                                                             max(ratio)))])
            vs_base = [t / b for t, b in zip(ts, base)]  # within a round, then over rounds
            vs_floor = [t / f for t, f in zip(ts, floor)]
            if mode == "torchft":
                device = f"{2 * s / MiB:.1f} MiB + outer state {s / MiB:.1f} MiB"
            elif mode == "floor":
                device = "-"
            else:
                device = f"{peak / MiB:.1f} MiB (budget {args.budget_mib:g})" if (
                    mode == "pipelined") else f"{peak / MiB:.1f} MiB"
            out.append([
                f"{s / 1e6 / 4:.1f}M ({n} params)", mode,
                "/".join(f"{x * 1e3:.1f}" for x in (min(ts), statistics.median(ts), max(ts))),
                "/".join(f"{x:.2f}" for x in (min(vs_base), statistics.median(vs_base),
                                               max(vs_base))),
                "/".join(f"{x:.2f}" for x in (min(vs_floor), statistics.median(vs_floor),
                                               max(vs_floor))),
                device,
            ])
    print(table(["model", "variant", "sync ms min/med/max", "x torchft min/med/max",
                 "x floor min/med/max", "device memory of the sync"], out))
    print(f"\nThe training loop around it: {args.loop_steps} inner steps (batch 8, SGD) with "
          "fragment_sync_delay=1, the sync included")
    print(table(["model", "variant", "loop ms min/med/max", "x torchft min/med/max"], loops))
    load = os.getloadavg()[0]
    print(f"\n2 replicas x 1 rank, gloo on CPU ({os.cpu_count()} cores, load {load:.2f}), "
          f"bucket {args.bucket_mib} MiB, device budget {args.budget_mib} MiB, alpha "
          f"{args.alpha}, {args.repeats} interleaved rounds (after 1 warm-up), intra-op "
          f"threads per replica: {args.threads or 'torch default'}")


if __name__ == "__main__":
    main()
