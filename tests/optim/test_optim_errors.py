"""Bad input gets a specific pipeoff error naming the culprit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipeoff
from pipeoff.optim import OffloadOptimizer
from tests.optim.test_offload import make_net


@pytest.mark.parametrize("mode", ["chunked", "single_pass"])
def test_sparse_grads_refused_before_anything_is_written(mode: str) -> None:
    """single_pass stepped the weights, then failed to copy SGD's sparse momentum back
    (a bare RuntimeError, the optimizer not marked torn: a retry stepped again)."""
    emb = nn.Embedding(10, 4, sparse=True)
    opt = OffloadOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1, momentum=0.9),
                           mode=mode)  # type: ignore[arg-type]
    before = emb.weight.detach().clone()
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(pipeoff.ConfigError, match=r"parameter 0 \(shape \(10, 4\).*sparse"):
        opt.step()
    assert torch.equal(emb.weight, before) and not opt.inner.state


@pytest.mark.parametrize("fraction", [1.0, 0.3])
@pytest.mark.parametrize("mode", ["chunked", "overlap"])
def test_differentiable_is_refused_in_the_chunked_modes(mode: str, fraction: float) -> None:
    """At fraction 1 it stepped silently, outside autograd (a tester's find), where
    torch's step refuses leaf parameters; refused at every step (groups are edited)."""
    net = make_net()
    before = [p.detach().clone() for p in net.parameters()]
    inner = torch.optim.AdamW(net.parameters(), lr=1e-2)
    opt = OffloadOptimizer(inner, mode=mode, offload_fraction=fraction)  # type: ignore[arg-type]
    inner.param_groups[0]["differentiable"] = True  # set after construction, as a loop may
    net(torch.randn(4, 8), 1).sum().backward()
    with pytest.raises(pipeoff.ConfigError, match="differentiable=True.*single_pass"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(net.parameters(), before))


def test_mixed_devices_refused() -> None:
    a = nn.Parameter(torch.zeros(3))
    b = nn.Parameter(torch.zeros(5, device="meta"))
    with pytest.raises(pipeoff.ConfigError, match=r"parameter 1 \(shape \(5,\).*meta"):
        OffloadOptimizer(torch.optim.AdamW([a, b]), mode="chunked")


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "1XB", "big"])
def test_bad_chunk_bytes(bad: object) -> None:
    with pytest.raises(pipeoff.ConfigError, match="chunk_bytes"):
        OffloadOptimizer(torch.optim.AdamW(make_net().parameters()), chunk_bytes=bad)  # type: ignore[arg-type]


def test_bad_mode() -> None:
    with pytest.raises(pipeoff.ConfigError, match="mode"):
        OffloadOptimizer(torch.optim.AdamW(make_net().parameters()), mode="async")  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["chunked", "overlap"])
def test_non_elementwise_optimizer_refused_outside_single_pass(mode: str) -> None:
    with pytest.raises(pipeoff.UnsupportedOptimizerError, match="LBFGS.*single_pass"):
        OffloadOptimizer(torch.optim.LBFGS(make_net().parameters()), mode=mode)


def test_non_elementwise_optimizer_runs_in_single_pass_with_closure() -> None:
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(3))
    nets = [make_net(), make_net()]
    opts = [torch.optim.LBFGS(nets[0].parameters(), lr=0.5, history_size=3, max_iter=4),
            OffloadOptimizer(torch.optim.LBFGS(nets[1].parameters(), lr=0.5, history_size=3,
                                               max_iter=4), mode="single_pass")]
    losses = []
    for net, opt in zip(nets, opts):
        def closure(net: nn.Module = net, opt: torch.optim.Optimizer = opt) -> torch.Tensor:
            opt.zero_grad()
            loss = net(x, 1).pow(2).mean()
            loss.backward()
            return loss
        losses.append([float(opt.step(closure).detach()) for _ in range(3)])
    assert losses[0] == losses[1]
    for p, q in zip(*(n.parameters() for n in nets)):
        assert torch.equal(p, q)


def test_attach_refuses_a_model_that_does_not_own_the_params() -> None:
    net, other = make_net(), make_net()
    opt = OffloadOptimizer(torch.optim.AdamW(net.parameters()), mode="overlap")
    msg = r"parameter 0 \(shape \(40, 8\).*not a parameter of the Net"
    with pytest.raises(pipeoff.ConfigError, match=msg):
        opt.attach(other)


def test_wrapping_twice_refused() -> None:
    opt = OffloadOptimizer(torch.optim.AdamW(make_net().parameters()))
    with pytest.raises(pipeoff.ConfigError, match="optimizer"):
        OffloadOptimizer(opt)  # type: ignore[arg-type]


def test_is_an_optimizer_for_schedulers_and_hooks() -> None:
    net = make_net()
    opt = OffloadOptimizer(torch.optim.AdamW(net.parameters(), lr=1.0), mode="overlap")
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups is opt.inner.param_groups
    calls = []
    opt.register_step_post_hook(lambda o, a, k: calls.append(o))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    net(torch.randn(2, 8), 1).sum().backward()
    opt.step()
    sched.step()
    assert calls == [opt]
    assert opt.inner.param_groups[0]["lr"] == 0.5
    opt.wait_for_step()


@pytest.mark.parametrize("mode", ["single_pass", "chunked", "overlap"])
def test_a_scheduler_built_on_the_wrapped_optimizer_sees_its_steps(mode: str) -> None:
    """A scheduler built on the torch optimizer before it was wrapped (a migration's
    order) wraps that optimizer's step, which the chunks step around: torch warned
    "lr_scheduler.step() before optimizer.step()" although the loop stepped first (a
    tester's find). The schedule itself was right, and is."""
    import warnings

    net = make_net()
    inner = torch.optim.AdamW(net.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=0.5)
    opt = OffloadOptimizer(inner, mode=mode)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (the order check's UserWarning)
        for _ in range(2):
            net(torch.randn(2, 8), 1).sum().backward()
            opt.step()
            opt.zero_grad()
            sched.step()
    opt.wait_for_step()
    assert inner.param_groups[0]["lr"] == 0.25


def test_assigning_full_offload_state_is_refused() -> None:
    """``FullOffloadOptimizer.state`` is a view built at each read: an assignment (a
    reset, a rollback) was kept aside and ignored, silently. It is refused, naming the
    way that works; nothing changes."""
    import collections

    from pipeoff.optim import FullOffloadOptimizer

    model = nn.Linear(4, 4).to(torch.bfloat16)
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
    model(torch.ones(2, 4, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    opt.zero_grad()
    before = {k: v.clone() for k, v in opt.state[model.weight].items()}
    with pytest.raises(pipeoff.ConfigError, match="load_state_dict"):
        opt.state = collections.defaultdict(dict)
    after = opt.state[model.weight]
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
