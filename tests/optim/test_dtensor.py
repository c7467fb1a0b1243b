"""DTensor parameters over a threaded process group: identical plans, exactness, plan checks."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import pipeoff
from pipeoff.optim import OffloadOptimizer, planned_numel


def run_threads(fn: Callable[[int], Any], world_size: int = 2) -> dict[int, Any]:
    """Run ``fn(rank)`` on one thread per rank, each in a threaded process group."""
    from torch.testing._internal.distributed.multi_threaded_pg import (
        _install_threaded_pg,
        _uninstall_threaded_pg,
    )

    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    _install_threaded_pg()
    store = dist.HashStore()
    results: dict[int, Any] = {}
    errors: list[BaseException] = []

    def worker(rank: int) -> None:
        dist.init_process_group(backend="threaded", rank=rank, world_size=world_size, store=store)
        try:
            results[rank] = fn(rank)
        except BaseException as err:  # noqa: BLE001 - re-raised on the test thread
            errors.append(err)
        finally:
            dist.destroy_process_group()

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(world_size)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        _uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    if errors:
        raise errors[0]
    return results


SHAPES = [(3, 1000), (5,), (7, 3)]


def make_params(mesh: Any) -> list[nn.Parameter]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    g = torch.Generator().manual_seed(0)
    out = []
    for k, shape in enumerate(SHAPES):
        full = torch.randn(shape, generator=g)
        placement = Replicate() if k == 2 else Shard(0)
        out.append(nn.Parameter(distribute_tensor(full, mesh, [placement])))
    return out


def set_grads(params: list[nn.Parameter], step: int) -> None:
    from torch.distributed.tensor import distribute_tensor

    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        full = torch.randn(p.shape, generator=g)
        p.grad = distribute_tensor(full, p.device_mesh, p.placements)


def test_planned_numel_uses_the_largest_shard() -> None:
    def body(rank: int) -> tuple[int, int, int]:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2,))
        p = make_params(mesh)[0]
        return planned_numel(p), p.to_local().numel(), planned_numel(make_params(mesh)[1])

    res = run_threads(body)
    assert res[0] == (2000, 2000, 3)
    assert res[1] == (2000, 1000, 3)


@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.0])
@pytest.mark.parametrize("mode", ["chunked", "overlap"])
def test_dtensor_params_bitwise_and_plans_identical(mode: str, fraction: float) -> None:
    """At 0.5 the (3, 1000) parameter is the host part, the others step on the device
    (by torch's kernel, on DTensors): the split comes from global shapes, as the plan."""
    def body(rank: int) -> tuple[tuple[int, ...], bool]:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2,))
        ref, mine = make_params(mesh), make_params(mesh)
        ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, amsgrad=True)
        opt = OffloadOptimizer(torch.optim.AdamW(mine, lr=1e-2, weight_decay=0.1, amsgrad=True),
                               mode=mode, chunk_bytes=5000, offload_fraction=fraction)
        assert opt.memory_stats()["params_device"] == {1.0: 0, 0.5: 2, 0.0: 3}[fraction]
        for step in range(3):
            set_grads(ref, step)
            set_grads(mine, step)
            ref_opt.step()
            opt.step()
        opt.wait_for_step()
        same = all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(ref, mine))
        for a, b in zip(ref, mine):
            for k, v in ref_opt.state[a].items():
                w = opt.state[b][k]
                same &= type(v) is type(w)
                same &= torch.equal(getattr(v, "_local_tensor", v), getattr(w, "_local_tensor", w))
        return opt.plan.signature(), same

    res = run_threads(body)
    assert res[0][0] == res[1][0]  # the same chunks on both ranks despite uneven shards
    assert res[0][1] and res[1][1]


def test_plan_mismatch_raises_on_every_rank_before_any_write() -> None:
    """The plan is checked where every rank is known to be: at construction."""

    def body(rank: int) -> tuple[str, bool]:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2,))
        params = make_params(mesh)
        before = [p.to_local().clone() for p in params]
        inner = torch.optim.AdamW(params)
        set_grads(params, 0)
        try:
            OffloadOptimizer(inner, mode="chunked", chunk_bytes=4000 if rank == 0 else 8000)
        except pipeoff.PlanMismatchError as err:
            untouched = all(torch.equal(b, p.to_local()) for b, p in zip(before, params))
            return str(err), untouched and not inner.state
        return "", False

    res = run_threads(body)
    for rank in (0, 1):
        msg, untouched = res[rank]
        assert "disagree" in msg
        assert untouched


@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.0])
@pytest.mark.parametrize("overlap", ["none", "forward"])
def test_full_offload_sees_weights_written_through_the_dtensor(overlap: str,
                                                              fraction: float) -> None:
    """An in-place op on a DTensor parameter (``copy_`` as ``model.load_state_dict`` and
    ``set_model_state_dict`` run it, a ``clamp_``) bumps the DTensor's version counter,
    not its local shard's: FullOffloadOptimizer looked at the shard's alone, missed the
    write, and its next step wrote the old masters back over a loaded model (a fine-tune
    trained from the random init, silently: a tester's find). Bitwise plain AdamW."""
    from pipeoff.optim import FullOffloadOptimizer

    def fn(rank: int) -> list[bool]:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, distribute_module, distribute_tensor

        mesh = init_device_mesh("cpu", (1,))

        def build() -> nn.Module:
            torch.manual_seed(0)
            return distribute_module(nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4)), mesh)

        mine, theirs = build(), build()
        opt = FullOffloadOptimizer(mine, torch.optim.AdamW, lr=1e-2, overlap=overlap,
                                   offload_fraction=fraction)
        ref = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(1)
        pretrained = {k: torch.randn(v.shape, generator=g) for k, v in mine.state_dict().items()}
        x = distribute_tensor(torch.randn(3, 8, generator=g), mesh, [Replicate()])
        for model, o in ((mine, opt), (theirs, ref)):
            with torch.no_grad():  # a load after the optimizer was built
                for k, p in model.named_parameters():
                    p.copy_(distribute_tensor(pretrained[k], mesh, [Replicate()]))
            for step in range(3):
                model(x).pow(2).mean().backward()
                o.step()
                o.zero_grad()
                if step == 0:
                    getattr(o, "wait_for_step", lambda: None)()
                    with torch.no_grad():  # a clamp between steps
                        for p in model.parameters():
                            p.clamp_(-0.05, 0.05)
        opt.wait_for_step()
        return [torch.equal(p.full_tensor(), q.full_tensor())
                for p, q in zip(mine.parameters(), theirs.parameters(), strict=True)]

    assert all(run_threads(fn, 1)[0])
