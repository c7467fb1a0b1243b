"""Reserved staging: a pool sized up front serves every execution without allocating."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipeoff
from pipeoff import ConfigError, Schedule, TaskGraph, TaskKind
from pipeoff.optim import OffloadOptimizer
from pipeoff.staging import StagingPool, reserve_for


def allocations() -> tuple[int, int]:
    pools = pipeoff.pools_for("cpu")
    return pools.device.stats().allocations, pools.host.stats().allocations


def chain(n: int, sizes: list[int]) -> TaskGraph:
    g = TaskGraph()
    for k in range(n):
        size = sizes[k % len(sizes)]
        g.add_buffer(f"b{k}", size)
        g.add_task(f"in{k}", TaskKind.H2D, buffers=[f"b{k}"])
        g.add_task(f"up{k}", TaskKind.OPTIMIZER_CHUNK, deps=[f"in{k}"], buffers=[f"b{k}"])
        g.add_task(f"out{k}", TaskKind.D2H, deps=[f"up{k}"], buffers=[f"b{k}"])
    return g


@pytest.mark.parametrize("schedule", [
    Schedule.synchronous(),
    Schedule.pipelined(device_budget_bytes=3 * 4096),
    Schedule.pipelined(),
])
def test_a_reserved_graph_runs_without_allocating(schedule: Schedule) -> None:
    g = chain(12, [4096, 4096, 1024])
    reserved = reserve_for(g, schedule)
    before = allocations()
    for _ in range(5):
        pipeoff.execute(g, schedule).wait()
    assert allocations() == before
    budget = schedule.device_budget_bytes
    if schedule.is_synchronous:
        assert reserved["device"] == 4096 + 1024  # one buffer at a time, per size
    elif budget is not None:
        assert reserved["device"] == 3 * 4096 + 4 * 1024  # per size, what the budget holds
    else:
        assert reserved["device"] == 8 * 4096 + 4 * 1024  # no budget: all may be live


def test_an_offload_optimizer_allocates_no_staging_after_construction() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
    for mode in ("chunked", "overlap"):
        opt = OffloadOptimizer(torch.optim.AdamW(model.parameters()), mode=mode,  # type: ignore[arg-type]
                               chunk_bytes=8192)
        before = allocations()
        for _ in range(5):  # the first step included
            model(torch.randn(4, 64)).sum().backward()
            opt.step()
            opt.zero_grad()
        opt.wait_for_step()
        assert allocations() == before, mode
        assert opt.reserve() == 0  # nothing left to reserve


def test_reserve_refuses_bad_sizes() -> None:
    pool = StagingPool("cpu")
    with pytest.raises(ConfigError, match="positive byte counts, got 0"):
        pool.reserve([0])
    assert pool.reserve([16, 32]) == 48
    stats = pool.stats()
    assert stats.allocations == 2 and stats.reserved_bytes == 48 and stats.live_bytes == 0
