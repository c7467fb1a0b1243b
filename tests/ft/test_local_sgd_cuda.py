"""pipeoff.ft.LocalSGD with device staging: streams, pinned host buffers, budgets, on the
simulated CUDA device (and a real GPU where there is one).

The collective follows NCCL's stream rules: it runs on a stream of its own that
first waits for the caller's current stream, and ``wait()`` makes the caller's
current stream wait for it; the host never blocks.
"""

from __future__ import annotations

import contextlib
from typing import Any
from unittest.mock import MagicMock, create_autospec

import pytest
import torch
from torch import nn, optim
from torchft.manager import Manager

import pipeoff
import pipeoff.ft
import pipeoff.testing
from tests.gpu_device import Gpu

MODES: dict[str, dict[str, Any]] = {
    "original": {},
    "sync": {"offload_to_cpu": True, "schedule": "synchronous"},
    "pipelined": {"offload_to_cpu": True, "bucket_bytes": 4 << 10,
                  "device_budget_bytes": 8 << 10},
}


class NcclLikeWork:
    """A collective's handle with NCCL's stream semantics."""

    def __init__(self, done: Any, accel: Any) -> None:
        self._done = done
        self._accel = accel

    def wait(self, timeout: Any = None) -> bool:
        # Hazard: the caller's next kernels reading the tensor before the collective
        # has written it. NCCL's wait() makes the current stream wait; the host does not.
        self._done.wait(self._accel.current_stream())
        return True


def _manager(gpu: Gpu) -> Any:
    accel = gpu.accel
    nccl = accel.new_stream(gpu.device, name="nccl")

    def allreduce(t: torch.Tensor, should_quantize: bool = False) -> NcclLikeWork:
        ready = accel.new_event()
        ready.record(accel.current_stream())  # NCCL waits for the producer's stream
        nccl.wait_event(ready)
        # A stand-in average that touches every element, on the collective's stream.
        accel.launch(nccl, lambda: t.mul_(0.5).add_(1.0))
        done = accel.new_event()
        done.record(nccl)
        return NcclLikeWork(done, accel)

    manager = create_autospec(Manager)
    manager.errored.return_value = None
    manager.should_commit.return_value = True
    manager.allreduce.side_effect = allreduce
    manager._pg = MagicMock()
    return manager


def _model(gpu: Gpu) -> nn.Module:
    torch.manual_seed(0)
    return gpu.module(nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 50), nn.Linear(50, 7)))


def _sync(gpu: Gpu, mode: str) -> list[torch.Tensor]:
    model = _model(gpu)
    local_sgd = pipeoff.ft.LocalSGD(_manager(gpu), model, optim.SGD(model.parameters(), lr=0.1),
                                    1, **MODES[mode])
    # Provoke the races a missing stream wait would let through: a slow
    # collective lane (a stream-side sleep) and a slow copy lane.
    with pipeoff.testing.delay_lane("comm", 0.002), pipeoff.testing.delay_lane("d2h", 0.002):
        local_sgd.sync()
    if mode != "original":
        assert local_sgd.last_trace is not None
        assert local_sgd.last_trace.metadata["backend"] == ("inline" if mode == "sync" else "cuda")
        if mode == "pipelined" and not pipeoff._faults.any_disabled():
            summary = local_sgd.last_trace.summary()
            assert summary.peak_device_staging_bytes <= MODES[mode]["device_budget_bytes"]
        pools = pipeoff.pools_for(gpu.device)
        assert pools.device.stats().live_bytes == 0 and pools.host.stats().live_bytes == 0
        assert pools.host.stats().pinned
    return [gpu.read(p) for p in model.parameters()]


@pytest.mark.timeout(120)
def test_pipelined_matches_the_original_path_under_delays(gpu: Gpu) -> None:
    results = {mode: _sync(gpu, mode) for mode in MODES}
    for mode in MODES:
        for got, want in zip(results[mode], results["original"], strict=True):
            assert torch.equal(got, want), mode


@pytest.mark.parametrize("mutation", ["cross_lane_wait", "base_wait"])
def test_every_stream_wait_of_the_sync_is_needed(gpu: Gpu, mutation: str) -> None:
    if not gpu.simulated:
        pytest.skip("a real GPU shows a missing wait only by luck")
    with pipeoff.testing.disable(mutation), pytest.raises(pipeoff.testing.DataRaceError):
        _sync(gpu, "pipelined")
        gpu.synchronize()


class _FailedWork:
    """torchft's handle of a failed all-reduce: wait() reports the error to the manager
    and returns False, without waiting for the collective, which may still be writing;
    or (``interrupted``) a Ctrl-C arrives in that wait."""

    def __init__(self, interrupted: bool) -> None:
        self.interrupted = interrupted

    def wait(self, timeout: Any = None) -> bool:
        if self.interrupted:
            raise KeyboardInterrupt
        return False


@pytest.mark.parametrize("failure", ["wait_false", "ctrl_c_in_wait"])
def test_a_block_a_failed_all_reduce_may_still_write_is_never_reused(
        gpu: Gpu, failure: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hazard: the staging block of an all-reduce whose wait() returned False, or was
    interrupted, going back to the pool: the next user of the pool would share it with
    the collective, which may still be writing it (the Ctrl-C's case was untested)."""
    manager = _manager(gpu)
    allreduce = manager.allreduce.side_effect
    # After the Ctrl-C this replica joins the later all-reduces on the process group
    # directly (it has failed the sync): NCCL-like, as torchft's would be (the stand-in
    # average is no sum: the vote's one-element flag finds no peers to tell).
    monkeypatch.setattr(pipeoff.ft._collective._compat, "issue_on_group",
                        lambda manager, t: allreduce(t) if t.numel() > 1 else None)
    seen: list[torch.Tensor] = []

    def first_fails(t: torch.Tensor, should_quantize: bool = False) -> Any:
        seen.append(t)
        if len(seen) > 1:
            return allreduce(t, should_quantize)
        manager.should_commit.return_value = False  # as torchft after a failed wait()
        return _FailedWork(interrupted=failure == "ctrl_c_in_wait")

    manager.allreduce.side_effect = first_fails
    model = _model(gpu)
    before = [gpu.read(p) for p in model.parameters()]
    local_sgd = pipeoff.ft.LocalSGD(manager, model, optim.SGD(model.parameters(), lr=0.1),
                                    1, **MODES["pipelined"])
    with (pytest.raises(KeyboardInterrupt) if failure == "ctrl_c_in_wait"
          else contextlib.nullcontext()):
        local_sgd.sync()
    assert all(torch.equal(gpu.read(p), q) for p, q in zip(model.parameters(), before))
    failed = seen[0]
    # Every free block that could serve a request of its size: none is the failed one.
    pool = pipeoff.pools_for(gpu.device).device
    reused = []
    while True:
        allocations = pool.stats().allocations
        block = pool.acquire(failed.nbytes)
        if pool.stats().allocations > allocations:
            pool.release(block)
            break
        reused.append(block)
    for block in reused:
        pool.release(block)
    assert reused, "no block of the sync went back to the pool"
    ptr = failed.untyped_storage().data_ptr()
    assert all(b.tensor.untyped_storage().data_ptr() != ptr for b in reused)
