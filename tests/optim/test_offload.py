"""OffloadOptimizer: bitwise equal to the wrapped optimizer, in every mode and chunk size."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import pipeoff
from pipeoff import ConfigError
from pipeoff.optim import OffloadOptimizer

MODES = ["single_pass", "chunked", "overlap"]
CHUNKS = {"1B": 1, "mid": 600, "none": None}


class Net(nn.Module):
    """Two layers always used, and a side layer that gets no grad on even steps."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 40)
        self.b = nn.Linear(40, 4)
        self.side = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        y = self.b(torch.relu(self.a(x)))
        return y + self.side(x) if step % 2 else y


def make_net() -> Net:
    torch.manual_seed(0)
    return Net()


def groups(net: Net, lr: float) -> list[dict[str, Any]]:
    return [
        {"params": list(net.a.parameters()), "lr": lr},
        {"params": [*net.b.parameters(), *net.side.parameters()], "lr": lr / 3},
    ]


OPTIMS: dict[str, Callable[[Net], torch.optim.Optimizer]] = {
    "adamw": lambda n: torch.optim.AdamW(groups(n, 1e-2), weight_decay=0.1),
    "adamw_amsgrad_foreach": lambda n: torch.optim.AdamW(
        groups(n, 1e-2), weight_decay=0.1, amsgrad=True, foreach=True),
    "adamw_fused": lambda n: torch.optim.AdamW(groups(n, 1e-2), amsgrad=True, fused=True),
    "adam": lambda n: torch.optim.Adam(groups(n, 1e-2), weight_decay=0.01, foreach=False),
    "sgd_momentum": lambda n: torch.optim.SGD(groups(n, 1e-1), momentum=0.9, dampening=0.1,
                                              nesterov=False, weight_decay=1e-3),
    "adagrad": lambda n: torch.optim.Adagrad(groups(n, 1e-1), initial_accumulator_value=0.1),
    "rmsprop": lambda n: torch.optim.RMSprop(groups(n, 1e-2), momentum=0.5, centered=True),
}


def batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(6, 8, generator=g) for _ in range(n)]


def train(net: Net, opt: torch.optim.Optimizer, sched: Any, xs: list[torch.Tensor],
          first: int = 0) -> list[torch.Tensor]:
    outs = []
    for t, x in enumerate(xs, start=first):
        y = net(x, t)
        outs.append(y.detach().clone())
        y.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return outs


def assert_same(ref_net: Net, ref_opt: torch.optim.Optimizer, net: Net, opt: Any) -> None:
    if isinstance(opt, OffloadOptimizer):
        opt.wait_for_step()
        state = opt.inner.state
    else:
        state = opt.state
    for (name, p), q in zip(ref_net.named_parameters(), net.parameters()):
        assert torch.equal(p, q), name
        assert set(ref_opt.state[p]) == set(state[q]), name
        for k, v in ref_opt.state[p].items():
            assert torch.equal(v, state[q][k]), (name, k)
    for g, h in zip(ref_opt.param_groups, opt.param_groups):
        assert g["lr"] == h["lr"]


@pytest.mark.parametrize("optim", list(OPTIMS))
@pytest.mark.parametrize("chunk", list(CHUNKS))
@pytest.mark.parametrize("mode", MODES)
def test_bitwise_equal_to_wrapped_optimizer(mode: str, chunk: str, optim: str) -> None:
    """4 steps; a grad-less param on even steps; two groups; a scheduler; a reload mid-run."""
    xs = batches(5)
    ref_net = make_net()
    ref_opt = OPTIMS[optim](ref_net)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.7)
    ref_out = train(ref_net, ref_opt, ref_sched, xs)

    net = make_net()
    opt = OffloadOptimizer(OPTIMS[optim](net), mode=mode, chunk_bytes=CHUNKS[chunk])
    opt.attach(net)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    out = train(net, opt, sched, xs[:3])
    # Save, load into a fresh instance, train on.
    sd = copy.deepcopy(opt.state_dict())
    net2 = make_net()
    net2.load_state_dict(net.state_dict())
    opt2 = OffloadOptimizer(OPTIMS[optim](net2), mode=mode, chunk_bytes=CHUNKS[chunk])
    opt2.load_state_dict(sd)
    opt2.attach(net2)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.7)
    sched2.load_state_dict(sched.state_dict())
    out += train(net2, opt2, sched2, xs[3:], first=3)

    for a, b in zip(ref_out, out):
        assert torch.equal(a, b)
    assert_same(ref_net, ref_opt, net2, opt2)


def test_state_lives_in_host_memory_and_grads_are_untouched() -> None:
    net = make_net()
    opt = OffloadOptimizer(torch.optim.AdamW(net.parameters()), mode="overlap", chunk_bytes=512)
    net(batches(1)[0], 1).sum().backward()
    grads = [p.grad.clone() for p in net.parameters()]
    opt.step()
    opt.wait_for_step()
    for p, g in zip(net.parameters(), grads):
        assert torch.equal(p.grad, g)
        for k, v in opt.state[p].items():
            assert v.device.type == "cpu", k
    assert pipeoff.pools_for("cpu").device.stats().live_bytes == 0


