"""FullOffloadOptimizer(offload_fraction=f < 1): the training loop's own calls on
``param.grad`` (the HF Trainer's clip, ``clip_grad_value_``, ``p.grad = None``,
``model.zero_grad()``, reads for logging, writes) reach the device part's FP32 sums
as they reach the host part's: the device part's gradients are shown through the
same placeholders (``pipeoff.optim.HostGrad``).

Each is checked bitwise: against the reference (FP32 sums, torch's own clip call on
them, AdamW on FP32 masters) where the reference can say it, else against the same
loop at ``offload_fraction=1.0`` (whose placeholders are checked against torch in
``test_full_offload_grads.py``). These were silent wrong results before: a device-part
``.grad`` was ``None`` after the backward, so a loop clip saw the host part only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import pipeoff.testing
from pipeoff import ConfigError, GradientError, StepFailedError
from pipeoff.optim import FullOffloadOptimizer, HostGrad
from tests._modes import PassThrough
from tests.optim.full_reference import Reference
from tests.optim.test_full_offload import (
    assert_bitwise,
    batches,
    loss_fn,
    make_model,
    same_bits,
)

pytestmark = pytest.mark.filterwarnings("ignore:pipeoff. pinned host memory")

KW: dict[str, Any] = {"lr": 1e-2, "weight_decay": 0.1}


def build(model: torch.nn.Module, f: float, **kw: Any) -> FullOffloadOptimizer:
    return FullOffloadOptimizer(model, torch.optim.AdamW, offload_fraction=f, **{**KW, **kw})


def device_part(opt: FullOffloadOptimizer) -> set[int]:
    return set(opt._lifecycle.part.params)


def backwards(opt: FullOffloadOptimizer, model: torch.nn.Module, step: list[Any]) -> None:
    for m, b in enumerate(step):
        with opt.no_sync() if m < len(step) - 1 else contextlib.nullcontext():
            loss_fn(model, b).backward()


# -- the loop's clip call, against the reference ----------------------------------------

@pytest.mark.parametrize("overlap", ["none", "forward"])
@pytest.mark.parametrize("f", [0.0, 0.3])
def test_the_loops_clip_call_takes_both_parts_bitwise(f: float, overlap: str) -> None:
    """torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) in the loop (the HF
    Trainer's call): its norm is over both parts, and its coefficient clips both, as
    torch's clip over the FP32 sums."""
    model = make_model()
    ref = Reference(model, torch.optim.AdamW, **KW)
    opt = build(model, f, overlap=overlap)
    if f > 0:
        assert 0 < len(device_part(opt)) < 8  # both parts hold gradients
    data = batches(3, 2)
    norms, ref_norms = [], []
    for step in data:
        backwards(opt, model, step)
        for p in model.parameters():
            if p.numel():
                assert isinstance(p.grad, HostGrad), "every gradient is shown, both parts"
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05))
        opt.step()
        opt.zero_grad()
        for b in step:
            ref.micro_step(lambda mm, b=b: loss_fn(mm, b))
        ref_norms.append(ref.step(lambda gs: torch.nn.utils.clip_grad_norm_(gs, 0.05)))
    opt.wait_for_step()
    assert_bitwise(model, ref)
    for a, b in zip(norms, ref_norms):
        assert same_bits(a, b)
        assert float(b) > 0.05  # it did clip
    # The optimizer's own norm is the one before the loop's clip, as clip_grad_norm_
    # returns it.
    assert same_bits(opt.grad_norm, ref_norms[-1])


def test_a_clip_whose_host_part_is_under_max_norm_still_clips_the_device_part() -> None:
    """The tester's case: the host part's norm alone is under max_norm, the total over
    both parts above it. Before, the loop's call saw the host part only and clipped
    nothing."""
    model = make_model()
    opt = build(model, 0.3, overlap="none")
    ref = Reference(model, torch.optim.AdamW, **KW)
    step = batches(1, 1)[0]
    backwards(opt, model, step)
    dev = device_part(opt)
    host_sq = sum(float(p.grad.norm()) ** 2 for p in model.parameters()
                  if id(p) not in dev and p.grad is not None)
    total = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()
                                                 if p.grad is not None]))
    max_norm = (host_sq ** 0.5 + total) / 2
    assert host_sq ** 0.5 < max_norm < total
    got = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    opt.step()
    opt.wait_for_step()
    ref.micro_step(lambda mm: loss_fn(mm, step[0]))
    want = ref.step(lambda gs: torch.nn.utils.clip_grad_norm_(gs, max_norm))
    assert same_bits(got, want)
    assert_bitwise(model, ref)


