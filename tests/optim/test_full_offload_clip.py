"""FullOffloadOptimizer under the training loop's own clip and log calls.

Every clip call a loop already makes reads ``param.grad``; under full offload the
gradients are on the host, and ``.grad`` holds a :class:`~pipeoff.optim.HostGrad`
that stands for the host sum. Each test runs the loop's call unchanged and
compares with the FP32-master reference (``tests/optim/full_reference.py``) that
makes the same call on the FP32 sums: the returned norm and the weights bitwise.
"""

from __future__ import annotations

import contextlib
import copy
import io
import pickle
from typing import Any

import pytest
import torch
from torch.nn.utils import clip_grad_norm_  # imported by name, before the optimizer exists

from pipeoff import ConfigError, GradientError, PipeoffError, testing
from pipeoff.optim import FullOffloadOptimizer, HostGrad
from tests._stacks import release_when_waiting
from tests.optim.full_reference import Reference
from tests.optim.test_full_offload import (
    batches,
    build,
    loss_fn,
    make_model,
    reference,
    same_bits,
)

pytestmark = pytest.mark.filterwarnings("ignore:pipeoff. pinned host memory")

MAX_NORM = 0.05  # below every step's norm: each step clips


def _torch(params: list[torch.Tensor]) -> torch.Tensor:
    return torch.nn.utils.clip_grad_norm_(params, MAX_NORM)


def _by_name(params: list[torch.Tensor]) -> torch.Tensor:
    return clip_grad_norm_(params, MAX_NORM)


def _foreach(params: list[torch.Tensor]) -> torch.Tensor:
    return torch.nn.utils.clip_grad_norm_(params, MAX_NORM, foreach=True)


def _torchtitan(params: list[torch.Tensor]) -> torch.Tensor:
    # torchtitan's dist_utils.clip_grad_norm_: the total norm, then the scaling.
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, 2.0, False, None)
    torch.nn.utils.clip_grads_with_norm_(params, MAX_NORM, total, None)
    return total


def _value(params: list[torch.Tensor]) -> torch.Tensor:
    torch.nn.utils.clip_grad_value_(params, 0.01)
    return torch.tensor(0.0)


CLIPS = {"torch": _torch, "by_name": _by_name, "foreach": _foreach,
         "torchtitan": _torchtitan, "value": _value}


def run(model: torch.nn.Module, opt: FullOffloadOptimizer, ref: Reference,
        data: list[list[Any]], clip: Any, *, marked: bool) -> list[tuple[Any, Any]]:
    """The loop: micro-steps, the clip call on ``model.parameters()``, step; the same on
    the reference's FP32 masters. Returns the (mine, reference) norms."""
    norms = []
    for step in data:
        for m, b in enumerate(step):
            last = m == len(step) - 1
            with opt.no_sync() if marked and not last else contextlib.nullcontext():
                loss_fn(model, b).backward()
            ref.micro_step(lambda mod, b=b: loss_fn(mod, b))
        mine = clip(list(model.parameters()))
        theirs = ref.step(clip)
        opt.step()
        opt.zero_grad()
        norms.append((mine, theirs))
    opt.wait_for_step()
    return norms


def check(model: torch.nn.Module, ref: Reference, norms: list[tuple[Any, Any]]) -> None:
    for mine, theirs in norms:
        assert same_bits(mine, theirs), (float(mine), float(theirs))
    for (name, p), q in zip(model.named_parameters(), ref.model.parameters()):
        assert same_bits(p, q), f"{name}: {(p.float() - q.float()).abs().max()}"


@pytest.mark.parametrize("clip", sorted(CLIPS))
@pytest.mark.parametrize("overlap", ["forward", "none"])
@pytest.mark.parametrize("mode", ["cpu", "cpu-marked", "gpu-marked"])
def test_the_loops_clip_call_is_torchs_on_the_fp32_sums(clip: str, overlap: str,
                                                       mode: str) -> None:
    model = make_model()
    ref = reference(model)
    opt = build(model, overlap=overlap, accumulate=mode.split("-")[0])
    data = batches(3, 2, side="not_final")
    norms = run(model, opt, ref, data, CLIPS[clip], marked=mode.endswith("marked"))
    check(model, ref, norms)
    if clip != "value":
        assert all(float(n) > MAX_NORM for n, _ in norms)  # it clipped every step


