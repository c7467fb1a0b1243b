"""``FullOffloadOptimizer(gradient_accumulation_steps=N)``: the N-th backward of a step is
known final as it begins, without ``no_sync()`` (the loop of no accumulation at all, N=1,
and the HF Trainer's on one process, which marks nothing): its BF16 gradients are held and
stepped in one pass (28 B per parameter for a step of one backward, 32 with earlier
sums), bitwise the reference; a step with fewer backwards takes the fold; one more
backward is refused."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pipeoff import ConfigError, GradientError, StepFailedError
from pipeoff.optim import FullOffloadOptimizer
from pipeoff.optim._full_offload import _host_kernel
from tests.optim.full_reference import Reference
from tests.optim.test_full_offload import (
    assert_bitwise,
    batches,
    loss_fn,
    make_model,
    train_reference,
)

pytestmark = pytest.mark.filterwarnings("ignore:pipeoff. pinned host memory")

KW: dict[str, Any] = {"lr": 1e-2, "weight_decay": 0.1, "fused": True}


def unmarked(opt: FullOffloadOptimizer, model: torch.nn.Module,
             data: list[list[Any]]) -> list[Any]:
    """The loop with no ``no_sync()``: each step's backwards, then ``step()``; returns
    each step's ``host_step_path``."""
    paths = []
    for step in data:
        for b in step:
            loss_fn(model, b).backward()
        opt.step()
        opt.zero_grad()
        opt.wait_for_step()
        paths.append(opt.host_step_path)
    return paths


@pytest.mark.parametrize("overlap", ["none", "forward", "backward"])
@pytest.mark.parametrize("micro", [1, 2, 3])
def test_the_counted_final_backward_is_bitwise_the_reference(micro: int, overlap: str) -> None:
    """The side branch has gradients only before the final backward (its sum steps
    alone), the empty parameter none at all."""
    model = make_model()
    ref = Reference(model, torch.optim.AdamW, **KW)
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, overlap=overlap,
                               gradient_accumulation_steps=micro, **KW)
    data = batches(3, micro, side="not_final")
    paths = unmarked(opt, model, data)
    train_reference(ref, data)
    assert_bitwise(model, ref)
    native = _host_kernel.host_kernel() is not None
    for path in paths:
        assert path is not None
        if overlap == "backward":  # the chunks stepped during the counted final backward
            assert not path.one_pass and "during the final backward" in path.why
        elif native:
            assert path.one_pass and path.bytes_per_param == (28 if micro == 1 else 32), path


def test_without_the_count_the_same_loop_folds_first() -> None:
    """The reference point: unmarked and uncounted, ``step()`` says which backward was the
    last, after it folded its gradients (44 B): the same bits."""
    model = make_model()
    ref = Reference(model, torch.optim.AdamW, **KW)
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, **KW)
    data = batches(2, 2)
    paths = unmarked(opt, model, data)
    train_reference(ref, data)
    assert_bitwise(model, ref)
    assert all(p is not None and not p.one_pass and "not marked" in p.why for p in paths)


@pytest.mark.parametrize("overlap", ["forward", "backward"])
def test_a_step_with_fewer_backwards_is_exact(overlap: str) -> None:
    """The HF Trainer's last window of an epoch may be short: ``step()`` ends it."""
    model = make_model()
    ref = Reference(model, torch.optim.AdamW, **KW)
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, overlap=overlap,
                               gradient_accumulation_steps=3, **KW)
    data = [*batches(1, 3, seed=1), *batches(1, 2, seed=2), *batches(1, 3, seed=3)]
    paths = unmarked(opt, model, data)
    train_reference(ref, data)
    assert_bitwise(model, ref)
    assert paths[1] is not None and not paths[1].one_pass
    if overlap == "forward" and _host_kernel.host_kernel() is not None:
        assert "fewer backwards than gradient_accumulation_steps=3" in paths[1].why


def test_reading_a_gradient_of_a_short_step_under_backward_overlap_says_why() -> None:
    """Under ``overlap="backward"`` a sum is known once the final backward ran; in a step
    shorter than the count that is never before ``step()``: the refusal says so."""
    model = make_model()
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, overlap="backward",
                               gradient_accumulation_steps=2, **KW)
    loss_fn(model, batches(1, 1)[0][0]).backward()
    with pytest.raises(GradientError, match="gradient_accumulation_steps=2: backward 2"):
        model.l1.weight.grad.sum()  # type: ignore[union-attr]
    opt.step()
    opt.zero_grad()
    opt.wait_for_step()


