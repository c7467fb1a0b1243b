"""Run as a script (``python -m tests.ft.join_before_quorum_worker SCHEDULE``): two real
torchft replicas (threads) behind a Lighthouse, LocalSGD with torchft's asynchronous
quorum. Replica 1 rejects sync 0 (so the quorum reconfigures the process group at
sync 1), then reports an error right after sync 1's ``start_quorum()``: it joins that
sync's collectives as a failed replica's. Replica 0 starts sync 1's quorum only once
replica 1 has reached its first collective (waiting for the quorum, or issuing), so
that replica 1 gets there before its quorum is done. Prints a JSON outcome. Run in a
process of its own: the failure it guards against aborts the process (gloo)."""

from __future__ import annotations

import json
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch
from torch import nn, optim
from torchft.coordination import LighthouseServer
from torchft.process_group import ProcessGroupGloo, ProcessGroupWrapper

import pipeoff.ft
from tests.ft._managers import replica_manager

SCHEDULES = {"pipelined": {"bucket_bytes": 96, "device_budget_bytes": 192},
             "synchronous": {"schedule": "synchronous"}}


class _Reached(ProcessGroupWrapper):  # type: ignore[misc]
    """Sets ``reached`` at each all-reduce issued on it, once ``armed``."""

    def __init__(self, reached: threading.Event, armed: threading.Event) -> None:
        super().__init__(pg=ProcessGroupGloo(timeout=timedelta(seconds=8)))
        self.reached, self.armed = reached, armed

    def allreduce(self, tensors: list[torch.Tensor], opts: object) -> Any:
        if self.armed.is_set():
            self.reached.set()
        return super().allreduce(tensors, opts)


def _replica(i: int, lighthouse: str, schedule: str, reached: threading.Event,
             armed: threading.Event) -> dict[str, Any]:
    g = torch.Generator().manual_seed(i)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8), nn.Linear(8, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    opt = optim.SGD(model.parameters(), lr=0.1)
    manager, _store = replica_manager(
        f"r{i}", lighthouse, state_dict=lambda: {"model": model.state_dict()},
        load_state_dict=lambda sd: model.load_state_dict(sd["model"]), timeout_s=30,
        min_replica_size=1, use_async_quorum=True,
        pg=_Reached(reached, armed) if i == 1 else None)
    if i == 1:
        commit, start, wait = manager.should_commit, manager.start_quorum, manager.wait_quorum

        def reject_first(*a: Any, **k: Any) -> bool:
            manager.report_error(RuntimeError("injected: sync 0 rejected"))
            manager.should_commit = commit  # type: ignore[method-assign]
            return bool(commit(*a, **k))

        quorums = [0]

        def start_then_fail(*a: Any, **k: Any) -> None:
            start(*a, **k)
            quorums[0] += 1
            if quorums[0] != 2:  # (sync 1's)
                return
            armed.set()
            manager.report_error(RuntimeError("injected: failed after start_quorum"))

        def waiting(*a: Any, **k: Any) -> None:
            if armed.is_set():
                reached.set()
            wait(*a, **k)

        manager.should_commit = reject_first  # type: ignore[method-assign]
        manager.start_quorum = start_then_fail  # type: ignore[method-assign]
        manager.wait_quorum = waiting  # type: ignore[method-assign]
    errors: list[str] = []
    try:
        with pipeoff.ft.LocalSGD(manager, model, opt, 1, offload_to_cpu=True,
                                 **SCHEDULES[schedule]):
            for sync in range(3):
                opt.zero_grad()
                model(torch.randn(4, 16, generator=g)).pow(2).mean().backward()
                if i == 0 and sync == 1 and not reached.wait(60):
                    errors.append("replica 1 never reached sync 1's first collective")
                opt.step()  # sync_every=1: syncs
        return {"errors": errors, "step": manager.current_step()}
    finally:
        manager.shutdown(wait=False)


def main(schedule: str) -> None:
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1)
    reached, armed = threading.Event(), threading.Event()
    try:
        with ThreadPoolExecutor(2) as pool:
            runs = list(pool.map(_replica, range(2), [lighthouse.address()] * 2,
                                 [schedule] * 2, [reached] * 2, [armed] * 2))
    finally:
        lighthouse.shutdown()
    print(json.dumps(runs))


if __name__ == "__main__":
    main(sys.argv[1])
