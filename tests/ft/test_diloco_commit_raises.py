"""A ``should_commit()`` that raises (a lighthouse gone, too many commit failures):
torchft's DiLoCo restored the fragment's backup before asking, so a loop that catches
the error goes on from the global parameters. pipeoff's offloaded syncs left the local
ones (a tester's find); they restore the backup too, bitwise torchft's."""

from __future__ import annotations

from typing import Any
from unittest.mock import create_autospec

import pytest
import torch
from torch import optim
from torchft.local_sgd import DiLoCo as TorchftDiLoCo
from torchft.manager import Manager

import pipeoff.ft
from tests.ft._diloco_replicas import make_model, sgd_nesterov
from tests.ft.test_diloco import OFFLOADED


class _Done:
    def wait(self, timeout: Any = None) -> bool:
        return True


def _manager() -> Any:
    """``should_commit()`` raises."""
    manager = create_autospec(Manager)
    manager._use_async_quorum = False
    manager.current_step.return_value = 0
    manager.errored.return_value = None
    manager.should_commit.side_effect = RuntimeError("injected: should_commit failed")
    manager.allreduce.side_effect = lambda t, should_quantize=False: _Done()
    return manager


def _train(cls: Any, kwargs: dict[str, Any], delay: int) -> list[torch.Tensor]:
    """Two fragments, sync_every 4: the first sync's decision raises. The parameters
    the handler sees (a checkpoint saved there). (torchft's class cannot go on after
    it: its step count is not reset, and its next sync asserts.)"""
    model = make_model(0)
    inner = optim.SGD(model.parameters(), lr=0.1)
    outer = [sgd_nesterov(block.parameters()) for block in model]
    with cls(_manager(), list(model), inner, outer, 4, fragment_sync_delay=delay,
             **kwargs), pytest.raises(RuntimeError, match="injected"):
        for step in range(4):
            inner.zero_grad()
            model(torch.ones(2, 12) * (step + 1)).sum().backward()
            inner.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("delay", [0, 1])
@pytest.mark.parametrize("mode", list(OFFLOADED))
def test_a_should_commit_that_raises_leaves_the_backup_as_torchfts(mode: str,
                                                                    delay: int) -> None:
    want = _train(TorchftDiLoCo, {}, delay)
    got = _train(pipeoff.ft.DiLoCo, OFFLOADED[mode], delay)
    for k, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"parameter {k}: {(a - b).abs().max()}"
