"""Test helper: real torchft replicas (threads) behind a real Lighthouse, on gloo."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn, optim
from torchft.coordination import LighthouseServer

import pipeoff.ft
from tests.ft._managers import replica_manager


@dataclass
class ReplicaRun:
    """What one replica saw: its parameters after every sync, and every sync's trace."""

    params_before_sync: list[list[torch.Tensor]] = field(default_factory=list)
    params_after_sync: list[list[torch.Tensor]] = field(default_factory=list)
    errors_reported: list[Exception] = field(default_factory=list)
    traces: list[Any] = field(default_factory=list)
    steps: int = 0


def make_model(seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8), nn.Linear(8, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def _replica(replica_id: int, lighthouse: str, kwargs: dict[str, Any], syncs: int,
             make: Callable[[int], nn.Module], barrier: threading.Barrier | None,
             pg: Callable[[int], Any] | None = None,
             optimizer: Callable[[nn.Module], optim.Optimizer] | None = None,
             use_async_quorum: bool = False, step_delay: Callable[[int], float] | None = None,
             on_report: Callable[[int, Exception], None] | None = None) -> ReplicaRun:
    model = make(replica_id)  # distinct starting points: the average differs from both
    opt = (optim.SGD(model.parameters(), lr=0.1) if optimizer is None
           else optimizer(model))
    data = torch.Generator().manual_seed(100 + replica_id)
    manager, _store = replica_manager(
        f"replica_{replica_id}", lighthouse,
        load_state_dict=lambda sd: model.load_state_dict(sd["model"]),
        state_dict=lambda: {"model": model.state_dict()}, use_async_quorum=use_async_quorum,
        timeout_s=20, quorum_timeout_s=30, pg=None if pg is None else pg(replica_id))
    out = ReplicaRun()
    report = manager.report_error

    def spy(e: Exception) -> None:
        out.errors_reported.append(e)
        report(e)
        if on_report is not None:
            on_report(replica_id, e)

    manager.report_error = spy  # type: ignore[method-assign]
    # Registered before LocalSGD's hook, so it runs first: the local values a sync starts from.
    opt.register_step_post_hook(lambda *_: out.params_before_sync.append(
        [p.detach().clone() for p in model.parameters()]))
    try:
        with pipeoff.ft.LocalSGD(manager, model, opt, 1, **kwargs) as local_sgd:
            for _ in range(syncs):
                if step_delay is not None:
                    time.sleep(step_delay(replica_id))
                opt.zero_grad()
                model(torch.randn(4, 16, generator=data)).pow(2).mean().backward()
                opt.step()  # sync_every=1: the post hook syncs
                out.params_after_sync.append([p.detach().clone() for p in model.parameters()])
                out.traces.append(local_sgd.last_trace)
                if barrier is not None:
                    barrier.wait(timeout=60)
        wait = getattr(opt, "wait_for_step", None)
        if callable(wait):
            wait()
        out.steps = manager.current_step()
        return out
    finally:
        manager.shutdown(wait=False)


def run_replicas(kwargs: dict[str, Any], *, syncs: int = 2,
                 make: Callable[[int], nn.Module] = make_model,
                 barrier: threading.Barrier | None = None,
                 pg: Callable[[int], Any] | None = None,
                 optimizer: Callable[[nn.Module], optim.Optimizer] | None = None,
                 use_async_quorum: bool = False,
                 step_delay: Callable[[int], float] | None = None,
                 on_report: Callable[[int, Exception], None] | None = None,
                 ) -> list[ReplicaRun]:
    """Two replicas (threads), each with its own Manager and ProcessGroupGloo.

    ``barrier``, if given, is waited on by both replicas after every sync.
    ``pg(replica_id)``, if given, makes each replica's process group;
    ``optimizer(model)`` the optimizer (default SGD, lr 0.1);
    ``step_delay(replica_id)`` seconds to sleep before each step;
    ``on_report(replica_id, error)`` is called after each error a replica reports.
    """
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    try:
        with ThreadPoolExecutor(2) as ex:
            futs = [ex.submit(_replica, i, lighthouse.address(), kwargs, syncs, make, barrier,
                              pg, optimizer, use_async_quorum, step_delay, on_report)
                    for i in range(2)]
            return [f.result(timeout=120) for f in futs]
    finally:
        lighthouse.shutdown()


def process_main(replica_id: int, lighthouses: dict[str, str],
                 modes: dict[str, dict[str, Any]], syncs: int, queue: Any) -> None:
    """One replica process: every mode in turn, each against its own Lighthouse.

    Puts ``(replica_id, {mode: (params after each sync, peak device staging or
    None per sync, errors reported)})`` on ``queue``.
    """
    out = {}
    for mode, kwargs in modes.items():
        run = _replica(replica_id, lighthouses[mode], kwargs, syncs, make_model, None)
        peaks = [None if t is None else t.summary().peak_device_staging_bytes
                 for t in run.traces]
        budgets = [None if t is None else t.device_budget_bytes for t in run.traces]
        # numpy, not tensors: torch's queue pickling shares storage through this
        # process, which will have exited when the parent reads.
        params = [[p.numpy() for p in sync] for sync in run.params_after_sync]
        out[mode] = (params, peaks, budgets, len(run.errors_reported))
    queue.put((replica_id, out))
