"""OffloadOptimizer.step(closure), as PyTorch Lightning's automatic optimization calls it.

The right value is plain ``torch.optim.AdamW`` given the same closure: the
closure runs once, under ``torch.enable_grad()``, then every parameter is
stepped, and ``step`` returns the closure's loss. Overlap runs hold the
optimizer lane back (``delay_lane``), so a closure whose forward did not wait
for the previous step's chunks reads stale weights and shows as a wrong number.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest
import torch
from torch import nn

import pipeoff
import pipeoff.testing
from pipeoff.optim import OffloadOptimizer
from tests.optim.test_offload import make_net

MODES = ["single_pass", "chunked", "overlap"]


def closure_for(net: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, step: int,
                calls: list[int] | None = None) -> Callable[[], torch.Tensor]:
    """What Lightning's closure does: forward, zero_grad, backward; returns the loss."""
    def closure() -> torch.Tensor:
        if calls is not None:
            calls.append(step)
        loss = net(x, step).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        return loss
    return closure


def make_pair(mode: str) -> tuple[nn.Module, torch.optim.Optimizer, nn.Module, OffloadOptimizer]:
    ref, net = make_net(), make_net()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    opt = OffloadOptimizer(torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1),
                           mode=mode, chunk_bytes=600)  # type: ignore[arg-type]
    return ref, ref_opt, net, opt


def xs(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(6, 8, generator=g) for _ in range(n)]


def held_back(opt: OffloadOptimizer) -> contextlib.AbstractContextManager[None]:
    if opt.mode == "overlap":
        return pipeoff.testing.delay_lane("compute", 0.01)
    return contextlib.nullcontext()


def assert_same(ref: nn.Module, ref_opt: torch.optim.Optimizer, net: nn.Module,
                opt: OffloadOptimizer) -> None:
    for p, q in zip(ref.parameters(), net.parameters()):
        assert torch.equal(p, q)
        for k, v in ref_opt.state[p].items():
            assert torch.equal(v, opt.state[q][k]), k


