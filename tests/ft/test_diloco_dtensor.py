"""pipeoff.ft.DiLoCo with DTensor fragments (FSDP2's parameters), 2-way sharded over the
threaded process group: the offloaded syncs keep every DTensor's layout and give
torchft's bits on every rank's shard."""

from __future__ import annotations

from typing import Any
from unittest.mock import create_autospec

import pytest
import torch
from torch import optim
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torchft.manager import Manager
from torchft.work import _DummyWork

import pipeoff.ft
from tests.ft.test_local_sgd_dtensor import _run_threads, _sharded_model

MODES: dict[str, dict[str, Any]] = {
    "original": {},
    "synchronous": {"offload_to_cpu": True, "schedule": "synchronous"},
    # 24-byte buckets: shards split across buckets.
    "pipelined_split": {"offload_to_cpu": True, "bucket_bytes": 24, "device_budget_bytes": 48},
}


def _manager(rank: int) -> Any:
    manager = create_autospec(Manager)
    manager._use_async_quorum = False
    manager.errored.return_value = None
    step = [0]

    def should_commit(*_: Any, **__: Any) -> bool:
        step[0] += 1
        return True

    manager.should_commit.side_effect = should_commit
    manager.current_step.side_effect = lambda: step[0]
    # A stand-in average that differs per element and per rank.
    manager.allreduce.side_effect = (
        lambda t, should_quantize=False: _DummyWork(t.mul_(0.5).add_(rank + 1)))
    return manager


@pytest.mark.timeout(60)
def test_dtensor_fragments_keep_layout_and_match_torchft() -> None:
    results: dict[tuple[int, str], list[tuple[Any, ...]]] = {}

    def body(rank: int) -> None:
        mesh = init_device_mesh("cpu", (2,))
        for mode, kwargs in MODES.items():
            model = _sharded_model(mesh)
            before = {n: (p.device_mesh, p.placements, p.shape, p.stride(), p.to_local().shape)
                      for n, p in model.named_parameters()}
            inner = optim.SGD(model.parameters(), lr=0.1)
            outer = optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
            g = torch.Generator().manual_seed(7)
            with pipeoff.ft.DiLoCo(_manager(rank), [model], inner, outer, sync_every=2,
                                   fragment_sync_delay=1, fragment_update_alpha=0.5, **kwargs):
                for _ in range(6):
                    for p in model.parameters():
                        full = torch.randn(p.shape, generator=g)
                        p.grad = distribute_tensor(full, p.device_mesh, p.placements)
                    inner.step()
            out = []
            for n, p in model.named_parameters():
                assert isinstance(p, DTensor), n
                assert (p.device_mesh, p.placements, p.shape, p.stride(),
                        p.to_local().shape) == before[n], n
                out.append((n, p.to_local().clone()))
            results[rank, mode] = out

    _run_threads(body)
    for rank in range(2):
        ref = results[rank, "original"]
        for mode in MODES:
            for (n, local), (_, ref_local) in zip(results[rank, mode], ref, strict=True):
                assert torch.equal(local, ref_local), (mode, rank, n)