def test_the_native_fused_step_takes_the_clip_coefficient_in_its_pass() -> None:
    model = make_model()
    ref = reference(model, fused=True)
    opt = build(model, fused=True)
    norms = run(model, opt, ref, batches(3, 2), _torch, marked=True)
    check(model, ref, norms)


def test_the_returned_norm_is_the_optimizers_grad_norm() -> None:
    model = make_model()
    opt = build(model)
    for b in batches(1, 2)[0]:
        loss_fn(model, b).backward()
    norm = clip_grad_norm_(model.parameters(), MAX_NORM)
    assert same_bits(norm, opt.grad_norm)  # (param_groups in the model's order)
    opt.step()


def test_lightnings_grad_norm_logs_the_true_norms() -> None:
    model = make_model()
    ref = reference(model)
    opt = build(model)
    for b in batches(1, 3)[0]:
        loss_fn(model, b).backward()
        ref.micro_step(lambda m, b=b: loss_fn(m, b))
    # lightning.pytorch.utilities.grad_norm's expressions:
    norms = {n: p.grad.data.norm(2.0) for n, p in model.named_parameters()
             if p.grad is not None}
    total = torch.tensor(list(norms.values())).norm(2.0)
    want = {n: ref.acc[id(q)].norm(2.0) for (n, _), q in
            zip(model.named_parameters(), ref.params) if id(q) in ref.acc}
    assert norms.keys() == want.keys()
    assert all(same_bits(norms[n], want[n]) for n in want)
    assert same_bits(total, torch.tensor(list(want.values())).norm(2.0))
    opt.step()


def test_other_reads_see_the_gradient_in_the_parameters_dtype() -> None:
    model = make_model()
    ref = reference(model)
    opt = build(model)
    for b in batches(1, 2)[0]:
        loss_fn(model, b).backward()
        ref.micro_step(lambda m, b=b: loss_fn(m, b))
    w = model.l1.weight
    want = ref.acc[id(ref.model.l1.weight)].to(w.dtype)
    assert isinstance(w.grad, HostGrad)
    assert "host gradient sum of 'l1.weight'" in repr(w.grad)
    assert same_bits(w.grad.abs().max(), want.abs().max())
    assert bool(torch.isfinite(model.l2.bias.grad).all())
    assert same_bits(w.grad.clone(), want)
    assert not isinstance(w.grad, HostGrad)  # now the real gradient, on the device
    opt.step()  # (read-only: the FP32 sum is stepped)
    opt.wait_for_step()


def _two_steps(edit: Any) -> tuple[torch.nn.Module, Reference]:
    """Two steps of two micro-steps; ``edit(model, ref_grads_by_name)`` between the last
    backward and step() of the first."""
    model = make_model()
    ref = reference(model)
    opt = build(model)
    names = dict(zip((n for n, _ in model.named_parameters()), ref.params))
    for s, step in enumerate(batches(2, 2)):
        for b in step:
            loss_fn(model, b).backward()
            ref.micro_step(lambda m, b=b: loss_fn(m, b))
        if s == 0:
            edit(model, {n: q for n, q in names.items()}, ref)
        ref.step()
        opt.step()
        opt.zero_grad()
    opt.wait_for_step()
    return model, ref


def test_a_write_through_the_real_gradient_is_stepped() -> None:
    def edit(model: Any, names: dict[str, Any], ref: Reference) -> None:
        model.l1.weight.grad.view(-1).mul_(0.5)  # a view: needs the real gradient
        q = names["l1.weight"]
        ref.acc[id(q)] = ref.acc[id(q)].to(torch.bfloat16).float() * 0.5

    model, ref = _two_steps(edit)
    check(model, ref, [])