@pytest.mark.parametrize("chunk_bytes", [64, 600, 4096])
def test_peak_device_staging_is_bounded(chunk_bytes: int) -> None:
    net = make_net()
    opt = OffloadOptimizer(torch.optim.AdamW(net.parameters(), amsgrad=True), mode="chunked",
                           chunk_bytes=chunk_bytes, prefetch=1)
    for x in batches(2):
        net(x, 1).sum().backward()
        opt.step()
        opt.zero_grad()
    plan = opt.plan
    assert all(c.nbytes <= chunk_bytes for c in plan.chunks)
    # A parameter larger than a chunk is cut so that the bound holds
    # (net.a.weight alone is 320 floats: 3840 bytes of AMSGrad AdamW state).
    if chunk_bytes < 3840:
        assert any(s.hi - s.lo < 320 for c in plan.chunks for s in c.segments if s.param == 0)
    summary = opt.last_trace.summary()  # type: ignore[union-attr]
    assert 0 < summary.peak_device_staging_bytes <= 2 * chunk_bytes
    assert summary.device_budget_bytes == 2 * plan.max_chunk_bytes


def test_plan_is_independent_of_which_params_have_grads() -> None:
    net = make_net()
    opt = OffloadOptimizer(torch.optim.AdamW(net.parameters()), mode="chunked", chunk_bytes=256)
    before = opt.plan.signature()
    net(batches(1)[0], 0).sum().backward()  # side gets no grad
    assert net.side.weight.grad is None
    opt.step()
    assert opt.plan.signature() == before
    kinds = [r.kind for r in opt.last_trace.tasks]  # type: ignore[union-attr]
    # Every chunk still runs (same number of steps on every rank); the state of
    # grad-less parameters does not move.
    assert kinds.count("optimizer_chunk") == len(opt.plan.chunks)
    assert kinds.count("h2d") < len(opt.plan.chunks)


def test_chunks_pipeline_h2d_update_d2h() -> None:
    """Chunk k+1's H2D can run while chunk k updates: the lanes are separate."""
    net = make_net()
    opt = OffloadOptimizer(torch.optim.AdamW(net.parameters()), mode="chunked", chunk_bytes=256)
    net(batches(1)[0], 1).sum().backward()
    opt.step()
    trace = opt.last_trace
    assert trace is not None
    lanes = {r.kind: r.lane for r in trace.tasks}
    assert len({lanes["h2d"], lanes["optimizer_chunk"], lanes["d2h"]}) == 3


@pytest.mark.parametrize("mode", ["chunked", "overlap"])
def test_mixed_dtypes_and_empty_params(mode: str) -> None:
    """bf16 and fp32 parameters share chunks; an empty parameter is stepped too."""

    def make() -> list[nn.Parameter]:
        g = torch.Generator().manual_seed(0)
        return [nn.Parameter(torch.randn(37, generator=g).to(torch.bfloat16)),
                nn.Parameter(torch.randn(0)),
                nn.Parameter(torch.randn(5, 11, generator=g)),
                nn.Parameter(torch.randn(3, generator=g, dtype=torch.float64))]

    ref, mine = make(), make()
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, amsgrad=True)
    opt = OffloadOptimizer(torch.optim.AdamW(mine, lr=1e-2, amsgrad=True), mode=mode,
                           chunk_bytes=100)
    for step in range(3):
        g = torch.Generator().manual_seed(10 + step)
        for a, b in zip(ref, mine):
            grad = torch.randn(a.shape, generator=g).to(a.dtype)
            a.grad, b.grad = grad.clone(), grad.clone()
        ref_opt.step()
        opt.step()
    opt.wait_for_step()
    for a, b in zip(ref, mine):
        assert torch.equal(a, b)
        for k, v in ref_opt.state[a].items():
            assert torch.equal(v, opt.state[b][k]), k


def test_distributed_checkpoint_state_dict_round_trip() -> None:
    """DCP's get/set_optimizer_state_dict (which steps a fresh optimizer with lr=0) work."""
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    net = make_net()
    opt = OffloadOptimizer(torch.optim.AdamW(net.parameters()), mode="overlap", chunk_bytes=256)
    before = [p.detach().clone() for p in net.parameters()]
    get_optimizer_state_dict(net, opt)  # initializes the state with an lr=0 step
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
    net(batches(1)[0], 1).sum().backward()
    opt.step()
    sd = get_optimizer_state_dict(net, opt)
    net2 = make_net()
    opt2 = OffloadOptimizer(torch.optim.AdamW(net2.parameters()), mode="overlap",
                            chunk_bytes=256)
    set_optimizer_state_dict(net2, opt2, sd)
    for p, q in zip(net.parameters(), net2.parameters()):
        for k, v in opt.state[p].items():
            assert torch.equal(v, opt2.state[q][k]), k


