"""FullOffloadOptimizer under torchft's DistributedDataParallel and OptimizerWrapper
(issue 20): two replicas (threads) with real Managers behind a real Lighthouse, over
gloo, bitwise against the same run with plain AdamW."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torchft.coordination import LighthouseServer
from torchft.ddp import DistributedDataParallel as FtDDP
from torchft.manager import Manager
from torchft.optim import OptimizerWrapper
from torchft.process_group import ProcessGroupGloo

from pipeoff import ConfigError
from pipeoff.optim import FullOffloadOptimizer, HostGrad
from tests.ft._replicas import make_model

pytestmark = [pytest.mark.slow,
              pytest.mark.filterwarnings("ignore:pipeoff. pinned host memory")]


def _replica(rid: int, lighthouse: str, full: bool, micro: int) -> list[torch.Tensor]:
    store = dist.TCPStore(host_name="localhost", port=0, is_master=True, wait_for_workers=False)
    model = make_model(0)  # the same start on both replicas
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=20)), min_replica_size=2,
        load_state_dict=lambda sd: model.load_state_dict(sd["model"]),
        state_dict=lambda: {"model": model.state_dict()},
        replica_id=f"replica_{rid}", store_addr="localhost", store_port=store.port,
        rank=0, world_size=1, lighthouse_addr=lighthouse, use_async_quorum=False,
        init_sync=False, timeout=timedelta(seconds=20), quorum_timeout=timedelta(seconds=30))
    try:
        ddp = FtDDP(manager, model)
        inner: Any = (FullOffloadOptimizer(ddp, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
                      if full else torch.optim.AdamW(ddp.parameters(), lr=1e-2,
                                                     weight_decay=0.1))
        opt = OptimizerWrapper(manager, inner)
        g = torch.Generator().manual_seed(100 + rid)
        for _ in range(3):
            opt.zero_grad()
            for _ in range(micro):  # DDP reduces each one, and accumulates in .grad
                ddp(torch.randn(4, 16, generator=g)).pow(2).mean().backward()
            opt.step()
        getattr(inner, "wait_for_step", lambda: None)()
        assert all(p.grad is None or isinstance(p.grad, HostGrad)
                   for p in model.parameters()) or not full
        return [p.detach().clone() for p in model.parameters()]
    finally:
        manager.shutdown(wait=False)


def _run(full: bool, micro: int) -> list[list[torch.Tensor]]:
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    try:
        with ThreadPoolExecutor(2) as ex:
            futs = [ex.submit(_replica, i, lighthouse.address(), full, micro) for i in range(2)]
            return [f.result(timeout=120) for f in futs]
    finally:
        lighthouse.shutdown()


@pytest.mark.parametrize("micro", [1, 2])
def test_torchft_ddp_and_optimizer_wrapper_step_the_averaged_gradient(micro: int) -> None:
    mine = _run(True, micro)
    ref = _run(False, micro)
    for r in (0, 1):
        for p, q in zip(mine[r], ref[r]):
            assert torch.equal(p, q), r
    for p, q in zip(mine[0], mine[1]):
        assert torch.equal(p, q)  # the replicas agree: the gradient was averaged


def test_torchft_pure_ddp_is_refused_clearly() -> None:
    from torchft.ddp import PureDistributedDataParallel

    class _Manager:  # PureDistributedDataParallel only keeps it for its hooks
        pass

    model = PureDistributedDataParallel(_Manager(), make_model(0))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="PureDistributedDataParallel"):
        FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
