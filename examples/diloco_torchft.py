"""Streaming DiLoCo with torchft, its outer state and pseudo-gradients in host memory.

    python examples/diloco_torchft.py [--steps 16] [--sync-every 4] [--trace FILE]

It starts a torchft Lighthouse and two replica groups (threads here, one rank
each, ProcessGroupGloo on CPU; on a cluster each replica is its own job).
Each replica trains a two-block model split into two DiLoCo fragments, with
AdamW inside and torchtitan's outer optimizer (SGD, lr 0.7, momentum 0.9,
Nesterov) per fragment, through ``pipeoff.ft.DiLoCo(...,
offload_to_cpu=True)``: at every fragment sync the pseudo-gradients are
formed bucket by bucket in bounded device staging (and staged to the host
before ``step()`` returns, so nothing the loop writes next reaches them),
averaged while the next inner step runs (``fragment_sync_delay=1``), staged
in host memory, and on
commit the outer step runs in host memory and the result is merged into the
model (``fragment_update_alpha=0.5``). Nothing of the outer optimizer lives
on the device. The last sync's trace is saved (open it in
https://ui.perfetto.dev or run ``pipeoff trace summary FILE``) and its summary
printed.
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
    torch.manual_seed(0)  # DiLoCo's replicas start from the same global parameters
    model = nn.Sequential(
        nn.Sequential(nn.Linear(32, 256), nn.ReLU()),                    # fragment 0
        nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4)),  # fragment 1
    )
    inner = optim.AdamW(model.parameters(), lr=1e-3)
    outer = [optim.SGD(block.parameters(), lr=0.7, momentum=0.9, nesterov=True)
             for block in model]
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=30)),
        min_replica_size=2,
        load_state_dict=lambda sd: model.load_state_dict(sd),
        state_dict=model.state_dict,
        replica_id=f"diloco_example_{replica_id}",
        store_addr="localhost", store_port=store.port, rank=0, world_size=1,
        lighthouse_addr=lighthouse,
        use_async_quorum=False,  # DiLoCo needs the synchronous quorum
        timeout=timedelta(seconds=30),
    )
    data = torch.Generator().manual_seed(1000 + replica_id)  # each replica its own data
    loss = torch.tensor(0.0)
    try:
        with pipeoff.ft.DiLoCo(
            manager, list(model), inner, outer, args.sync_every,
            fragment_sync_delay=1,
            fragment_update_alpha=0.5,
            offload_to_cpu=True,
            bucket_bytes=64 << 10,          # 64 KiB buckets: a few per fragment sync
            device_budget_bytes=128 << 10,  # two buckets of device staging in flight
        ) as diloco:
            for _ in range(args.steps):
                x = torch.randn(64, 32, generator=data)
                y = x[:, :4].sum(dim=1, keepdim=True).expand(-1, 4)
                inner.zero_grad()
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                inner.step()  # DiLoCo's hooks prepare and perform the fragment syncs
        return float(loss.detach()), diloco.last_trace
    finally:
        manager.shutdown(wait=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--sync-every", type=int, default=4,
                    help="inner steps per round; each of the 2 fragments syncs once per round")
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
