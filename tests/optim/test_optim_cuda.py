"""The CUDA path: streams, events, pinned host state (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipeoff
import pipeoff.testing
from pipeoff.optim import OffloadOptimizer

pytestmark = pytest.mark.cuda


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(),
                         nn.Linear(1024, 16)).cuda()


def batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(1)
    return [torch.randn(64, 256, generator=g, device="cuda") for _ in range(n)]


def train(net: nn.Module, opt: torch.optim.Optimizer, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8)
    outs = []
    for x in xs:
        y = net(x)
        outs.append(y.detach().clone())
        y.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return outs


@pytest.mark.parametrize("impl", ["foreach", "fused"])
@pytest.mark.parametrize("mode", ["single_pass", "chunked", "overlap"])
def test_cuda_bitwise_equal(mode: str, impl: str) -> None:
    kw = {"lr": 1e-3, "weight_decay": 0.1, "amsgrad": True, impl: True}
    xs = batches(4)
    ref = make_net()
    ref_opt = torch.optim.AdamW(ref.parameters(), **kw)
    ref_out = train(ref, ref_opt, xs)
    net = make_net()
    opt = OffloadOptimizer(torch.optim.AdamW(net.parameters(), **kw), mode=mode,
                           chunk_bytes=1 << 20)
    opt.attach(net)
    # Slow the optimizer lane (a GPU-side sleep): a missing wait shows as wrong numbers.
    with pipeoff.testing.delay_lane("compute", 0.002):
        out = train(net, opt, xs)
        opt.wait_for_step()
    torch.cuda.synchronize()
    for a, b in zip(ref_out, out):
        assert torch.equal(a, b)
    for p, q in zip(ref.parameters(), net.parameters()):
        assert torch.equal(p, q)
        for k, v in ref_opt.state[p].items():
            w = opt.state[q][k]
            if k != "step":
                assert w.device.type == "cpu" and w.is_pinned(), k
            assert torch.equal(v.cpu(), w.cpu()), k


def test_cuda_without_forward_waits_reads_stale_params() -> None:
    xs = batches(2)
    ref = make_net()
    ref_out = train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3), xs)
    net = make_net()
    opt = OffloadOptimizer(torch.optim.AdamW(net.parameters(), lr=1e-3), mode="overlap",
                           chunk_bytes=1 << 20)
    with pipeoff.testing.delay_lane("compute", 0.01):
        net(xs[0]).pow(2).mean().backward()
        opt.step()
        with torch.no_grad():
            stale = net(xs[1])
        opt.wait_for_step()
    assert not torch.equal(stale, ref_out[1])


def test_cuda_peak_state_memory_is_bounded() -> None:
    net = make_net()
    chunk = 1 << 20
    opt = OffloadOptimizer(torch.optim.AdamW(net.parameters(), foreach=True), mode="chunked",
                           chunk_bytes=chunk, lookahead=2)
    for x in batches(2):
        net(x).sum().backward()
        opt.step()
        opt.zero_grad()
    summary = opt.last_trace.summary()  # type: ignore[union-attr]
    assert summary.peak_device_staging_bytes <= 3 * chunk
    assert all(c.nbytes <= chunk for c in opt.plan.chunks)
    # No optimizer state tensor stays on the GPU.
    assert all(v.device.type == "cpu" for st in opt.state.values() for k, v in st.items()
               if k != "step")