def test_a_gradient_set_by_hand_or_to_none_is_what_steps() -> None:
    def edit(model: Any, names: dict[str, Any], ref: Reference) -> None:
        g = torch.full_like(model.l2.weight, 0.25)
        model.l2.weight.grad = g
        model.side.bias.grad = None
        ref.acc[id(names["l2.weight"])] = g.float()
        del ref.acc[id(names["side.bias"])]

    model, ref = _two_steps(edit)
    check(model, ref, [])


def test_model_zero_grad_drops_the_accumulation() -> None:
    model = make_model()
    opt = build(model)
    before = [p.detach().clone() for p in model.parameters()]
    loss_fn(model, batches(1, 1)[0][0]).backward()
    model.zero_grad()  # as torch: the step after it has nothing to step on
    opt.step()
    opt.wait_for_step()
    assert all(same_bits(p, q) for p, q in zip(model.parameters(), before))
    loss_fn(model, batches(1, 1)[0][0]).backward()
    opt.step()  # and the next step steps
    opt.wait_for_step()
    assert not all(same_bits(p, q) for p, q in zip(model.parameters(), before))


def test_a_gradient_dropped_between_micro_steps_starts_its_sum_again() -> None:
    model = make_model()
    ref = reference(model)
    opt = build(model)
    step = batches(1, 2)[0]
    loss_fn(model, step[0]).backward()
    ref.micro_step(lambda m: loss_fn(m, step[0]))
    model.l1.weight.grad = None
    del ref.acc[id(ref.model.l1.weight)]
    loss_fn(model, step[1]).backward()
    ref.micro_step(lambda m: loss_fn(m, step[1]))
    ref.step()
    opt.step()
    opt.wait_for_step()
    check(model, ref, [])


def test_a_backward_whose_forward_the_optimizer_did_not_see() -> None:
    # A loss from the submodules, not the model's forward: autograd accumulates into
    # the placeholders the last backward left, and the hooks take what it added.
    model = make_model()
    ref = reference(model)
    opt = build(model)

    def loss(m: Any, b: Any) -> torch.Tensor:
        idx, tgt, _ = b
        h = m.l2(torch.relu(m.l1(m.emb(idx))))
        return torch.nn.functional.cross_entropy(m.head(h).float().reshape(-1, 11),
                                                 tgt.reshape(-1))

    for step in batches(2, 3):
        for b in step:
            loss(model, b).backward()
            ref.micro_step(lambda m, b=b: loss(m, b))
        theirs = ref.step(lambda ps: torch.nn.utils.clip_grad_norm_(ps, MAX_NORM))
        mine = clip_grad_norm_(model.parameters(), MAX_NORM)
        assert same_bits(mine, theirs)
        opt.step()
        opt.zero_grad()
    opt.wait_for_step()
    check(model, ref, [])


def test_clipping_under_backward_overlap_is_refused_at_the_first_clip_call() -> None:
    model = make_model()
    opt = build(model, overlap="backward")
    ref = reference(model)
    b = batches(1, 1)[0][0]
    loss_fn(model, b).backward()
    ref.micro_step(lambda m: loss_fn(m, b))
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    # The norm alone (to log it) is there: the final backward took it.
    total = torch.nn.utils.get_total_norm(grads)
    assert same_bits(total, ref.step(lambda ps: torch.nn.utils.get_total_norm(
        [p.grad for p in ps])))
    with pytest.raises(ConfigError, match="overlap='backward'"):
        clip_grad_norm_(model.parameters(), MAX_NORM)
    opt.step()


def test_a_backward_after_the_clip_call_is_refused() -> None:
    model = make_model()
    opt = build(model)
    data = batches(1, 2)[0]
    loss_fn(model, data[0]).backward()
    clip_grad_norm_(model.parameters(), MAX_NORM)  # ends the accumulation
    with pytest.raises(GradientError, match="after the loop read this step.s gradients"):
        loss_fn(model, data[1]).backward()
    opt.zero_grad()