@pytest.mark.parametrize("attach", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_closure_steps_like_torch(mode: str, attach: bool) -> None:
    ref, ref_opt, net, opt = make_pair(mode)
    if attach:
        opt.attach(net)
    batches = xs(5)
    want = [ref_opt.step(closure_for(ref, ref_opt, x, t)) for t, x in enumerate(batches)]
    calls: list[int] = []
    got = []
    with held_back(opt):
        for t, x in enumerate(batches):
            loss = opt.step(closure_for(net, opt, x, t, calls))
            assert isinstance(loss, torch.Tensor) and loss.requires_grad
            got.append(loss)
    assert calls == list(range(5))  # once per step, not once per chunk
    assert mode == "single_pass" or len(opt.plan.chunks) > 1
    for a, b in zip(want, got):
        assert torch.equal(a, b)  # type: ignore[arg-type]
    opt.wait_for_step()
    assert_same(ref, ref_opt, net, opt)


@pytest.mark.parametrize("mode", MODES)
def test_closure_runs_with_grad_under_no_grad(mode: str) -> None:
    """torch's step enables grad for its closure; so does this one."""
    ref, ref_opt, net, opt = make_pair(mode)
    x = xs(1)[0]
    with torch.no_grad():
        ref_opt.step(closure_for(ref, ref_opt, x, 1))
        opt.step(closure_for(net, opt, x, 1))
    opt.wait_for_step()
    assert_same(ref, ref_opt, net, opt)


@pytest.mark.timeout(60)  # with the closure waiting for the step first, it would hang
def test_overlap_closure_runs_while_the_previous_step_is_in_flight() -> None:
    """In overlap mode step(closure) does not wait for the step in flight before the
    closure: its forward overlaps the chunks, waiting only where it reads them."""
    ref, ref_opt, net, opt = make_pair("overlap")
    batches = xs(2)
    for t, x in enumerate(batches):
        ref_opt.step(closure_for(ref, ref_opt, x, t))
    seen = []
    with pipeoff.testing.hold_task("opt0") as release:
        opt.step(closure_for(net, opt, batches[0], 0))
        first = opt.last_execution
        assert first is not None
        closure = closure_for(net, opt, batches[1], 1)

        def observing() -> torch.Tensor:
            seen.append(first.done())  # opt0 is held: the step cannot have finished
            release.set()
            return closure()

        opt.step(observing)
    assert seen == [False]
    opt.wait_for_step()
    assert_same(ref, ref_opt, net, opt)


class Boom(Exception):
    pass


@pytest.mark.parametrize("mode", MODES)
def test_a_closure_that_raises_steps_nothing(mode: str) -> None:
    """The closure's error reaches the caller, with nothing stepped, as in torch; training
    then goes on as torch's does after the same failure."""
    ref, ref_opt, net, opt = make_pair(mode)
    batches = xs(4)
    err = Boom("bad batch")

    def raising(model: nn.Module, o: torch.optim.Optimizer) -> Callable[[], torch.Tensor]:
        def closure() -> torch.Tensor:
            closure_for(model, o, batches[1], 1)()  # forward and backward, then fail
            raise err
        return closure

    ref_opt.step(closure_for(ref, ref_opt, batches[0], 0))
    with pytest.raises(Boom):
        ref_opt.step(raising(ref, ref_opt))
    for t in (2, 3):
        ref_opt.step(closure_for(ref, ref_opt, batches[t], t))

    with held_back(opt):
        opt.step(closure_for(net, opt, batches[0], 0))
        opt.wait_for_step()
        last = opt.last_execution
        params = [p.detach().clone() for p in net.parameters()]
        state = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
        with pytest.raises(Boom) as info:
            opt.step(raising(net, opt))
        assert info.value is err
        assert opt.last_execution is last  # nothing was launched
        assert all(torch.equal(a, b) for a, b in zip(params, net.parameters()))
        assert all(torch.equal(v, opt.state_dict()["state"][0][k]) for k, v in state.items())
        for t in (2, 3):
            opt.step(closure_for(net, opt, batches[t], t))
    opt.wait_for_step()
    assert_same(ref, ref_opt, net, opt)


@pytest.mark.parametrize("mode", ["chunked", "overlap"])
def test_a_torn_optimizer_refuses_before_running_the_closure(mode: str) -> None:
    net = make_net()
    opt = OffloadOptimizer(torch.optim.AdamW(net.parameters()), mode=mode,  # type: ignore[arg-type]
                           chunk_bytes=256)
    x = xs(1)[0]
    with pipeoff.testing.fail_task("d2h2", ValueError("lost the link")):
        with pytest.raises(ValueError, match="lost the link"):
            opt.step(closure_for(net, opt, x, 1))
            opt.wait_for_step()
    calls: list[int] = []
    with pytest.raises(pipeoff.StepFailedError, match="step"):
        opt.step(closure_for(net, opt, x, 1, calls))
    assert calls == []


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_single_pass_puts_the_state_back_in_host_memory_when_the_closure_raises(
        fraction: float) -> None:
    """``single_pass`` moves the state to the device for the wrapped step and back after
    it; a closure that raises used to leave it in the step's device copies for the rest
    of the run (a fresh tester's find). Training then goes on as torch's does."""
    ref, ref_opt, net, _ = make_pair("single_pass")
    opt = OffloadOptimizer(torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1),
                           mode="single_pass", offload_fraction=fraction)
    batches = xs(4)

    def raising(model: nn.Module, o: torch.optim.Optimizer) -> Callable[[], torch.Tensor]:
        def closure() -> torch.Tensor:
            closure_for(model, o, batches[1], 1)()
            raise Boom("bad batch")
        return closure

    for model, o in ((ref, ref_opt), (net, opt)):
        o.step(closure_for(model, o, batches[0], 0))
        homes = {(id(p), k): v for p in model.parameters() for k, v in o.state[p].items()}
        with pytest.raises(Boom):
            o.step(raising(model, o))
        assert {(id(p), k): v for p in model.parameters()
                for k, v in o.state[p].items()}.items() == homes.items()
        for t in (2, 3):
            o.step(closure_for(model, o, batches[t], t))
    assert_same(ref, ref_opt, net, opt)
