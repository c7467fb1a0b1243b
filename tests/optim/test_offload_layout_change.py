"""OffloadOptimizer when a parameter's memory layout changes after construction.

``model.to(memory_format=...)`` replaces each parameter's data with a tensor of
another layout. The host state (and the host tensors reserved ahead for state a
first step makes) was laid out in the old memory order; the next step re-lays
it before planning. The right value is plain ``torch.optim.AdamW`` on an
identical model with the same layout change, bitwise.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pipeoff.optim import OffloadOptimizer
from tests.gpu_device import Gpu
from tests.optim.test_patterns import Convs, assert_same, batches, run

MODES = ["single_pass", "chunked", "overlap"]
CL = torch.channels_last
CONTIGUOUS = torch.contiguous_format


def pair(model: nn.Module, mode: str, *, reserve: bool = True,
         ) -> tuple[nn.Module, torch.optim.Optimizer, nn.Module, OffloadOptimizer]:
    ref, mod = model, copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    opt = OffloadOptimizer(torch.optim.AdamW(mod.parameters(), lr=1e-2, weight_decay=0.1),
                           mode=mode, chunk_bytes=256, reserve=reserve)  # type: ignore[arg-type]
    return ref, ref_opt, mod, opt


def to_format(fmt: torch.memory_format, *models: nn.Module) -> None:
    for m in models:
        m.to(memory_format=fmt)


def assert_state_dicts_equal(ref_opt: torch.optim.Optimizer, opt: OffloadOptimizer) -> None:
    want, got = ref_opt.state_dict(), opt.state_dict()
    assert want["param_groups"] == got["param_groups"]
    assert want["state"].keys() == got["state"].keys()
    for i, entry in want["state"].items():
        assert entry.keys() == got["state"][i].keys(), i
        for k, v in entry.items():
            assert torch.equal(v, got["state"][i][k]), (i, k)


@pytest.mark.parametrize("reserve", [True, False])
@pytest.mark.parametrize("mode", MODES)
def test_channels_last_before_the_first_step(mode: str, reserve: bool) -> None:
    """The issue's repro: the layout changes after construction, before any state exists
    (with ``reserve=True`` the host tensors for the first step's state already do)."""
    ref, ref_opt, mod, opt = pair(nn.Sequential(nn.Conv2d(3, 4, 3), nn.Conv2d(4, 2, 3)), mode,
                                  reserve=reserve)
    to_format(CL, ref, mod)
    xs = batches(3, (2, 3, 8, 8))
    assert_same(ref, ref_opt, mod, opt, run(ref, ref_opt, xs), run(mod, opt, xs))
    assert_state_dicts_equal(ref_opt, opt)
    if mode != "single_pass":
        # The host state has the parameter's new layout (torch's zeros_like state would).
        for p in mod.parameters():
            for k in ("exp_avg", "exp_avg_sq"):
                assert opt.state[p][k].stride() == p.stride(), k


@pytest.mark.parametrize("when", ["before_state", "with_state"])
@pytest.mark.parametrize("mode", MODES)
def test_channels_last_back_to_contiguous(mode: str, when: str) -> None:
    """The other direction: a model built channels-last, made contiguous again (before
    its first step, or after steps made state in the channels-last order)."""
    model = Convs()
    model.to(memory_format=CL)
    ref, ref_opt, mod, opt = pair(model, mode)
    xs = batches(5, (2, 3, 8, 8))
    ref_losses: list[torch.Tensor] = []
    losses: list[torch.Tensor] = []
    if when == "with_state":
        ref_losses += run(ref, ref_opt, xs[:2])
        losses += run(mod, opt, xs[:2])
    to_format(CONTIGUOUS, ref, mod)
    assert all(p.is_contiguous() for p in mod.parameters())
    ref_losses += run(ref, ref_opt, xs[len(ref_losses):])
    losses += run(mod, opt, xs[len(losses):])
    assert_same(ref, ref_opt, mod, opt, ref_losses, losses)
    assert_state_dicts_equal(ref_opt, opt)


class TwoBranches(nn.Module):
    """``b`` gets no grad until ``use_b``: its state does not exist when ``a``'s does."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Conv2d(3, 4, 3)
        self.b = nn.Conv2d(3, 4, 3)
        self.use_b = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        return y + self.b(x) if self.use_b else y


@pytest.mark.parametrize("mode", MODES)
def test_layout_change_with_some_state_present_and_some_reserved(mode: str) -> None:
    """After steps that made ``a``'s state but not ``b``'s, the layout changes: ``a``'s
    state is copied into the new order, ``b``'s reserved host tensors re-strided; later
    steps and the state dict match torch. Then back again, with both present."""
    ref, ref_opt, mod, opt = pair(TwoBranches(), mode)
    xs = batches(7, (2, 3, 8, 8))
    ref_losses = run(ref, ref_opt, xs[:2])
    losses = run(mod, opt, xs[:2])
    assert mod.b.weight not in opt.state
    to_format(CL, ref, mod)
    ref_losses += run(ref, ref_opt, xs[2:3])
    losses += run(mod, opt, xs[2:3])
    assert_state_dicts_equal(ref_opt, opt)
    for m in (ref, mod):
        m.use_b = True
    ref_losses += run(ref, ref_opt, xs[3:5])
    losses += run(mod, opt, xs[3:5])
    to_format(CONTIGUOUS, ref, mod)
    ref_losses += run(ref, ref_opt, xs[5:])
    losses += run(mod, opt, xs[5:])
    assert_same(ref, ref_opt, mod, opt, ref_losses, losses)
    assert_state_dicts_equal(ref_opt, opt)


@pytest.mark.parametrize("mode", ["chunked", "overlap"])
def test_reserved_host_state_follows_the_layout_without_new_memory(mode: str) -> None:
    """A reserved host tensor holds no values: it is re-strided in place, so reserving
    again after the layout change allocates nothing."""
    mod = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Conv2d(4, 2, 3))
    opt = OffloadOptimizer(torch.optim.AdamW(mod.parameters()), mode=mode,  # type: ignore[arg-type]
                           chunk_bytes=256)
    before = {k: h.untyped_storage().data_ptr() for k, h in opt._host.reserved.items()}
    mod.to(memory_format=CL)
    assert opt.reserve() == 0
    assert {k: h.untyped_storage().data_ptr() for k, h in opt._host.reserved.items()} == before
    for p in mod.parameters():
        for k in ("exp_avg", "exp_avg_sq"):
            assert opt._host.reserved[(id(p), k)].stride() == p.stride()


@pytest.mark.parametrize("mode", ["chunked", "overlap"])
def test_a_parameter_re_pointed_to_another_shape_before_its_first_step(mode: str) -> None:
    """Of the same kind: the reserved host tensors no longer fit (another shape and
    layout); they are dropped and the step allocates state of the new shape."""
    ref, ref_opt, mod, opt = pair(Convs(), mode)
    for m in (ref, mod):
        with torch.no_grad():
            w = torch.randn(4, 3, 5, 5, generator=torch.Generator().manual_seed(2))
            m.c1.weight.data = w.contiguous(memory_format=CL)
    xs = batches(3, (2, 3, 8, 8))
    assert_same(ref, ref_opt, mod, opt, run(ref, ref_opt, xs), run(mod, opt, xs))
    assert_state_dicts_equal(ref_opt, opt)


def test_layout_change_while_an_overlap_step_is_in_flight() -> None:
    """``model.to(memory_format=...)`` right after ``step()`` returns: its reads wait for
    the chunks (the read guard), the next step re-lays the new state, bitwise as torch."""
    import pipeoff.testing

    ref, ref_opt, mod, opt = pair(Convs(), "overlap")
    xs = batches(4, (2, 3, 8, 8))
    ref_losses = run(ref, ref_opt, xs[:1])
    losses: list[torch.Tensor] = []
    with pipeoff.testing.delay_lane("compute", 0.01):
        loss = mod(xs[0]).float().pow(2).mean()
        losses.append(loss.detach().clone())
        loss.backward()
        opt.step()
        opt.zero_grad()
        mod.to(memory_format=CL)  # the step is (most likely) still running
    ref.to(memory_format=CL)
    ref_losses += run(ref, ref_opt, xs[1:])
    losses += run(mod, opt, xs[1:])
    assert_same(ref, ref_opt, mod, opt, ref_losses, losses)
    assert_state_dicts_equal(ref_opt, opt)


@pytest.mark.parametrize("mode", MODES)
def test_load_state_dict_after_a_layout_change(mode: str) -> None:
    """A checkpoint saved before the change loads into the new layout and trains on as
    torch's does."""
    ref, ref_opt, mod, opt = pair(Convs(), mode)
    xs = batches(4, (2, 3, 8, 8))
    ref_losses = run(ref, ref_opt, xs[:2])
    losses = run(mod, opt, xs[:2])
    saved = ref_opt.state_dict()
    to_format(CL, ref, mod)
    # Each its own copy: torch's load_state_dict keeps the loaded "step" tensor itself.
    ref_opt.load_state_dict(copy.deepcopy(saved))
    opt.load_state_dict(copy.deepcopy(saved))
    ref_losses += run(ref, ref_opt, xs[2:])
    losses += run(mod, opt, xs[2:])
    assert_same(ref, ref_opt, mod, opt, ref_losses, losses)
    assert_state_dicts_equal(ref_opt, opt)


@pytest.mark.parametrize("mode", ["chunked", "overlap"])
def test_channels_last_before_the_first_step_on_the_device(gpu: Gpu, mode: str) -> None:
    """The repro on a CUDA device (the simulated one; a real GPU where there is one):
    pinned host state reserved in the old order, copies on the lanes' streams."""
    model = gpu.module(nn.Sequential(nn.Conv2d(3, 4, 3), nn.Conv2d(4, 2, 3)))
    ref, ref_opt, mod, opt = pair(model, mode)
    assert opt.pin_memory
    to_format(CL, ref, mod)
    xs = [gpu.tensor(x) for x in batches(3, (2, 3, 8, 8))]
    assert_same(ref, ref_opt, mod, opt, run(ref, ref_opt, xs), run(mod, opt, xs))
    assert_state_dicts_equal(ref_opt, opt)
    for p in mod.parameters():
        for k in ("exp_avg", "exp_avg_sq"):
            assert gpu.accel.is_pinned(opt.state[p][k]), k
