"""Three replica groups: the sum of three or more replicas' values depends on each
element's position in the all-reduced buffer, so the modes documented bitwise
torchft "at any replica count" (``schedule="synchronous"``, ``"per_parameter"``)
must lay each parameter out as torchft's ``clone()`` does: in memory order (a
transposed weight keeps its strides). Real torchft Managers behind a real Lighthouse,
on gloo, in threads."""

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


class _Model(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.t = nn.Parameter(torch.randn(24, 16, generator=g).t())  # non-contiguous
        self.w = nn.Parameter(torch.randn(8, 12, generator=g))
        self.b = nn.Parameter(torch.randn(5, generator=g))


def _replica(i: int, lighthouse: str, cls: Any, kwargs: dict[str, Any]) -> list[torch.Tensor]:
    model = _Model(i)
    opt = optim.SGD(model.parameters(), lr=0.1)
    manager, _store = replica_manager(f"r{i}", lighthouse, load_state_dict=lambda sd: None,
                                      state_dict=lambda: {}, min_replica_size=GROUPS,
                                      timeout_s=30)
    try:
        with cls(manager, model, opt, 1, **kwargs):
            opt.step()  # no gradients: SGD leaves the weights; sync_every=1 averages them
        assert model.t.stride() == (1, 16)  # (written in place, strides kept)
        return [p.detach().clone() for p in model.parameters()]
    finally:
        manager.shutdown(wait=False)


def _average(cls: Any, kwargs: dict[str, Any]) -> list[torch.Tensor]:
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=GROUPS)
    try:
        with ThreadPoolExecutor(GROUPS) as ex:
            futs = [ex.submit(_replica, i, lighthouse.address(), cls, kwargs)
                    for i in range(GROUPS)]
            runs = [f.result(timeout=120) for f in futs]
    finally:
        lighthouse.shutdown()
    assert all(torch.equal(a, b) for run in runs[1:] for a, b in zip(run, runs[0]))
    return runs[0]


@pytest.mark.slow  # three Managers, twice: about 6 s
@pytest.mark.parametrize("kwargs", [
    {"offload_to_cpu": True, "schedule": "synchronous"},
    {"offload_to_cpu": True, "bucket_bytes": "per_parameter", "device_budget_bytes": 4096},
], ids=["synchronous", "per_parameter"])
def test_three_groups_average_bitwise_as_torchft(kwargs: dict[str, Any]) -> None:
    want = _average(torchft.local_sgd.LocalSGD, {})
    got = _average(pipeoff.ft.LocalSGD, kwargs)
    for name, a, b in zip(("t", "w", "b"), got, want):
        assert torch.equal(a, b), name