def test_a_placeholder_kept_across_step_refuses() -> None:
    model = make_model()
    opt = build(model)
    loss_fn(model, batches(1, 1)[0][0]).backward()
    g = model.l1.weight.grad
    opt.step()
    assert model.l1.weight.grad is None  # step() consumes the gradients
    with pytest.raises(GradientError, match="step already taken"):
        g.norm()
    opt.wait_for_step()


def test_the_loop_and_the_optimizer_both_clipping_is_refused() -> None:
    model = make_model()
    opt = build(model, max_norm=1.0)
    loss_fn(model, batches(1, 1)[0][0]).backward()
    clip_grad_norm_(model.parameters(), MAX_NORM)
    with pytest.raises(ConfigError, match="clipped twice"):
        opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("mutated", [False, True])
def test_a_clip_call_waits_for_the_host_folds(mutated: bool) -> None:
    """The clip call's norm waits for the folds of the last micro-step: the fold is
    held until the caller blocks in that wait, so without it the norm is read from
    a sum that is not there yet."""
    model = make_model()
    ref = reference(model)
    opt = build(model)
    step = batches(1, 2)[0]
    with opt.no_sync():
        loss_fn(model, step[0]).backward()
    ref.micro_step(lambda m: loss_fn(m, step[0]))
    ref.micro_step(lambda m: loss_fn(m, step[1]))
    want = ref.step(lambda ps: torch.nn.utils.clip_grad_norm_(ps, MAX_NORM))
    switch = testing.disable("grad_read_wait") if mutated else contextlib.nullcontext()
    with switch, testing.hold_task(r"acc:.*") as release:
        loss_fn(model, step[1]).backward()  # the final micro-step: its folds are held
        watcher = release_when_waiting(release, "norm")
        try:
            got = clip_grad_norm_(model.parameters(), MAX_NORM)
        except (KeyError, PipeoffError):
            got = None
        finally:
            release.set()
            watcher.join()
    opt.zero_grad()
    if mutated:
        assert got is None or not same_bits(got, want)
    else:
        assert got is not None and same_bits(got, want)


@pytest.mark.parametrize("mutated", [False, True])
def test_a_gradient_set_by_hand_waits_for_the_folds_it_replaces(mutated: bool) -> None:
    """A gradient put in .grad between micro-steps replaces the host sum once the fold
    of the micro-step before it has written that sum (held until then)."""
    model = make_model()
    opt = build(model)
    step = batches(1, 2)[0]
    g = torch.full_like(model.l1.weight, 0.5)
    i = [n for n, _ in model.named_parameters()].index("l1.weight")  # its tasks' index
    switch = testing.disable("grad_edit_wait") if mutated else contextlib.nullcontext()
    with switch, testing.hold_task(rf"acc:{i}\..*") as release:
        loss_fn(model, step[0]).backward()  # l1.weight's fold is held
        model.l1.weight.grad = g
        watcher = release_when_waiting(release, "edit_sums")
        try:
            loss_fn(model, step[1]).backward()  # its forward withdraws the placeholders
        finally:
            release.set()
            watcher.join()
    got = model.l1.weight.grad.norm()  # the FP32 host sum's
    opt.zero_grad()
    ref = reference(make_model())
    ref.acc[id(ref.model.l1.weight)] = g.float()
    ref.micro_step(lambda m: loss_fn(m, step[1]))
    want = ref.acc[id(ref.model.l1.weight)].norm()
    assert same_bits(got, want) != mutated


def test_models_with_the_optimizer_attached_pickle_and_deepcopy() -> None:
    model = make_model()
    opt = build(model)
    opt.attach()
    loss_fn(model, batches(1, 1)[0][0]).backward()  # placeholders in .grad
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    copied = copy.deepcopy(model)
    pickle.loads(pickle.dumps(copied))
    real = pickle.loads(pickle.dumps(model.l1.weight.grad))  # the real gradient
    assert type(real) is torch.Tensor and real.shape == model.l1.weight.shape
    opt.step()
    opt.wait_for_step()
    for other in (loaded, copied):  # their hooks are inert: they train on their own
        loss_fn(other, batches(1, 1)[0][0]).backward()
        assert all(p.grad is None or type(p.grad) is torch.Tensor for p in other.parameters())
    opt.zero_grad()


