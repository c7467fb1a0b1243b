"""DiLoCo with three replica groups: the sum of three or more replicas' values depends
on each element's position in the all-reduced buffer, so only
``bucket_bytes="per_parameter"`` (torchft's own one-parameter-at-a-time all-reduce)
is documented bitwise torchft at any replica count (docs/diloco.md, Exactness).
Real torchft Managers behind a real Lighthouse, on gloo, in threads."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
import torchft.local_sgd
from torch import nn, optim
from torchft.coordination import LighthouseServer

import pipeoff.ft
from tests.ft._managers import replica_manager

GROUPS = 3
SYNCS = 2


def _replica(i: int, lighthouse: str, cls: Any, kwargs: dict[str, Any]) -> list[torch.Tensor]:
    model = nn.Sequential(nn.Linear(16, 24), nn.Linear(24, 5))
    init = torch.Generator().manual_seed(0)  # one initial model everywhere (no global RNG:
    with torch.no_grad():                    # the replicas are threads)
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=init))
        model[0].weight.set_(model[0].weight.detach().t().contiguous().t())  # strided
    inner = optim.SGD(model.parameters(), lr=0.1)
    outer = optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    manager, _store = replica_manager(f"r{i}", lighthouse, load_state_dict=lambda sd: None,
                                      state_dict=lambda: {}, min_replica_size=GROUPS,
                                      timeout_s=30)
    g = torch.Generator().manual_seed(100 + i)  # each replica's own gradients
    try:
        with cls(manager, [model], inner, outer, 2, **kwargs):
            for _ in range(2 * SYNCS):
                for p in model.parameters():
                    p.grad = torch.randn(p.shape, generator=g)
                inner.step()
        return [p.detach().clone() for p in model.parameters()]
    finally:
        manager.shutdown(wait=False)


def _run(cls: Any, kwargs: dict[str, Any]) -> list[torch.Tensor]:
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=GROUPS)
    try:
        with ThreadPoolExecutor(GROUPS) as ex:
            futs = [ex.submit(_replica, i, lighthouse.address(), cls, kwargs)
                    for i in range(GROUPS)]
            runs = [f.result(timeout=120) for f in futs]
    finally:
        lighthouse.shutdown()
    apart = [[float((a - b).abs().max()) for a, b in zip(run, runs[0])] for run in runs[1:]]
    assert not any(any(r) for r in apart), (cls, apart)
    return runs[0]


@pytest.mark.slow  # three Managers, twice: about 6 s
@pytest.mark.parametrize("schedule", ["synchronous", "pipelined"])
def test_three_groups_per_parameter_is_bitwise_torchft(schedule: str) -> None:
    want = _run(torchft.local_sgd.DiLoCo, {})
    got = _run(pipeoff.ft.DiLoCo, {"offload_to_cpu": True, "schedule": schedule,
                                   "bucket_bytes": "per_parameter"})
    for k, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), k
