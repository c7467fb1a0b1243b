"""FSDP2 training with an offloaded AdamW whose step overlaps the next forward.

Two gloo processes on the CPU (``mp.spawn``) train a small MLP sharded with
FSDP2. ``OffloadOptimizer(overlap="forward")`` keeps the AdamW state in host
memory and steps it in chunks on pipeoff's lanes; ``attach`` makes each FSDP
module's forward wait only for the chunks holding its shards (and those of the
modules it prefetches). Prints each step's loss and the last step's trace summary.

    python examples/fsdp2_overlap_optimizer.py --steps 5
"""

from __future__ import annotations

import argparse
import socket
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


def build(mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10)
    )
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # Each layer's all-gather of the next one is issued in its own pre-forward;
    # attach() makes that pre-forward wait for the prefetched layer's chunks too.
    model[0].set_modules_to_forward_prefetch([model[2]])  # type: ignore[operator]
    model[2].set_modules_to_forward_prefetch([model[4]])  # type: ignore[operator]
    return model


def train(rank: int, world: int, port: int, steps: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    import pipeoff.trace
    from pipeoff.optim import OffloadOptimizer

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        model = build(init_device_mesh("cpu", (world,)))
        opt = OffloadOptimizer(
            torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01),
            overlap="forward", chunk_bytes=64 * 1024,
        )
        opt.attach(model)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
        g = torch.Generator().manual_seed(rank)
        target = torch.randn(10, 64, generator=torch.Generator().manual_seed(7))
        with pipeoff.trace.record() as rec:  # every step and forward-hook wait
            for step in range(steps):
                x = torch.randn(32, 64, generator=g)
                loss = nn.functional.cross_entropy(model(x), (x @ target.T).argmax(1))
                loss.backward()
                opt.step()  # returns at once; the chunks run while the next forward starts
                opt.zero_grad()
                sched.step()
                if rank == 0:
                    print(f"step {step}: loss {loss.item():.4f}", flush=True)
            opt.wait_for_step()  # before anything else reads the parameters
        if rank == 0:
            trace = opt.last_trace
            assert trace is not None
            print(f"{len(opt.plan.chunks)} chunks per step; the last step's trace:")
            print(trace.summary().format())
            waits = rec.trace.summary()
            print(f"whole run: {waits.hook_waits} forward-hook waits, "
                  f"{waits.hook_wait_total_us / 1e3:.3f} ms blocked in total")
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(train, args=(2, port, args.steps), nprocs=2, join=True)


if __name__ == "__main__":
    main()