def test_a_deepcopy_while_a_step_is_in_flight_holds_its_finished_weights() -> None:
    model = make_model()
    opt = build(model)
    opt.attach()
    loss_fn(model, batches(1, 1)[0][0]).backward()
    with testing.hold_task(r"h2d:.*") as release:
        opt.step()  # in flight: its copies back are held
        watcher = release_when_waiting(release, "deepcopy")
        try:
            copied = copy.deepcopy(model)
        finally:
            release.set()
            watcher.join()
    opt.wait_for_step()
    assert all(same_bits(p, q) for p, q in zip(model.parameters(), copied.parameters()))


# -- masters that nothing wrote (refresh_masters) ------------------------------------------
def _trained_bf16() -> tuple[torch.nn.Module, FullOffloadOptimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)).to(
        torch.bfloat16)
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-3, overlap="none")
    for _ in range(3):
        model(torch.randn(4, 64, dtype=torch.bfloat16)).float().sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _masters(opt: FullOffloadOptimizer) -> list[torch.Tensor]:
    return [e["master"].clone() for _, e in sorted(opt.state_dict()["state"].items())]


def test_refresh_masters_keeps_the_masters_nothing_wrote() -> None:
    model, opt = _trained_bf16()
    before = _masters(opt)
    assert any(not same_bits(m, m.to(torch.bfloat16).float()) for m in before)  # low bits
    opt.refresh_masters()  # nothing wrote the weights
    assert all(same_bits(a, b) for a, b in zip(before, _masters(opt)))
    with torch.no_grad():
        model[1].weight.data.add_(1.0)  # through .data: no version counter moves
    opt.refresh_masters([model[1].weight, torch.zeros(1)])  # (a stranger is passed over)
    after = _masters(opt)
    assert same_bits(after[2], model[1].weight.float())  # the written one: its weight
    assert all(same_bits(before[i], after[i]) for i in (0, 1, 3))  # the others: kept


# -- checkpoints that do not match --------------------------------------------------------
@pytest.mark.parametrize("which", ["full_offload", "offload"])
def test_a_checkpoint_in_another_parameter_order_is_refused_whole(which: str) -> None:
    """Two parameters of one size and other shapes, saved in one order and loaded in the
    other: refused (torch's AdamW refuses it at the next step), nothing changed."""
    from pipeoff.optim import OffloadOptimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6, bias=False),
                                torch.nn.Linear(6, 4, bias=False))
    a, b = model[0].weight, model[1].weight

    def make(params: list[torch.Tensor]) -> Any:
        if which == "full_offload":
            return FullOffloadOptimizer(model, torch.optim.AdamW, params=params, lr=1e-2)
        return OffloadOptimizer(params, torch.optim.AdamW, lr=1e-2)

    saved_opt = make([a, b])
    model(torch.randn(2, 4)).sum().backward()
    saved_opt.step()
    saved_opt.zero_grad()
    saved = copy.deepcopy(saved_opt.state_dict())
    del saved_opt
    opt = make([b, a])
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises((ConfigError, ValueError), match=r"shape|size"):
        opt.load_state_dict(saved)
    after = opt.state_dict()
    for i, entry in before["state"].items():
        for k, v in entry.items():
            assert same_bits(torch.as_tensor(v), torch.as_tensor(after["state"][i][k])), (i, k)


