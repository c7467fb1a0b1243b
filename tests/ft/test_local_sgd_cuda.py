"""pipeoff.ft.LocalSGD with device staging on a GPU: streams, pinned host buffers, budgets."""

from __future__ import annotations

from typing import Any
from unittest.mock import create_autospec

import pytest
import torch
from torch import nn, optim
from torchft.manager import Manager
from torchft.work import _DummyWork

import pipeoff
import pipeoff.ft
import pipeoff.testing

MODES: dict[str, dict[str, Any]] = {
    "original": {},
    "sync": {"offload_averaged_parameters_to_cpu": True, "schedule": "sync"},
    "pipelined": {"offload_averaged_parameters_to_cpu": True, "bucket_bytes": 64 << 10,
                  "device_budget_bytes": 128 << 10},
}


def _manager() -> Any:
    manager = create_autospec(Manager)
    manager.errored.return_value = None
    manager.should_commit.return_value = True
    # A stand-in average that touches every element, enqueued on the current
    # (lane) stream as a real collective's completion would be.
    manager.allreduce.side_effect = (
        lambda t, should_quantize=False: _DummyWork(t.mul_(0.5).add_(1.0)))
    return manager


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.Linear(512, 300), nn.Linear(300, 7)).cuda()


@pytest.mark.cuda
@pytest.mark.timeout(120)
def test_cuda_pipelined_matches_original_under_delays() -> None:
    results = {}
    for mode, kwargs in MODES.items():
        model = _model()
        local_sgd = pipeoff.ft.LocalSGD(_manager(), model, optim.SGD(model.parameters(), lr=0.1),
                                        1, **kwargs)
        # Provoke the races a missing stream wait would let through: a slow
        # collective lane (GPU-side sleep) and a slow copy lane.
        with pipeoff.testing.delay_lane("comm", 0.002), pipeoff.testing.delay_lane("d2h", 0.002):
            local_sgd.sync()
        torch.cuda.synchronize()
        results[mode] = [p.detach().cpu() for p in model.parameters()]
        if mode != "original":
            summary = local_sgd.last_trace.summary()
            assert local_sgd.last_trace.metadata["backend"] == (
                "inline" if mode == "sync" else "cuda")
            if mode == "pipelined":
                assert summary.peak_device_staging_bytes <= kwargs["device_budget_bytes"]
        pools = pipeoff.pools_for(torch.device("cuda", torch.cuda.current_device()))
        assert pools.device.stats().live_bytes == 0 and pools.host.stats().live_bytes == 0
        if mode != "original":
            assert pools.host.stats().pinned
    for mode in MODES:
        for got, want in zip(results[mode], results["original"], strict=True):
            assert torch.equal(got, want), mode
