"""One rank of a 2x2 HSDP job under torchft: 2 replica groups x 2 FSDP2 ranks (gloo).

Each replica group shards the model with FSDP2 over its own 2 ranks; gradients
are averaged across the groups with torchft's ``Manager.allreduce``, and
torchft's ``OptimizerWrapper`` commits (or not) every step. Group 1's ranks
exit before step ``KILL_STEP`` on their first attempt; the test restarts them,
and they heal from group 0 (model and optimizer state over torchft's HTTP
checkpoint transport).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

STEPS = 6
KILL_STEP = 3
KILLED = 17  # exit code of a killed rank


def make_model() -> nn.Sequential:
    g = torch.Generator().manual_seed(0)
    # Linear(32, 3) and Linear(3, 5) shard unevenly over 2 ranks.
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 3), nn.Linear(3, 5))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m


def local(t: Any) -> torch.Tensor:
    return getattr(t, "_local_tensor", t)


def worker(group: int, rank: int, attempt: int, lighthouse: str, rendezvous: str,
           optimizer: str, queue: Any) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchft.manager import Manager
    from torchft.optim import OptimizerWrapper
    from torchft.process_group import ProcessGroupGloo

    from pipeoff.optim import OffloadOptimizer

    # No port is chosen before it is bound: a port found free and bound later was
    # taken in between by another rank's Lighthouse client or Manager (EADDRINUSE
    # in CI). The group meets in a file; rank 0's store takes a port from the OS and
    # tells rank 1 over that group.
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank,
                            world_size=2)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) \
        if rank == 0 else None
    port = [store.port if store is not None else 0]
    dist.broadcast_object_list(port, src=0)
    mesh = init_device_mesh("cpu", (2,))
    model = make_model()
    for i in (0, 2, 3):
        fully_shard(model[i], mesh=mesh)
    fully_shard(model, mesh=mesh)
    inner: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2,
                                                     weight_decay=0.1)
    if optimizer != "plain":
        inner = OffloadOptimizer(inner, mode=optimizer, chunk_bytes=256)  # type: ignore[arg-type]
        inner.attach(model)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)), min_replica_size=2,
        load_state_dict=load_state_dict, state_dict=state_dict,
        replica_id=f"group{group}", store_addr="127.0.0.1", store_port=port[0],
        rank=rank, world_size=2, lighthouse_addr=lighthouse, use_async_quorum=False,
        timeout=timedelta(seconds=10), quorum_timeout=timedelta(seconds=60),
    )
    opt = OptimizerWrapper(manager, inner)
    try:
        while manager.current_step() < STEPS:
            if group == 1 and attempt == 0 and manager.current_step() == KILL_STEP:
                os._exit(KILLED)  # a crash: no cleanup, no goodbye
            opt.zero_grad()  # starts the quorum; a restarted group heals here
            step = manager.current_step()
            g = torch.Generator().manual_seed(1000 * step + 10 * group + rank)
            model(torch.randn(4, 16, generator=g)).pow(2).mean().backward()
            works = [manager.allreduce(local(p.grad)) for p in model.parameters()]
            for w in works:
                w.wait()
            opt.step()  # should_commit(), then the inner step
        wait = getattr(inner, "wait_for_step", None)
        if callable(wait):
            wait()
        sd = inner.state_dict()
        out = {
            "step": manager.current_step(),
            "params": [local(p).detach().numpy().copy() for p in model.parameters()],
            "state": {k: {key: local(v).detach().numpy().copy() for key, v in st.items()
                          if isinstance(v, torch.Tensor)} for k, st in sd["state"].items()},
            "healed": manager._healing if hasattr(manager, "_healing") else None,
        }
        queue.put(((group, rank, attempt), out))
    finally:
        manager.shutdown(wait=False)
        dist.destroy_process_group()
