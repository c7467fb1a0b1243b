"""What the training loop writes to ``param.grad`` under full offload reaches the step,
however it writes it (a tester's finds, who had not seen the code):

* a foreach call over a list of gradients taken before a read of another gradient
  (``clip_grad_value_(foreach=True)``: ``clamp_min_`` then ``clamp_max_`` on one list):
  the read made the tensor the loop had written the sum's and showed a new
  placeholder, so the list's next write reached no gradient;
* ``g.data = t`` on a placeholder (set on the placeholder, read by nothing) and
  ``g.set_(t)`` (refused with an error about DTensors);
* a post-accumulate-grad hook of the loop's own, which saw ``None`` (registered after
  the optimizer) or one backward's gradient of several (before it), and a float64 model
  trained with FP32 masters: refused now.

Each case against torch's optimizer on the same FP32 model, bitwise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from pipeoff import ConfigError, GradientError
from pipeoff.optim import FullOffloadOptimizer


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))


def _alike(edit: Callable[[nn.Module], Any], steps: int = 2, micro: int = 1,
           **kw: Any) -> tuple[list[Any], list[Any]]:
    """The same loop, with ``edit(model)`` between the backward and ``step()``, under
    torch's AdamW and FullOffloadOptimizer(AdamW): each one's (returns of ``edit``,
    weights)."""
    outs: list[list[Any]] = []
    weights = []
    for full in (False, True):
        model = _model()
        opt: Any = (FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, **kw) if full
                    else torch.optim.AdamW(model.parameters(), lr=1e-2))
        g = torch.Generator().manual_seed(1)
        got = []
        for _ in range(steps):
            for _ in range(micro):
                model(torch.randn(8, 16, generator=g)).pow(2).mean().backward()
            got.append(edit(model))
            opt.step()
            opt.zero_grad()
        if full:
            opt.wait_for_step()
        outs.append(got)
        weights.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*weights, strict=True):
        assert torch.equal(a, b), (a - b).abs().max()
    return outs[0], outs[1]


def _read_one(model: nn.Module) -> None:
    float(model[0].weight.grad.sum())  # (a logging read: the real gradient from now on)


def _put_one(model: nn.Module) -> None:
    model[0].weight.grad = torch.full_like(model[0].weight, 0.03)


@pytest.mark.parametrize("first", [_read_one, _put_one], ids=["read", "put_by_hand"])
@pytest.mark.parametrize("kw", [{}, {"offload_fraction": 0.5}, {"accumulate": "gpu"}],
                         ids=["full", "fraction", "gpu_sums"])
def test_foreach_writes_over_gradients_taken_before_a_read_reach_the_step(
        first: Callable[[nn.Module], None], kw: dict[str, Any]) -> None:
    def edit(model: nn.Module) -> list[float]:
        first(model)
        grads = [p.grad for p in model.parameters()]
        torch._foreach_mul_(grads, 0.5)
        torch._foreach_mul_(grads, 0.5)  # (its first HostGrad's read ends the accumulation)
        return [float(p.grad.abs().max()) for p in model.parameters()]

    torchs, mine = _alike(edit, micro=2, **kw)
    assert mine == torchs


@pytest.mark.parametrize("first", [_read_one, _put_one], ids=["read", "put_by_hand"])
def test_clip_grad_value_with_foreach_after_a_read_clamps_every_gradient(
        first: Callable[[nn.Module], None]) -> None:
    def edit(model: nn.Module) -> list[float]:
        first(model)
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.002, foreach=True)
        return [float(p.grad.abs().max()) for p in model.parameters()]

    torchs, mine = _alike(edit)
    assert mine == torchs
    assert all(v <= torch.tensor(0.002).item() for step in mine for v in step)


def _data_zeros(model: nn.Module) -> None:
    g = model[0].weight.grad
    g.data = torch.zeros_like(model[0].weight)


def _data_half(model: nn.Module) -> None:
    g = model[0].weight.grad
    g.data = g.data * 0.5


def _set(model: nn.Module) -> None:
    model[2].bias.grad.set_(torch.full_like(model[2].bias, 0.25))


@pytest.mark.parametrize("write", [_data_zeros, _data_half, _set],
                         ids=["data_zeros", "data_half", "set_"])
@pytest.mark.parametrize("fraction", [1.0, 0.0])
def test_grad_data_and_set_are_what_steps(write: Callable[[nn.Module], None],
                                          fraction: float) -> None:
    def edit(model: nn.Module) -> float:
        write(model)
        return float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1))

    torchs, mine = _alike(edit, offload_fraction=fraction)
    assert mine == torchs


def _clamp_hook(p: torch.Tensor) -> None:
    if p.grad is not None:
        p.grad.clamp_(-0.002, 0.002)


def test_a_post_accumulate_grad_hook_before_the_optimizers_is_torchs_in_one_backward() -> None:
    """Registered before the optimizer, the hook runs before full offload's and sees the
    backward's gradient: torch's accumulated .grad when the step has one backward."""
    def per_parameter_clip(model: nn.Module) -> None:
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(_clamp_hook)

    weights = []
    for full in (False, True):
        model = _model()
        per_parameter_clip(model)
        opt: Any = (FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-2) if full
                    else torch.optim.AdamW(model.parameters(), lr=1e-2))
        for k in range(2):
            model(torch.randn(8, 16, generator=torch.Generator().manual_seed(k))).sum(
                ).backward()
            opt.step()
            opt.zero_grad()
        getattr(opt, "wait_for_step", lambda: None)()
        weights.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*weights, strict=True):
        assert torch.equal(a, b)


def test_such_a_hook_in_a_later_backward_of_an_accumulation_is_refused() -> None:
    model = _model()
    model[2].weight.register_post_accumulate_grad_hook(_clamp_hook)
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
    with opt.no_sync():
        model(torch.randn(8, 16)).sum().backward()
    with pytest.raises(ConfigError, match=r"'2\.weight' has a post-accumulate-grad hook.*"
                                          r"sees that backward's gradient alone"):
        model(torch.randn(8, 16)).sum().backward()
    opt.zero_grad()


@pytest.mark.parametrize("fraction", [1.0, 0.0])
def test_a_post_accumulate_grad_hook_registered_later_is_refused_at_the_backward(
        fraction: float) -> None:
    """Registered after the optimizer, it runs after full offload's took the gradient."""
    model = _model()
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, offload_fraction=fraction)
    model[0].bias.register_post_accumulate_grad_hook(_clamp_hook)
    with pytest.raises(ConfigError, match=r"'0\.bias' has a post-accumulate-grad hook.*"
                                          r"it sees None"):
        model(torch.randn(8, 16)).sum().backward()
    opt.zero_grad()