# -- per-step figures ---------------------------------------------------------------------
def test_step_stats_count_the_bytes_that_moved() -> None:
    """h2d_bytes: the weights of the parameters that had a gradient, unpadded (an idle
    expert with no tokens copies nothing back); d2h_bytes: the gradients shipped."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(13, 7),
                                 "idle": torch.nn.Linear(5, 3)}).to(torch.bfloat16)
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, overlap="none")
    model["used"](torch.randn(2, 13, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    stats = opt.last_step_stats
    used = sum(p.numel() * p.element_size() for p in model["used"].parameters())
    assert stats.h2d_bytes == used  # 13 * 7 * 2 + 7 * 2, no 64-byte padding, no idle layer
    assert stats.d2h_bytes == used


# -- the frameworks' own clip calls --------------------------------------------------------
def test_accelerates_clip_grad_norm() -> None:
    accelerate = pytest.importorskip("accelerate")
    model = make_model()
    ref = reference(model)
    opt = build(model)
    accelerator = accelerate.Accelerator(cpu=True)
    model, wrapped = accelerator.prepare(model, opt)
    norms = []
    for step in batches(3, 2):
        for b in step:
            accelerator.backward(loss_fn(model, b))
            ref.micro_step(lambda m, b=b: loss_fn(m, b))
        mine = accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
        norms.append((mine, ref.step(_torch)))
        wrapped.step()
        wrapped.zero_grad()
    opt.wait_for_step()
    check(model, ref, norms)


@pytest.mark.slow
def test_a_compiled_model_with_the_loops_clip_call() -> None:
    model = make_model()
    ref = reference(model)
    opt = build(model)
    opt.attach()  # its hooks run before every module, compiled or not
    compiled = torch.compile(model, backend="aot_eager")  # eager's bits
    norms = run(compiled, opt, ref, batches(3, 2), _torch, marked=False)
    check(model, ref, norms)


def test_a_grad_scaler_unscales_the_real_gradients_and_skips_nothing_silently() -> None:
    """torch.amp.GradScaler: unscale_ reads every gradient, so they come back (in the
    parameter's dtype, here FP32); unscaled, clipped and stepped, the run is bitwise
    plain AdamW's with the same scaler, and a non-finite gradient skips the step in both."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    ref = copy.deepcopy(model)
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    scalers = [torch.amp.GradScaler("cpu", init_scale=1024.0) for _ in range(2)]
    for step in range(4):
        x = torch.randn(8, 16)
        if step == 2:
            x[0, 0] = float("inf")  # a non-finite gradient: both scalers skip the step
        for m, o, scaler in ((model, opt, scalers[0]), (ref, ref_opt, scalers[1])):
            scaler.scale(m(x).pow(2).mean()).backward()
            scaler.unscale_(o)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1)
            scaler.step(o)
            scaler.update()
            o.zero_grad()
    opt.wait_for_step()
    assert scalers[0].get_scale() == scalers[1].get_scale() < 1024.0
    for p, q in zip(model.parameters(), ref.parameters()):
        assert same_bits(p, q)


# -- found by a fresh helper trying to break the clip path ------------------------------------

def _fp32_pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    return model, copy.deepcopy(model)


@pytest.mark.parametrize("read", ["data.norm", "abs.max", "norm.twice"])
def test_a_norm_read_after_a_scaling_is_the_scaled_norm(read: str) -> None:
    """The loop scales the gradients (1/accumulation), logs a per-parameter figure that
    needs the values (Lightning's grad_norm: p.grad.data.norm()), then clips: every
    norm after the scaling is the scaled gradient's, not the one the final fold
    took before it (a stale cache returned the pre-scaling norm, 4x too large, and
    clipped to it: other weights)."""
    model, ref = _fp32_pair()
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(2):
        x = torch.randn(4, 8)
        got = []
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x).pow(2).mean().mul(100).backward()
            for p in m.parameters():
                p.grad.div_(4)
            if read == "data.norm":
                logged = [p.grad.data.norm(2) for p in m.parameters()]
            elif read == "abs.max":
                logged = [p.grad.abs().max() for p in m.parameters()]
            else:
                logged = [p.grad.norm() for p in m.parameters()] + [
                    p.grad.norm() for p in m.parameters()]
            total = torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            after = torch.nn.utils.clip_grad_norm_(m.parameters(), float("inf"))
            got.append((logged, total, after))
            o.step()
            o.zero_grad()
        (mine, total, after), (want, want_total, want_after) = got
        assert all(same_bits(a, b) for a, b in zip(mine, want)), (step, mine, want)
        assert same_bits(total, want_total) and same_bits(after, want_after), (total, want_total)
    opt.wait_for_step()
    assert all(same_bits(p, q) for p, q in zip(model.parameters(), ref.parameters()))