# -- the loop's other calls, against offload_fraction=1.0 ---------------------------------

def _clip_value(opt: Any, model: torch.nn.Module) -> None:
    torch.nn.utils.clip_grad_value_(model.parameters(), 1e-3)


def _zero_one(opt: Any, model: torch.nn.Module) -> None:
    model.l1.weight.grad.zero_()


def _drop_one(opt: Any, model: torch.nn.Module) -> None:
    model.l1.weight.grad = None


def _drop_the_host_part(opt: Any, model: torch.nn.Module) -> None:
    # At 0.3 l2.weight is the host part's only gradient: the device part steps on.
    model.l2.weight.grad = None


def _model_zero_grad(opt: Any, model: torch.nn.Module) -> None:
    model.zero_grad()  # nothing steps, in either part


def _read_for_logging(opt: Any, model: torch.nn.Module) -> None:
    # Reads the values (the real gradient is copied to the device), writes nothing.
    for p in model.parameters():
        if p.grad is not None:
            float(p.grad.norm())
            p.grad.abs().sum().item()


def _write_through(opt: Any, model: torch.nn.Module) -> None:
    model.l1.weight.grad.add_(0.125)  # needs the values: written on the real gradient


def _set_by_hand(opt: Any, model: torch.nn.Module) -> None:
    model.l1.weight.grad = torch.full_like(model.l1.weight, 0.25)


def _clip_then_read(opt: Any, model: torch.nn.Module) -> None:
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    float(model.l1.weight.grad.norm())  # the clipped sum's norm


REPLACES = (_drop_one, _drop_the_host_part, _write_through, _set_by_hand)
"""Loops that replace or drop a sum after its norm was taken: the host part reports the
norm taken before (it would need the norm task again); the device part's is taken at
step(), of what steps. Only the weights are compared."""

LOOPS: list[Callable[[Any, torch.nn.Module], None]] = [
    _clip_value, _zero_one, _drop_one, _drop_the_host_part, _model_zero_grad,
    _read_for_logging, _write_through, _set_by_hand, _clip_then_read]


@pytest.mark.parametrize("loop", LOOPS, ids=lambda fn: fn.__name__.strip("_"))
@pytest.mark.parametrize("f", [0.0, 0.3])
def test_the_loops_edits_reach_the_device_part(f: float, loop: Any) -> None:
    """Between the last backward and step(), the loop's edit gives the bits it gives at
    offload_fraction=1.0, and the same grad_norm (l1.weight is in the device part at
    both fractions; l2.weight in the host part)."""
    data = batches(3, 2)
    models, norms, shown = [], [], []
    for frac in (1.0, f):
        model = make_model()
        opt = build(model, frac)
        if frac < 1:
            host = {n for n, p in model.named_parameters() if id(p) not in device_part(opt)}
            assert host == ({"l2.weight"} if frac == 0.3 else set())
        seen = []
        for step in data:
            backwards(opt, model, step)
            seen.append(repr(model.l1.weight.grad).split(":")[0])
            loop(opt, model)
            opt.step()
            opt.zero_grad()
        opt.wait_for_step()
        models.append(model)
        norms.append(opt.grad_norm)
        shown.append(seen)
    for (name, p), q in zip(models[0].named_parameters(), models[1].parameters()):
        assert same_bits(p, q), name
    if loop is _model_zero_grad:
        assert norms == [None, None]
    elif loop not in REPLACES:
        assert same_bits(norms[0], norms[1])
    assert shown[0] == shown[1]  # a placeholder of the same shape and dtype


def test_a_backward_after_the_device_parts_gradients_were_read_is_refused() -> None:
    """Reading a placeholder ends the accumulation, in the device part too: another
    backward before step() raises (it would add to sums already clipped or read)."""
    model = make_model()
    opt = build(model, 0.0)
    step = batches(1, 2)[0]
    loss_fn(model, step[0]).backward()
    float(model.l1.weight.grad.norm())
    with pytest.raises(GradientError, match="after"):
        loss_fn(model, step[1]).backward()
    opt.zero_grad()
    backwards(opt, model, step)  # goes on after zero_grad()
    opt.step()
    opt.wait_for_step()