def test_an_older_optimizers_hooks_are_not_the_loops() -> None:
    model = _model()
    first = FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
    with pytest.warns(RuntimeWarning, match="belonged to another FullOffloadOptimizer"):
        second = FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
    model(torch.randn(8, 16)).sum().backward()
    second.step()
    second.wait_for_step()
    del first


def test_a_float64_parameter_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"'0\.weight' is float64.*OffloadOptimizer"):
        FullOffloadOptimizer(_model().double(), torch.optim.AdamW, lr=1e-2)


def test_an_older_optimizers_hook_does_not_make_the_loops_hook_refused() -> None:
    """Resuming on the same model while the old optimizer lives: a hook registered
    between the two is before the new optimizer's (the old one's takes nothing now)."""
    weights = []
    for full in (False, True):
        model = _model()
        old: Any = FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-2) if full else None
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(_clamp_hook)
        if full:
            with pytest.warns(RuntimeWarning, match="belonged to another"):
                opt: Any = FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(torch.ones(8, 16)).sum().backward()
        opt.step()
        getattr(opt, "wait_for_step", lambda: None)()
        weights.append([p.detach().clone() for p in model.parameters()])
        del old
    for a, b in zip(*weights, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fraction", [1.0, 0.0])
def test_such_a_hook_in_a_second_backward_without_no_sync_is_refused(fraction: float) -> None:
    model = _model()
    model[2].bias.register_post_accumulate_grad_hook(_clamp_hook)
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, offload_fraction=fraction)
    model(torch.randn(8, 16)).sum().backward()
    with pytest.raises(ConfigError, match=r"'2\.bias' has a post-accumulate-grad hook.*"
                                          r"sees that backward's gradient alone"):
        model(torch.randn(8, 16)).sum().backward()
    opt.zero_grad()


@pytest.mark.parametrize("kw", [{}, {"accumulate": "gpu"}, {"offload_fraction": 0.5}],
                         ids=["full", "gpu_sums", "fraction"])