def test_add_param_group_extends_plan_and_forward_waits() -> None:
    net, ref = make_net(), make_net()
    opt = OffloadOptimizer(torch.optim.AdamW(list(net.a.parameters()) + list(net.b.parameters())),
                           mode="overlap", chunk_bytes=256)
    ref_opt = torch.optim.AdamW(list(ref.a.parameters()) + list(ref.b.parameters()))
    opt.attach(net)
    opt.add_param_group({"params": list(net.side.parameters()), "lr": 0.1})
    ref_opt.add_param_group({"params": list(ref.side.parameters()), "lr": 0.1})
    for x in batches(3):
        for m, o in ((net, opt), (ref, ref_opt)):
            m(x, 1).pow(2).mean().backward()
            o.step()
            o.zero_grad()
    opt.wait_for_step()
    assert all(torch.equal(p, q) for p, q in zip(ref.parameters(), net.parameters()))
    assert len(opt._attach_handles) == 4  # a, b and side own parameters; the root's end


def test_load_state_dict_never_moves_state_to_the_parameters_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch's load_state_dict casts every state tensor onto the parameter's device
    (on a GPU: all of the state at once). OffloadOptimizer loads state to host."""
    net = make_net()
    opt = OffloadOptimizer(torch.optim.AdamW(net.parameters(), amsgrad=True), mode="chunked",
                           chunk_bytes=256)
    net(batches(1)[0], 1).sum().backward()
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    cast: list[object] = []
    real = torch.optim.Optimizer._process_value_according_to_param_policy

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        cast.append(kwargs.get("key", args[4] if len(args) > 4 else None))
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.optim.Optimizer, "_process_value_according_to_param_policy",
                        staticmethod(spy))
    opt2 = OffloadOptimizer(torch.optim.AdamW(make_net().parameters(), amsgrad=True),
                            mode="chunked", chunk_bytes=256)
    opt2.load_state_dict(sd)
    assert cast == []
    for a, b in zip(opt.state.values(), opt2.state.values()):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) and a[k] is not b[k] for k in a)
    with pytest.raises(pipeoff.ConfigError, match="expects an optimizer state dict"):
        opt2.load_state_dict({"state": {}})


@contextlib.contextmanager
def global_step_hook_calls() -> Iterator[list[str]]:
    """torch's global step pre and post hooks, registered for the block: the calls
    they saw, in order (``"pre"``, ``"post"``)."""
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    calls: list[str] = []
    handles = [register_optimizer_step_pre_hook(lambda o, a, k: calls.append("pre")),
               register_optimizer_step_post_hook(lambda o, a, k: calls.append("post"))]
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


@pytest.mark.parametrize("mode", ["single_pass", "chunked", "overlap"])
def test_global_step_hooks_fire_once_per_step_in_every_mode(mode: str) -> None:
    with global_step_hook_calls() as calls:
        net = make_net()
        opt = OffloadOptimizer(torch.optim.AdamW(net.parameters()), mode=mode, chunk_bytes=256)
        net(batches(1)[0], 1).sum().backward()
        opt.step()
        opt.wait_for_step()
    assert calls == ["pre", "post"]


def test_prefetch_and_a_device_budget_name_the_staging_bound() -> None:
    import warnings

    net = make_net()
    with pytest.warns(FutureWarning, match="now prefetch"):
        opt = OffloadOptimizer(torch.optim.AdamW(net.parameters()), chunk_bytes=4096,
                               lookahead=1)
    assert opt.prefetch == 1
    with pytest.warns(FutureWarning, match=r"\.prefetch"):
        assert opt.lookahead == 1
    # A budget alone: chunks of a third of it, the schedule bounded by it.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = OffloadOptimizer(torch.optim.AdamW(net.parameters()), mode="chunked",
                               device_budget_bytes=3 * 4096)
    assert opt.chunk_bytes == 4096 and "device_budget_bytes=12288" in repr(opt)
    for x in batches(2):
        net(x, 1).sum().backward()
        opt.step()
        opt.zero_grad()
    trace = opt.last_trace
    assert trace is not None and trace.device_budget_bytes == 3 * 4096
    assert trace.summary().peak_device_staging_bytes <= 3 * 4096
    with pytest.raises(ConfigError, match="give prefetch or device_budget_bytes, not both"):
        OffloadOptimizer(torch.optim.AdamW(net.parameters()), prefetch=1,
                         device_budget_bytes=1 << 20)
    with pytest.raises(ConfigError, match="must hold one chunk"):
        OffloadOptimizer(torch.optim.AdamW(net.parameters()), chunk_bytes=1 << 20,
                         device_budget_bytes=1 << 10)
    with pytest.raises(ConfigError, match="prefetch must be an int >= 0"):
        OffloadOptimizer(torch.optim.AdamW(net.parameters()), prefetch=-1)
