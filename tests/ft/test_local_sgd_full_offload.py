"""torchft LocalSGD (pipeoff's, with a real Lighthouse and Managers on gloo) driving a
FullOffloadOptimizer: each committed average becomes the masters, so the run is
bitwise the same as LocalSGD driving plain SGD on FP32 weights."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pipeoff.optim import FullOffloadOptimizer
from tests.ft._replicas import run_replicas

pytestmark = pytest.mark.filterwarnings("ignore:pipeoff. pinned host memory")


def full(overlap: str) -> Any:
    return lambda model: FullOffloadOptimizer(model, torch.optim.SGD, lr=0.1,
                                              overlap=overlap)


@pytest.mark.parametrize(("overlap", "kwargs"), [
    ("backward", {}),
    ("forward", {}),
    ("none", {"offload_to_cpu": True}),
    ("backward", {"offload_to_cpu": True, "schedule": "synchronous"}),
])
def test_local_sgd_driving_full_offload_matches_plain_sgd(overlap: str,
                                                           kwargs: dict[str, Any]) -> None:
    plain = run_replicas(kwargs, syncs=3)
    mine = run_replicas(kwargs, syncs=3, optimizer=full(overlap))
    for a, b in zip(plain, mine):
        assert a.steps == b.steps == 3
        for sync_a, sync_b in zip(a.params_after_sync, b.params_after_sync):
            for p, q in zip(sync_a, sync_b):
                assert torch.equal(p, q)
    # The replicas started apart and agree after every committed sync.
    for p, q in zip(mine[0].params_after_sync[-1], mine[1].params_after_sync[-1]):
        assert torch.equal(p, q)


def test_without_refreshing_the_masters_the_average_would_be_lost(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(FullOffloadOptimizer, "refresh_masters", lambda self: None)
    plain = run_replicas({}, syncs=3)
    mine = run_replicas({}, syncs=3, optimizer=full("none"))
    last = zip(plain[0].params_after_sync[-1], mine[0].params_after_sync[-1])
    assert not all(torch.equal(p, q) for p, q in last)