def test_a_device_part_placeholder_kept_across_step_refuses() -> None:
    model = make_model()
    opt = build(model, 0.0)
    backwards(opt, model, batches(1, 1)[0])
    kept = model.l1.weight.grad
    opt.step()
    opt.zero_grad()
    with pytest.raises(GradientError, match="step already taken"):
        kept.norm()
    assert "device part's gradient sum of 'l1.weight'" in repr(kept)


# -- reentrant checkpoints -------------------------------------------------------------

class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.up = nn.Linear(16, 32, bias=False)
        self.down = nn.Linear(32, 16, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.a(h)
        return h + self.down(F.gelu(self.up(h)))


class _Checkpointed(nn.Module):
    """Two blocks under torch.utils.checkpoint(use_reentrant=True) between a tied
    embedding and head: each block's gradients come from a backward inside the
    backward, the embedding's after them, from the outer one."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(13, 16)
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.head = nn.Linear(16, 13, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        for b in self.blocks:
            h = checkpoint(b, h, use_reentrant=True)
        return self.head(h)


@pytest.mark.parametrize("micro", [1, 3])
@pytest.mark.parametrize("f", [0.0, 0.5])
def test_a_reentrant_checkpoint_shows_both_parts_at_the_outer_backwards_end(
        f: float, micro: int) -> None:
    """The inner backward's end shows the device part's sums; a gradient of the outer
    backward takes them out, and its end shows both parts again. Before, at 0.5 the
    host part's checkpointed gradients were missing from .grad (a clip over part of
    them), and with accumulation the slots shown earlier looked dropped: the next
    backward waited for its own gradients and timed out."""
    g = torch.Generator().manual_seed(1)
    data = [[(torch.randint(0, 13, (3, 5), generator=g), torch.randint(0, 13, (3, 5),
                                                                     generator=g))
             for _ in range(micro)] for _ in range(2)]
    results = []
    for frac in (1.0, f):
        torch.manual_seed(0)
        model = _Checkpointed().to(torch.bfloat16)
        opt = build(model, frac, timeout=60)
        norms = []
        for step in data:
            for idx, tgt in step:
                F.cross_entropy(model(idx).float().reshape(-1, 13), tgt.reshape(-1)).backward()
            assert all(isinstance(p.grad, HostGrad) for p in model.parameters())
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05))
            opt.step()
            opt.zero_grad()
        opt.wait_for_step()
        if frac < 1:
            parts = {id(p) in device_part(opt) for p in model.parameters()}
            assert parts == ({True} if frac == 0 else {True, False})
        results.append((model, norms))
    (want, want_norms), (got, got_norms) = results
    for a, b in zip(want_norms, got_norms):
        assert same_bits(a, b)
    for (name, p), q in zip(want.named_parameters(), got.parameters()):
        assert same_bits(p, q), name


def test_a_refusal_inside_a_backward_leaves_the_step_refused_until_zero_grad() -> None:
    """What the loop did to .grad refused in a backward's hook (a submodule's backward
    without the model's forward, after a gradient was dropped under max_norm): the
    backward raises and the step is dirty."""
    model = make_model()
    opt = build(model, 0.3, max_norm=1.0)
    step = batches(1, 1)[0]
    loss_fn(model, step[0]).backward()
    model.l1.weight.grad = None
    with pytest.raises(ConfigError, match="set to None after the backward"):
        model.l2(torch.randn(2, 24).to(torch.bfloat16)).float().sum().backward()
    with pytest.raises(StepFailedError):
        opt.step()
    opt.zero_grad()
    backwards(opt, model, step)
    opt.step()
    opt.wait_for_step()


class _Twice(nn.Module):
    """One Linear used twice, each time under a reentrant checkpoint: two gradients for
    its parameters in one backward, from two inner backwards."""

    def __init__(self) -> None:
        super().__init__()
        self.blk = nn.Linear(16, 16)
        self.inp = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.blk, self.inp(x), use_reentrant=True)
        h = checkpoint(self.blk, F.gelu(h), use_reentrant=True)
        return self.head(h)


@pytest.mark.parametrize("f", [0.0, 0.3])
def test_a_second_gradient_in_one_backward_is_refused_in_the_device_part(f: float) -> None:
    """As the host part refuses it (f=1.0): summing the two in FP32 would not be what
    torch's .grad holds (their BF16 sum)."""
    torch.manual_seed(0)
    model = _Twice().to(torch.bfloat16)
    opt = build(model, f)
    assert id(model.blk.bias) in device_part(opt)
    x = torch.randn(3, 16).to(torch.bfloat16)
    with pytest.raises(GradientError, match=r"a second gradient for 'blk\.(weight|bias)'"):
        model(x).float().sum().backward()
    with pytest.raises(StepFailedError):
        opt.step()
    opt.zero_grad()


