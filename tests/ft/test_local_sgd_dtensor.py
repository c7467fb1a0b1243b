"""pipeoff.ft.LocalSGD write-back of DTensor parameters, 2-way sharded over the threaded PG."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any
from unittest.mock import create_autospec

import pytest
import torch
import torch.distributed as dist
from torch import nn, optim
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torchft.manager import Manager
from torchft.work import _DummyWork

import pipeoff.ft

multi_threaded_pg = pytest.importorskip("torch.testing._internal.distributed.multi_threaded_pg")

MODES: dict[str, dict[str, Any]] = {
    "original": {},
    "sync": {"offload_to_cpu": True, "schedule": "synchronous"},
    "pipelined_split": {"offload_to_cpu": True, "bucket_bytes": 24,
                        "device_budget_bytes": 48},
    "pipelined_packed": {"offload_to_cpu": True, "bucket_bytes": 4096},
}


def _run_threads(fn: Callable[[int], None], world_size: int = 2) -> None:
    """Run ``fn(rank)`` on ``world_size`` threads joined by torch's threaded process group."""
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    multi_threaded_pg._install_threaded_pg()
    store = dist.HashStore()
    errors: list[BaseException] = []

    def worker(rank: int) -> None:
        dist.init_process_group(backend="threaded", rank=rank, world_size=world_size, store=store)
        try:
            fn(rank)
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            errors.append(e)
        finally:
            dist.destroy_process_group()

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    multi_threaded_pg._uninstall_threaded_pg()
    torch._C._distributed_c10d._set_thread_isolation_mode(False)
    if errors:
        raise errors[0]


def _sharded_model(mesh: Any) -> nn.Module:
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 5), nn.Linear(5, 3))  # 5 and 3 rows: uneven on 2 ranks
    placements = {"0.weight": Shard(0), "0.bias": Shard(0), "1.weight": Shard(1),
                  "1.bias": Replicate()}
    for name, p in list(model.named_parameters()):
        module, attr = name.split(".")
        full = torch.randn(p.shape, generator=g)
        setattr(model[int(module)], attr,
                nn.Parameter(distribute_tensor(full, mesh, [placements[name]])))
    return model


def _manager(rank: int) -> Any:
    manager = create_autospec(Manager)
    manager.errored.return_value = None
    manager.should_commit.return_value = True
    # A stand-in average that differs per element and per rank.
    manager.allreduce.side_effect = (
        lambda t, should_quantize=False: _DummyWork(t.mul_(0.5).add_(rank + 1)))
    return manager


@pytest.mark.timeout(60)
def test_dtensor_write_back_keeps_layout_and_matches_original() -> None:
    results: dict[tuple[int, str], list[tuple[Any, ...]]] = {}

    def body(rank: int) -> None:
        mesh = init_device_mesh("cpu", (2,))
        for mode, kwargs in MODES.items():
            model = _sharded_model(mesh)
            before = {n: (p.device_mesh, p.placements, p.shape, p.stride(), p.to_local().shape)
                      for n, p in model.named_parameters()}
            local_sgd = pipeoff.ft.LocalSGD(_manager(rank), model,
                                            optim.SGD(model.parameters(), lr=0.1), 1, **kwargs)
            local_sgd.sync()
            out = []
            for n, p in model.named_parameters():
                assert isinstance(p, DTensor), n
                assert (p.device_mesh, p.placements, p.shape, p.stride(),
                        p.to_local().shape) == before[n], n
                out.append((n, p.to_local().clone(), p.full_tensor()))
            results[rank, mode] = out

    _run_threads(body)
    # The uneven shards really are uneven.
    assert results[0, "original"][0][1].shape == (3, 8)
    assert results[1, "original"][0][1].shape == (2, 8)
    for rank in range(2):
        ref = results[rank, "original"]
        for mode in MODES:
            for (n, local, full), (_, ref_local, ref_full) in zip(results[rank, mode], ref,
                                                                strict=True):
                assert torch.equal(local, ref_local), (mode, rank, n)
                assert torch.equal(full, ref_full), (mode, rank, n)