def test_a_placeholder_kept_after_its_gradient_was_dropped(kw: dict[str, Any]) -> None:
    """``g = p.grad; p.grad = None``: a read of ``g`` raises (its sum is gone; it read
    garbage memory under accumulate='gpu', or raised a TypeError in a device part); an
    edit of it reaches nothing, as torch's edit of a tensor no longer in .grad."""
    def drop_then_scale(model: nn.Module) -> None:
        g = model[0].bias.grad
        model[0].bias.grad = None
        g.mul_(0.5)

    _alike(drop_then_scale, **kw)
    model = _model()
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, **kw)
    model(torch.ones(8, 16)).pow(2).mean().backward()
    g = model[0].bias.grad
    model[0].bias.grad = None
    with pytest.raises(GradientError, match="was dropped or replaced in .grad"):
        float(g.sum())
    with pytest.raises(GradientError, match="was dropped or replaced in .grad"):
        float(g.norm())
    opt.zero_grad()


def test_a_model_cast_to_float64_after_construction_is_refused() -> None:
    model = _model()
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
    model.double()
    with pytest.raises(ConfigError, match=r"is float64"):
        model(torch.ones(8, 16, dtype=torch.float64)).sum().backward()
        opt.step()
    opt.zero_grad()


def test_a_set_inside_a_param_group_is_refused() -> None:
    model = _model()
    with pytest.raises(ConfigError, match="is a set"):
        FullOffloadOptimizer(model, torch.optim.AdamW, params=[{"params": set(model.parameters())}])
    with pytest.raises(ConfigError, match="is a set"):
        FullOffloadOptimizer([{"params": set(model.parameters())}], torch.optim.AdamW)


def test_another_parameters_placeholder_as_a_gradient_is_refused_by_name() -> None:
    """``q.grad = p.grad`` (same shape): refused, naming both parameters, not by a
    message saying the tensor's shape, dtype and device are wrong and what they should
    be, the same ones (a tester's find)."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
    model(torch.ones(2, 8)).sum().backward()
    model[1].weight.grad = model[0].weight.grad
    with pytest.raises(GradientError, match=r"'1\.weight' was set by hand to the \.grad "
                       r"FullOffloadOptimizer shows for '0\.weight' .*clone\(\)"):
        opt.step()


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_a_foreach_edit_of_gradients_all_set_to_none_reaches_nothing(fraction: float) -> None:
    """Every ``p.grad = None``, then a foreach edit of the list taken before: as torch's,
    it reaches nothing (it raised a GradientError saying the placeholders were kept
    across step()); a read of one raises, its values being gone."""
    def drop_all_then_scale(m: nn.Module) -> None:
        grads = [p.grad for p in m.parameters()]
        for p in m.parameters():
            p.grad = None
        torch._foreach_mul_(grads, 0.5)
        m[0].bias.grad = torch.ones_like(m[0].bias)  # (one gradient, so that a step is taken)

    _alike(drop_all_then_scale, offload_fraction=fraction)

    model = _model()
    FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, offload_fraction=fraction)
    model(torch.ones(2, 16)).sum().backward()
    grads = [p.grad for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    torch._foreach_mul_(grads, 0.5)
    with pytest.raises(GradientError, match="set to None in .grad with every other one"):
        grads[0].sum()


def _mask(t: torch.Tensor) -> torch.Tensor:
    return (torch.arange(t.numel()).reshape(t.shape) % 3 != 0).to(t.dtype)


@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("how", ["mul_", "imul", "foreach", "foreach_mixed"])
def test_an_element_wise_scaling_is_torchs(how: str, fraction: float) -> None:
    """A mask multiplied into the gradients (pruning, a frozen slice): it was refused
    with "only scaling by a number or a one-element tensor" (a tester's find, who found
    ``masked_fill_`` working); it runs on the real gradient now, bitwise torch's. In
    one foreach call beside a number-like operand, neither is taken twice."""
    def edit(m: nn.Module) -> None:
        ps = list(m.parameters())
        if how == "mul_":
            ps[0].grad.mul_(_mask(ps[0]))
        elif how == "imul":
            g = ps[2].grad
            g *= _mask(ps[2])
        elif how == "foreach":
            torch._foreach_mul_([p.grad for p in ps], [_mask(p) for p in ps])
        else:
            torch._foreach_mul_([p.grad for p in ps],
                                [torch.tensor(0.5), *[_mask(p) for p in ps[1:]]])

    _alike(edit, offload_fraction=fraction)