@pytest.mark.parametrize("foreach", [None, True, False])
def test_one_clip_call_over_placeholders_and_plain_gradients(foreach: bool | None) -> None:
    """Full offload steps part of the model, a plain AdamW the rest, and the loop clips
    all of it in one call (``foreach=True`` is torch's default on CUDA): the real
    gradients are scaled as torch scales them (this raised an AttributeError from
    the overload's name), the host sums in the step, bitwise one AdamW's."""
    model, ref = _fp32_pair()
    opt = FullOffloadOptimizer(list(model[0].parameters()), torch.optim.AdamW, lr=1e-2)
    opt2 = torch.optim.AdamW(model[2].parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for _ in range(2):
        x = torch.randn(4, 8)
        for m in (model, ref):
            m(x).pow(2).mean().mul(100).backward()
        assert [type(p.grad) for p in model.parameters()] == [HostGrad, HostGrad,
                                                               torch.Tensor, torch.Tensor]
        n = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1, foreach=foreach)
        rn = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1, foreach=foreach)
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.01, foreach=foreach)
        torch.nn.utils.clip_grad_value_(ref.parameters(), 0.01, foreach=foreach)
        assert same_bits(n, rn), (n, rn)
        for o in (opt, opt2, ref_opt):
            o.step()
            o.zero_grad()
    opt.wait_for_step()
    assert all(same_bits(p, q) for p, q in zip(model.parameters(), ref.parameters()))


def test_value_reads_outside_aten_give_the_real_gradient() -> None:
    """``.tolist()`` and ``.numpy()`` (a logging line) read the gradient's values, not
    torch's refusal for a tensor subclass."""
    model, ref = _fp32_pair()
    # Kept: an optimizer nobody holds is collected whenever the cyclic GC runs, and its
    # placeholders then refuse (a CI run under load collected it mid-test).
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
    x = torch.randn(4, 8)
    for m in (model, ref):
        m(x).pow(2).mean().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.grad.tolist() == q.grad.tolist()
        assert (p.grad.numpy() == q.grad.numpy()).all()
    opt.zero_grad()


