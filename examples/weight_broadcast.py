"""RL weight broadcast: a trainer's FP32 host masters to BF16 rollout weights, live.

Two processes (gloo, CPU) train a small model with FSDP2 and
``FullOffloadOptimizer``: BF16 compute weights, FP32 masters and AdamW state in
host memory, sharded over the two ranks (unevenly: 33 rows over 2). Each rank
also holds a rollout copy of the model, replicated and BF16, as a co-located
inference engine would. After every ``step()`` a ``StateTransfer`` copies the
sharded masters into the rollout weights, cast to BF16, in rounds of at most
``--budget`` bytes of staging. It starts as soon as ``step()`` returns: each
master's readiness is the step task that writes it, so nothing waits for the
whole step. The rollout model then generates (a forward here).

Prints, per step, the training loss, the rollout loss and whether every rollout
weight equals its master cast to BF16; then the last transfer's trace summary.

    python examples/weight_broadcast.py --steps 3
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 33), nn.GELU(), nn.Linear(33, 8)).to(torch.bfloat16)


def run(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from pipeoff.optim import FullOffloadOptimizer
    from pipeoff.transfer import LiveTensor, StateTransfer

    mesh = init_device_mesh("cpu", (world,))
    trainer = make_model()
    for layer in (trainer[0], trainer[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(trainer, mesh=mesh)
    opt = FullOffloadOptimizer(trainer, torch.optim.AdamW, lr=1e-2, overlap="forward")
    rollout = make_model()  # this rank's replica of the inference engine's weights
    names = dict(trainer.named_parameters())
    targets = {n: LiveTensor(p.detach()) for n, p in rollout.named_parameters()}

    g = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(16, 16, generator=g).to(torch.bfloat16)
    y = torch.randn(16, 8, generator=g)
    for step in range(args.steps):
        loss = (trainer(x).float() - y).square().mean()
        loss.backward()
        opt.step()  # returns at once: the masters are stepped on a host lane
        opt.zero_grad()
        # Right after step(): each master is ready when its step task has run.
        sources = {n: LiveTensor.from_optimizer(opt, p, "master") for n, p in names.items()}
        transfer = StateTransfer(sources, targets, host_budget_bytes=args.budget,
                                 device_budget_bytes=args.budget,
                                 cast={"*": torch.bfloat16})
        transfer.run()
        with torch.no_grad():
            rollout_loss = (rollout(x).float() - y).square().mean()
        opt.wait_for_step()
        same = all(torch.equal(t.tensor, opt.state[p]["master"].full_tensor().to(torch.bfloat16))
                   for (n, p), t in zip(names.items(), targets.values()))
        if rank == 0:
            print(f"step {step}: train loss {loss.item():.4f}, rollout loss "
                  f"{rollout_loss.item():.4f}, rollout weights == masters in BF16: {same}")
    if rank == 0:
        trace = transfer.last_trace
        assert trace is not None and transfer.last_plan is not None
        s = trace.summary()
        print(f"last transfer: {len(transfer.last_plan.rounds)} rounds, "
              f"{transfer.last_plan.nbytes} bytes written, peak host staging "
              f"{s.peak_host_staging_bytes} bytes (budget {args.budget}), makespan "
              f"{s.makespan_us:.0f} us")
    # Let go of the FSDP2 model (and what refers to its parameters) before the group:
    # a gloo group still referenced when the interpreter finalizes keeps its threads
    # running into it, and about one exit in ten aborted ("terminate called without an
    # active exception") on a loaded 2-core machine. Freed here, it joins them now.
    del trainer, rollout, sources, targets, names, mesh
    gc.collect()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--budget", type=int, default=1024, help="staging bytes per side")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run, args=(2, port, args), nprocs=2, join=True)


if __name__ == "__main__":
    main()
