"""Full offload's step chunks in the next forward's order (``MicroStepPlan.build``,
``forward_order``): under ``overlap="forward"`` the first modules' chunk is stepped
first, so the next forward's first module waits for its own chunk only, not for the
whole host step; under ``overlap="backward"`` the chunks go last parameter first, as
the gradients arrive."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import pipeoff.testing
from pipeoff.optim import FullOffloadOptimizer

pytestmark = pytest.mark.filterwarnings("ignore:pipeoff. pinned host memory")


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)).to(torch.bfloat16)


def chunk_of(opt: FullOffloadOptimizer, p: torch.Tensor) -> int:
    i = opt._registry.position(p)
    return next(k for k, c in enumerate(opt._registry.plan.chunks) if i in c)


@pytest.mark.parametrize("overlap", ["forward", "none", "backward"])
def test_the_chunks_go_in_the_order_their_first_reader_needs(overlap: str) -> None:
    model = make_model()
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, chunk_numel=72,
                               overlap=overlap)
    chunks = [chunk_of(opt, layer.weight) for layer in model]
    assert len(set(chunks)) == 3  # one chunk a layer (72 elements each)
    if overlap == "backward":
        assert chunks == [2, 1, 0]  # as the backward finishes them
    else:
        assert chunks == [0, 1, 2]  # as the next forward reads them


def test_the_next_forwards_first_module_does_not_wait_for_the_last_chunk() -> None:
    """The last layer's chunk is held on the host step lane: by the time the lane
    reaches it, the first layer's chunk has been stepped, and the next forward's first
    layer runs while the hold is on. Stepped last parameter first, the held chunk
    would come first and the first layer's would not have run."""
    model = make_model()
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, chunk_numel=72)
    opt.attach()
    x = torch.randn(4, 8).to(torch.bfloat16)
    model(x).float().pow(2).mean().backward()
    first, last = chunk_of(opt, model[0].weight), chunk_of(opt, model[2].weight)
    reached = threading.Event()
    with pipeoff.testing.hold_task(f"step:{last}", reached=reached):
        opt.step()
        ex = opt._lifecycle.inflight.execution
        reached.wait()  # the lane is at the held chunk
        assert ex.events_for([f"step:{first}"])[0].status == "ok", (
            "the first layer's chunk waits behind the last layer's")
        model[0](x)  # waits for its own chunk's copy only
        assert ex.events_for([f"step:{last}"])[0].status != "ok"  # still held
    opt.wait_for_step()