@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.0])
@pytest.mark.parametrize("overlap", ["none", "forward", "backward"])
def test_one_backward_more_than_the_count_is_refused(overlap: str, fraction: float) -> None:
    """The count made the second backward final; a third before ``step()`` is refused,
    naming the argument, also where the device part holds every parameter
    (``offload_fraction=0``: no host gradient counted the backwards; a tester found
    three taken without a word). Under ``overlap="forward"`` nothing stepped:
    ``zero_grad()`` drops that step, and the next is exact; under ``"backward"`` the
    chunks stepped during the final backward, and the step is refused as torn (as
    after a backward past a ``no_sync()``-marked final one)."""
    model = make_model()
    ref = Reference(model, torch.optim.AdamW, **KW)
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, overlap=overlap,
                               offload_fraction=fraction, gradient_accumulation_steps=2,
                               **KW)
    extra = batches(1, 3, seed=5)[0]
    for b in extra[:2]:
        loss_fn(model, b).backward()
    with pytest.raises(GradientError, match="gradient_accumulation_steps=2"):
        loss_fn(model, extra[2]).backward()
    if overlap == "backward" and fraction > 0:
        with pytest.raises(StepFailedError, match="Load a checkpoint"):
            opt.step()
        return
    with pytest.raises(StepFailedError, match="zero_grad"):
        opt.step()
    opt.zero_grad()
    data = batches(2, 2, seed=6)
    unmarked(opt, model, data)
    train_reference(ref, data)
    assert_bitwise(model, ref)


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "2"])
def test_a_bad_count_is_refused(value: Any) -> None:
    with pytest.raises(ConfigError, match="gradient_accumulation_steps"):
        FullOffloadOptimizer(make_model(), torch.optim.AdamW,
                             gradient_accumulation_steps=value, **KW)


@pytest.mark.parametrize("overlap", ["forward", "backward"])
def test_with_a_device_part(overlap: str) -> None:
    """``offload_fraction=0.5``: the device part's gradient may begin the counted final
    backward (under ``overlap="backward"``)."""
    model = make_model()
    ref = Reference(model, torch.optim.AdamW, **KW)
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, overlap=overlap,
                               offload_fraction=0.5, gradient_accumulation_steps=2, **KW)
    data = batches(3, 2, side="not_final")
    unmarked(opt, model, data)
    train_reference(ref, data)
    assert_bitwise(model, ref)


@pytest.mark.parametrize("overlap", ["forward", "backward"])
@pytest.mark.parametrize("steps", [1, 2])
def test_all_on_the_device(steps: int, overlap: str) -> None:
    """``offload_fraction=0``: no host part, whose micro-steps the count counts."""
    model = make_model()
    ref = Reference(model, torch.optim.AdamW, **KW)
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, overlap=overlap,
                               offload_fraction=0.0, gradient_accumulation_steps=steps, **KW)
    data = batches(3, steps, side="not_final")
    unmarked(opt, model, data)
    train_reference(ref, data)
    assert_bitwise(model, ref)


@pytest.mark.parametrize("overlap", ["none", "forward", "backward"])
def test_all_on_the_device_a_backward_past_the_marked_final_one_is_refused(
        overlap: str) -> None:
    """``offload_fraction=0`` with ``no_sync()``: the unmarked backward after a marked one
    is the final one, and one more before ``step()`` is refused, as with a host part."""
    model = make_model()
    ref = Reference(model, torch.optim.AdamW, **KW)
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, overlap=overlap,
                               offload_fraction=0.0, **KW)
    extra = batches(1, 3, seed=5)[0]
    with opt.no_sync():
        loss_fn(model, extra[0]).backward()
    loss_fn(model, extra[1]).backward()
    with pytest.raises(GradientError, match="final micro-step"):
        loss_fn(model, extra[2]).backward()
    with pytest.raises(StepFailedError, match="zero_grad"):
        opt.step()
    opt.zero_grad()
    data = batches(2, 2, seed=6)
    for step in data:
        with opt.no_sync():
            loss_fn(model, step[0]).backward()
        loss_fn(model, step[1]).backward()
        opt.step()
        opt.zero_grad()
    opt.wait_for_step()
    train_reference(ref, data)
    assert_bitwise(model, ref)


@pytest.mark.parametrize("read", ["clip", "sum"])
def test_a_read_that_ended_a_counted_step_early_is_named(read: str) -> None:
    """A read of the gradients after backward 1 of 3 ends the accumulation; the refusal
    of backward 2 names the read, not the count (which had not made it final)."""
    model = make_model()
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, gradient_accumulation_steps=3, **KW)
    data = batches(1, 2, seed=5)[0]
    loss_fn(model, data[0]).backward()
    if read == "clip":
        torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    else:
        model.l1.weight.grad.sum()  # type: ignore[union-attr]
    with pytest.raises(GradientError, match="after the loop read this step's gradients"):
        loss_fn(model, data[1]).backward()
    opt.zero_grad()


def test_the_count_reads_back_and_shows_in_the_repr() -> None:
    opt = FullOffloadOptimizer(make_model(), torch.optim.AdamW,
                               gradient_accumulation_steps=4, **KW)
    assert opt.gradient_accumulation_steps == 4
    assert "gradient_accumulation_steps=4" in repr(opt)
    plain = FullOffloadOptimizer(make_model(), torch.optim.AdamW, **KW)
    assert plain.gradient_accumulation_steps is None
    assert "gradient_accumulation_steps" not in repr(plain)
