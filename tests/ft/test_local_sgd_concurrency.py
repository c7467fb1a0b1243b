"""Two replicas in one process never block each other through pipeoff's lanes (issue 10, input 4).

torchft's own integration-test setup: two replicas as threads of one process,
each with a real Manager (async quorum) and ProcessGroupGloo, running pipelined
LocalSGD over an ``OffloadOptimizer``, one replica 0.2 s slower per step. A
sync's write-backs wait for a commit that needs the other replica; the other
replica's optimizer chunks must not queue behind them. The result is bitwise
torchft's own LocalSGD over plain AdamW.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn, optim

from pipeoff.optim import OffloadOptimizer
from tests.ft._replicas import run_replicas

PIPELINED = {"offload_to_cpu": True, "schedule": "pipelined",
             "bucket_bytes": 256, "device_budget_bytes": 512}


def _offload(mode: str) -> Any:
    def make(model: nn.Module) -> optim.Optimizer:
        opt = OffloadOptimizer(optim.AdamW(model.parameters(), lr=1e-2), mode=mode,  # type: ignore[arg-type]
                               chunk_bytes=512)
        if mode == "overlap":
            opt.attach(model)
        return opt
    return make


def _slow_replica_0(replica_id: int) -> float:
    return 0.2 if replica_id == 0 else 0.0


@pytest.fixture(scope="module")
def reference() -> list[Any]:
    return run_replicas({}, syncs=3, optimizer=lambda m: optim.AdamW(m.parameters(), lr=1e-2),
                        use_async_quorum=True)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["overlap", "chunked"])
def test_a_slow_replica_and_a_fast_one_share_lanes_without_deadlock(
        mode: str, reference: list[Any]) -> None:
    runs = run_replicas(PIPELINED, syncs=3, optimizer=_offload(mode), use_async_quorum=True,
                        step_delay=_slow_replica_0)
    for got, want in zip(runs, reference):
        assert got.errors_reported == []
        for a, b in zip(got.params_after_sync, want.params_after_sync):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