class _Interrupted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(16, 16)
        self.l2 = nn.Linear(16, 16)
        self.l3 = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor, boom: bool = False) -> torch.Tensor:
        h = F.gelu(self.l1(x))
        if boom:
            def interrupt(g: torch.Tensor) -> None:
                raise KeyboardInterrupt("Ctrl-C in the middle of the backward")
            h.register_hook(interrupt)
        return self.l3(F.gelu(self.l2(h)))


@pytest.mark.parametrize("overlap", ["none", "forward"])
@pytest.mark.parametrize("f", [0.0, 0.5])
def test_a_backward_interrupted_after_device_part_gradients_leaves_the_step_refused(
        f: float, overlap: str) -> None:
    """A Ctrl-C in the backward after l3's and l2's gradients (device-part ones among
    them) and before l1's: step() refuses until zero_grad(), as with the host part
    alone, instead of stepping on part of the gradients."""
    torch.manual_seed(0)
    model = _Interrupted().to(torch.bfloat16)
    opt = build(model, f, overlap=overlap)
    x = torch.randn(4, 16).to(torch.bfloat16)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(KeyboardInterrupt):
        model(x, boom=True).float().pow(2).mean().backward()
    with pytest.raises(StepFailedError):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    opt.zero_grad()
    model(x).float().pow(2).mean().backward()
    opt.step()
    opt.wait_for_step()
    assert not torch.equal(model.l1.weight, before[0])


def test_a_failed_host_norm_leaves_the_step_dirty_before_its_execution_ends(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """step() waits for the host part's norm; that task failed: step() raises its error
    and refuses until zero_grad(), also while the execution is still failing (its other
    tasks being cancelled: forced here by reporting it as not failed yet). Before, a
    second step() in that window raised the task's error again and the next backward
    was refused as after the final micro-step (a tester saw it 1 run in 30)."""
    model = make_model()
    opt = build(model, 0.3, chunk_numel=64)
    step = batches(1, 1)[0]
    with pipeoff.testing.fail_task("norm.*"):
        backwards(opt, model, step)
        with pytest.raises(RuntimeError):
            opt.step()
    from pipeoff.optim._full_offload._common import Accumulation

    monkeypatch.setattr(Accumulation, "failed", lambda self: False)  # (not yet)
    with pytest.raises(StepFailedError):
        opt.step()
    monkeypatch.undo()
    opt.zero_grad()
    backwards(opt, model, step)
    opt.step()
    opt.wait_for_step()


class _Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, 8)
        self.l2 = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(F.gelu(self.l1(x)))


@pytest.mark.parametrize("f", [0.0, 0.5])
def test_a_whole_model_under_one_reentrant_checkpoint_steps(f: float) -> None:
    """Every gradient comes from the inner backward, none from the outer one after it:
    the backward finished, and the step is not refused as if it had been interrupted."""
    results = []
    for frac in (1.0, f):
        torch.manual_seed(0)
        model = _Small().to(torch.bfloat16)
        opt = build(model, frac)
        x = torch.randn(3, 8).to(torch.bfloat16).requires_grad_()
        for _ in range(2):
            checkpoint(model, x, use_reentrant=True).float().sum().backward()
            opt.step()
            opt.zero_grad()
        opt.wait_for_step()
        results.append(model)
    for p, q in zip(*(m.parameters() for m in results)):
        assert same_bits(p, q)


def read_every_gradient(model: torch.nn.Module, read: Any) -> None:
    """``read(param.grad)`` for every gradient there is: a value read, after which
    ``param.grad`` is the real gradient rather than the placeholder."""
    for p in model.parameters():
        if p.grad is not None and p.numel():
            read(p.grad)


