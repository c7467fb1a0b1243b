"""Pipelined LocalSGD with torchft: two replicas average through pinned host staging.

    python examples/local_sgd_torchft.py [--steps 8] [--sync-every 2] [--trace FILE]

It starts a torchft Lighthouse and two replica groups (threads here, one rank
each, ProcessGroupGloo on CPU; on a cluster each replica is its own job). Each
replica trains a small model and wraps its optimizer in
``pipeoff.ft.LocalSGD(..., offload_to_cpu=True,
schedule="pipelined")``: every ``--sync-every`` steps the parameters are
packed into buckets, all-reduced bucket by bucket, staged in host memory, and
written back only if the quorum commits. The last sync's trace is saved (open
it in https://ui.perfetto.dev or run ``pipeoff trace summary FILE``) and its
summary printed.
"""

# ruff: noqa: E402
from __future__ import annotations

import argparse
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

# torchft's Rust lighthouse and manager log every quorum at INFO on stderr (the Python
# logger's level does not reach them): only their errors. Read when torchft loads its
# extension, so set before the imports below.
os.environ.setdefault("RUST_LOG", "error")

import torch
import torch.distributed as dist
from torch import nn, optim
from torchft.coordination import LighthouseServer
from torchft.manager import Manager
from torchft.process_group import ProcessGroupGloo

import pipeoff.ft


def replica(replica_id: int, lighthouse: str, args: argparse.Namespace) -> tuple[float, object]:
    """Train one replica group; returns its final loss and last sync trace."""
    store = dist.TCPStore(host_name="localhost", port=0, is_master=True, wait_for_workers=False)
    torch.manual_seed(replica_id)  # replicas start apart; LocalSGD pulls them together
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 4))
    opt = optim.AdamW(model.parameters(), lr=1e-3)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=30)),
        min_replica_size=2,
        load_state_dict=lambda sd: model.load_state_dict(sd),
        state_dict=model.state_dict,
        replica_id=f"example_{replica_id}",
        store_addr="localhost", store_port=store.port, rank=0, world_size=1,
        lighthouse_addr=lighthouse,
        use_async_quorum=False,
        timeout=timedelta(seconds=30),
    )
    data = torch.Generator().manual_seed(1000 + replica_id)
    loss = torch.tensor(0.0)
    try:
        with pipeoff.ft.LocalSGD(
            manager, model, opt, args.sync_every,
            offload_to_cpu=True,
            schedule="pipelined",
            bucket_bytes=64 << 10,          # 64 KiB buckets: a few per sync for this model
            device_budget_bytes=128 << 10,  # two buckets of device staging in flight
        ) as local_sgd:
            for _ in range(args.steps):
                x = torch.randn(64, 32, generator=data)
                y = x[:, :4].sum(dim=1, keepdim=True).expand(-1, 4)
                opt.zero_grad()
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                opt.step()  # every sync_every steps, the post hook averages
        return float(loss.detach()), local_sgd.last_trace
    finally:
        manager.shutdown(wait=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--sync-every", type=int, default=2)
    ap.add_argument("--trace", default=None,
                    help="where to save the trace (default: none saved)")
    args = ap.parse_args()
    logging.getLogger("torchft").setLevel(logging.WARNING)

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    try:
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(replica, i, lighthouse.address(), args) for i in range(2)]
            results = [f.result(timeout=120) for f in futures]
    finally:
        lighthouse.shutdown()

    for i, (loss, _) in enumerate(results):
        print(f"replica {i}: final loss {loss:.4f}")
    trace = results[0][1]
    if trace is None:
        print("no sync ran (steps < sync-every)")
        return
    if args.trace:
        trace.save(args.trace)
        print(f"last sync trace saved to {args.trace}")
    print(trace.summary().format())


if __name__ == "__main__":
    main()