@pytest.mark.parametrize("foreach", [True, False])
def test_one_clip_call_over_two_optimizers_parameters(foreach: bool) -> None:
    # torchtitan's train step clips every model part's gradients in one call, each part
    # with its own FullOffloadOptimizer: each placeholder answers through its own
    # optimizer (one foreach norm or scale over both once failed with a GradientError).
    torch.manual_seed(0)
    parts = [torch.nn.Linear(6, 6), torch.nn.Linear(6, 3)]
    refs = [copy.deepcopy(p) for p in parts]
    opts = [FullOffloadOptimizer(p, torch.optim.AdamW, lr=1e-2) for p in parts]
    ref_opt = torch.optim.AdamW([q for r in refs for q in r.parameters()], lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(4, 6, generator=g) * 10
        for model, step in ((parts, opts), (refs, [ref_opt])):
            model[1](model[0](x)).square().mean().backward()
            params = [q for m in model for q in m.parameters()]
            norm = torch.nn.utils.clip_grad_norm_(params, 0.5, foreach=foreach)
            assert float(norm) > 0.5  # it clips
            for o in step:
                o.step()
                o.zero_grad()
    for o in opts:
        o.wait_for_step()
    for m, r in zip(parts, refs):
        for p, q in zip(m.parameters(), r.parameters()):
            assert torch.equal(p, q)


@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("read", ["clip_grad_norm_", "other_grad_norm", "opt_grad_norm"])
@pytest.mark.parametrize("edit", ["dropped", "replaced"])
def test_a_gradient_dropped_or_replaced_before_the_loops_read_stays_so(
        edit: str, read: str, fraction: float) -> None:
    """The backward is not known final (no no_sync(), no gradient_accumulation_steps);
    the loop drops (``p.grad = None``) or replaces one gradient, then reads another
    (its clip call, a norm, ``opt.grad_norm``), which ends the accumulation. The read
    took the replacement as one more gradient added to the sum, and showed the dropped
    one's sum again in ``.grad``: stepped, 1e-2 off torch (a tester's find)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    ref = copy.deepcopy(model)
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, offload_fraction=fraction)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    x = torch.randn(8, 4)
    for _ in range(2):
        for m, o in ((model, opt), (ref, None)):
            m(x).pow(2).mean().backward()
            ps = list(m.parameters())
            ps[0].grad = None if edit == "dropped" else torch.full_like(ps[0], 0.25)
            if read == "clip_grad_norm_":
                clip_grad_norm_(ps, 1e9)  # (binds nowhere: only the read matters)
            elif read == "other_grad_norm":
                ps[1].grad.norm()
            elif o is not None:
                float(o.grad_norm)
            assert (ps[0].grad is None) == (edit == "dropped")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    opt.wait_for_step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name
    assert sorted(opt.state_dict()["state"]) == sorted(ref_opt.state_dict()["state"])


@pytest.mark.parametrize("read_first", [False, True], ids=["", "read-first"])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("marked", ["gradient_accumulation_steps", "no_sync"])
@pytest.mark.parametrize("edit", ["dropped", "replaced"])
def test_grad_norm_after_a_known_final_backward_counts_the_loops_edits(
        edit: str, marked: str, fraction: float, read_first: bool) -> None:
    """The final backward is known (``gradient_accumulation_steps``, or ``no_sync()`` on
    the micro-steps before it), so its norm is taken as it ends; the loop then drops or
    replaces one gradient and reads ``opt.grad_norm``, the skip-on-non-finite pattern's
    read. It reported the norm from before the edit (1.09 where torch's is 0.75, in a
    tester's repro): a dropped NaN still skipped the step. (``read_first``: the norm
    was read before the edit too; on one process a second read takes the edit.)"""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    ref = copy.deepcopy(model)
    steps = 2 if marked == "gradient_accumulation_steps" else None
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, offload_fraction=fraction,
                               gradient_accumulation_steps=steps)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        xs = [torch.randn(8, 4, generator=g) for _ in range(2)]
        with opt.no_sync() if marked == "no_sync" else contextlib.nullcontext():
            model(xs[0]).pow(2).mean().backward()
        model(xs[1]).pow(2).mean().backward()
        for x in xs:
            ref(x).pow(2).mean().backward()
        if read_first:
            before = clip_grad_norm_(ref.parameters(), float("inf"), foreach=False)
            assert torch.equal(opt.grad_norm, before)
        for m in (model, ref):
            ps = list(m.parameters())
            ps[0].grad = None if edit == "dropped" else torch.full_like(ps[0], 0.25)
        want = clip_grad_norm_(ref.parameters(), float("inf"), foreach=False)
        got = opt.grad_norm
        assert got is not None and torch.equal(got, want), (float(got), float(want))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    opt.wait_for_step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("fraction", [1.0, 0.3])
@pytest.mark.parametrize("marked", [False, True])
def test_grad_norm_with_every_gradient_dropped_is_zero_as_torchs(marked: bool,
                                                                  fraction: float) -> None:
    """Every gradient dropped after the backward: torch's clip_grad_norm_ gives 0, so the
    skip-on-non-finite pattern steps (nothing). opt.grad_norm was None, and
    ``torch.isfinite(opt.grad_norm)`` raised TypeError (a tester's find)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    before = [p.detach().clone() for p in model.parameters()]
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, offload_fraction=fraction,
                               gradient_accumulation_steps=1 if marked else None)
    model(torch.randn(8, 4)).pow(2).mean().backward()
    for p in model.parameters():
        p.grad = None
    norm = opt.grad_norm
    assert norm is not None and torch.equal(norm, clip_grad_norm_([], 1.0))
    assert torch.isfinite(norm)
    opt.step()
    opt.zero_grad()
    opt.wait_for_step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