@pytest.mark.parametrize("f", [1.0, 0.3])
def test_a_clip_under_a_dispatch_mode_after_a_read_is_taken(f: float) -> None:
    """The loop reads the gradients' values (``param.grad`` is then the real gradient),
    then clips inside a ``TorchDispatchMode`` (``FlopCounterMode`` around the step):
    torch's foreach multiply bumps no version counter there, and the step took the
    unclipped sums (a tester's find). Bitwise the same loop without the mode."""

    def run(mode: bool) -> torch.nn.Module:
        model = make_model()
        opt = build(model, f, overlap="none")
        for step in batches(2, 1):
            backwards(opt, model, step)
            read_every_gradient(model, torch.sum)  # the real gradient from now on
            with PassThrough() if mode else contextlib.nullcontext():
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01, foreach=True)
            opt.step()
            opt.zero_grad()
        opt.wait_for_step()
        return model

    for p, q in zip(run(True).parameters(), run(False).parameters()):
        assert same_bits(p, q)


@pytest.mark.parametrize("f", [1.0, 0.3])
def test_a_clip_that_changes_no_bit_after_a_read_steps_the_sums(f: float) -> None:
    """A read, then the loop's clip under its threshold (torch multiplies by 1.0: no bit
    of the BF16 gradient changes): the step takes the FP32 sums, with or without a
    dispatch mode around the clip, bitwise the loop without the read and the clip (a
    tester's find: the version counter made it the BF16 cast without a mode, the sums
    under one)."""
    gen = torch.Generator().manual_seed(1)
    data = [[torch.randn(8, 16, generator=gen).to(torch.bfloat16) for _ in range(2)]
            for _ in range(3)]

    def run(clip: bool, mode: bool) -> torch.nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)).to(torch.bfloat16)
        opt = build(model, f, overlap="none")
        for step in data:
            for m, x in enumerate(step):
                with opt.no_sync() if m == 0 else contextlib.nullcontext():
                    model(x).float().pow(2).mean().backward()
            if clip:
                read_every_gradient(model, lambda g: torch.isfinite(g).all())
                with PassThrough() if mode else contextlib.nullcontext():
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
            opt.step()
            opt.zero_grad()
        opt.wait_for_step()
        return model

    plain = run(False, False)
    for mode in (False, True):
        for p, q in zip(run(True, mode).parameters(), plain.parameters()):
            assert same_bits(p, q), mode


def test_nans_of_other_payloads_are_the_same_bits() -> None:
    """A cast on the device may give another NaN payload than the host's: still not a
    write (a reviewer's find)."""
    from pipeoff.optim._full_offload._grads import _same_bits

    a = torch.tensor([float("nan"), 1.0]).to(torch.bfloat16)
    b = a.clone()
    b.view(torch.int16)[0] = 0x7FFF  # another quiet NaN
    assert _same_bits(a, b)
    assert not _same_bits(a, torch.tensor([float("nan"), 2.0]).to(torch.bfloat16))


@pytest.mark.parametrize("f", [1.0, 0.3])
def test_a_read_of_a_nan_gradient_is_not_a_write(f: float) -> None:
    """A NaN check in the loop (a read) of a gradient holding a NaN: the step takes the
    FP32 sum, bitwise the loop without the read, and ``max_norm`` does not refuse it as
    a replaced gradient (a NaN never equals itself: the first version of the value
    check took the read for a write; a tester's find)."""

    def run(read: bool, **kw: Any) -> torch.nn.Module:
        model = make_model()
        opt = FullOffloadOptimizer(model, torch.optim.SGD, offload_fraction=f, lr=0.5, **kw)
        first = [True]

        def poison(g: torch.Tensor) -> torch.Tensor:
            if first[0]:
                first[0] = False
                g = g.clone()
                g.view(-1)[0] = float("nan")
            return g

        model.l1.weight.register_hook(poison)
        for step in batches(1, 2):
            backwards(opt, model, step)
            if read:
                read_every_gradient(model, lambda g: torch.isfinite(g).all())
            opt.step()
            opt.zero_grad()
        opt.wait_for_step()
        return model

    for p, q in zip(run(True).parameters(), run(False).parameters()):
        assert same_bits(p, q)
    run(True, max_norm=1.0)  # no ConfigError
