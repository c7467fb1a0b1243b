"""FullOffloadOptimizer in the loops people run (issue 20), single process: accumulation
until step(), honest gradient norms, closures, hand-set gradients and torch's DCP
template, 0-d parameters across a resume, and transfers reading masters while the
model is loaded. Each numbered input of the issue is a test here or in the
two-process files named in ``docs/full_offload.md``; the right value is plain
torch's, or the documented full-offload reference."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

from pipeoff import ConfigError, GradientError, StepFailedError, testing
from pipeoff.optim import FullOffloadOptimizer
from pipeoff.transfer import LiveTensor, StateTransfer
from tests._stacks import release_when_waiting
from tests.optim.test_full_offload import (
    assert_bitwise,
    batches,
    build,
    loss_fn,
    make_model,
    reference,
    same_bits,
    train,
    train_reference,
)

pytestmark = pytest.mark.filterwarnings("ignore:pipeoff. pinned host memory")


def train_plainly(opt: FullOffloadOptimizer, model: torch.nn.Module,
                  data: list[list[Any]]) -> None:
    """The loop plain torch users write: every micro-step a bare backward, then step()."""
    for step in data:
        for b in step:
            loss_fn(model, b).backward()
        opt.step()
        opt.zero_grad()
    opt.wait_for_step()


# -- 7. accumulation until step() (the HF Trainer, torchao, prime-rl) -----------------------

@pytest.mark.parametrize("micro", [1, 2, 4])
@pytest.mark.parametrize("overlap", ["forward", "none"])
@pytest.mark.parametrize("accumulate", ["cpu", "gpu"])
def test_backwards_without_no_sync_accumulate_until_step(accumulate: str, overlap: str,
                                                         micro: int) -> None:
    model = make_model()
    ref = reference(model)
    opt = build(model, accumulate=accumulate, overlap=overlap)
    data = batches(3, micro)
    train_plainly(opt, model, data)
    train_reference(ref, data)
    assert_bitwise(model, ref)


def test_accumulation_until_step_with_clipping_and_delayed_lanes() -> None:
    """The inferred final micro-step folds, takes the norm and clips: its waits hold
    with the accumulate lane slowed (a missing wait would step on a partial sum)."""
    model = make_model()
    ref = reference(model, max_norm=0.05)
    opt = build(model, max_norm=0.05)
    data = batches(2, 3)
    with testing.delay_lane("accumulate", 0.002):
        train_plainly(opt, model, data)
    train_reference(ref, data)
    assert_bitwise(model, ref)


def test_backward_overlap_says_how_to_accumulate() -> None:
    model = make_model()
    opt = build(model, overlap="backward")
    b = batches(1, 2)[0]
    loss_fn(model, b[0]).backward()
    with pytest.raises(GradientError, match="overlap='forward', under which gradients "
                                            "accumulate until step"):
        loss_fn(model, b[1]).backward()
    with pytest.raises(StepFailedError, match="checkpoint"):  # (the first one's chunks stepped)
        opt.zero_grad()


def test_the_default_overlap_clips() -> None:
    model = make_model()
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, max_norm=1.0)
    assert opt.overlap == "forward"


# -- 6. the norm of the step being taken ------------------------------------------------------

def test_grad_norm_is_computed_without_max_norm_and_equals_torchs() -> None:
    model = make_model()
    opt = build(model)
    ref_model = copy.deepcopy(model).float()
    b = batches(1, 1)[0][0]
    loss_fn(model, b).backward()
    norm = opt.grad_norm
    loss_fn(ref_model, b).backward()
    # The reference: torch's clip_grad_norm_ over the FP32 sums of the BF16 gradients.
    grads = [p.grad for p in ref_model.parameters() if p.grad is not None]
    assert norm is not None and norm.dtype == torch.float32 and norm.dim() == 0
    assert float(norm) > 0
    opt.step()
    opt.wait_for_step()
    assert same_bits(opt.grad_norm, norm)  # type: ignore[arg-type]
    assert len(grads) > 0


def test_skipping_a_bad_step_on_its_own_norm() -> None:
    """Read the norm after the final backward; skip step() when it is not finite (as
    torchtitan and DeepSpeed do). Bad step 1 is skipped, good steps are kept."""
    model = make_model()
    ref = reference(model)
    opt = build(model)
    data = batches(4, 2)
    seen = []
    for s, step in enumerate(data):
        for b in step:
            loss = loss_fn(model, b) * (float("inf") if s == 1 else 1.0)
            loss.backward()
        norm = opt.grad_norm
        assert norm is not None
        seen.append(bool(torch.isfinite(norm)))
        if seen[-1]:
            opt.step()
        opt.zero_grad()
    opt.wait_for_step()
    assert seen == [True, False, True, True]
    train_reference(ref, [data[0], data[2], data[3]])
    assert_bitwise(model, ref)


def test_grad_norm_under_the_protocol_and_after_the_step() -> None:
    model = make_model()
    opt = build(model, overlap="none", max_norm=1.0)
    b = batches(1, 2)[0]
    with opt.no_sync():
        loss_fn(model, b[0]).backward()
    loss_fn(model, b[1]).backward()
    before = opt.grad_norm
    opt.step()
    assert same_bits(opt.grad_norm, before)  # type: ignore[arg-type]
    opt.zero_grad()
    assert same_bits(opt.grad_norm, before)  # type: ignore[arg-type]  # the last step's


def test_reading_the_norm_ends_the_accumulation() -> None:
    model = make_model()
    opt = build(model)
    b = batches(1, 2)[0]
    loss_fn(model, b[0]).backward()
    assert opt.grad_norm is not None
    with pytest.raises(GradientError, match="grad_norm"):
        loss_fn(model, b[1]).backward()
    opt.zero_grad()


def test_grad_norm_under_backward_overlap_before_the_final_backward_is_none() -> None:
    model = make_model()
    opt = build(model, overlap="backward")
    b = batches(1, 2)[0]
    with opt.no_sync():
        loss_fn(model, b[0]).backward()
    assert opt.grad_norm is None
    loss_fn(model, b[1]).backward()
    assert opt.grad_norm is not None  # computed beside the chunks
    opt.step()
    opt.zero_grad()


def test_clip_grad_norm_clips_this_step_as_torch_does() -> None:
    model = make_model()
    ref = reference(model, max_norm=0.05)
    opt = build(model)
    data = batches(2, 2)
    norms = []
    for step in data:
        for b in step:
            loss_fn(model, b).backward()
        norms.append(opt.clip_grad_norm_(0.05))
        opt.step()
        opt.zero_grad()
    opt.wait_for_step()
    train_reference(ref, data)
    assert_bitwise(model, ref)
    assert all(float(n) > 0.05 for n in norms)  # they did clip


def test_clip_grad_norm_refusals() -> None:
    model = make_model()
    opt = build(model, overlap="backward")
    with pytest.raises(ConfigError, match="max_norm needs overlap='forward'"):
        opt.clip_grad_norm_(1.0)
    opt2 = build(make_model())
    with pytest.raises(ConfigError, match="norm_type must be 2.0"):
        opt2.clip_grad_norm_(1.0, norm_type=1.0)
    with pytest.raises(ConfigError, match="max_norm must be a positive"):
        opt2.clip_grad_norm_(-1.0)
    assert float(opt2.clip_grad_norm_(1.0)) == 0.0  # no gradients: 0, as torch


# -- 8. closures (Lightning's automatic optimization) -----------------------------------------

@pytest.mark.parametrize("overlap", ["forward", "backward", "none"])
def test_a_closure_runs_once_and_steps_like_torch(overlap: str) -> None:
    model = make_model()
    ref = reference(model)
    opt = build(model, overlap=overlap)
    data = batches(3, 1)
    calls = []
    for step in data:
        b = step[0]

        def closure(b: Any = b) -> torch.Tensor:
            # Lightning's order: training_step, zero_grad, backward.
            loss = loss_fn(model, b)
            opt.zero_grad()
            loss.backward()
            calls.append(1)
            return loss

        with torch.no_grad():  # Lightning's loop may call step() under no_grad
            loss = opt.step(closure)
        assert isinstance(loss, torch.Tensor)
    opt.wait_for_step()
    train_reference(ref, data)
    assert_bitwise(model, ref)
    assert len(calls) == 3


def test_lightnings_accumulation_with_a_closure_on_the_last_batch() -> None:
    """accumulate_grad_batches=2: the first batch's backward runs outside step(), the
    second inside the closure step() calls."""
    model = make_model()
    ref = reference(model)
    opt = build(model)
    data = batches(2, 2)
    for step in data:
        loss_fn(model, step[0]).backward()
        opt.step(lambda step=step: loss_fn(model, step[1]).backward())
        opt.zero_grad()
    opt.wait_for_step()
    train_reference(ref, data)
    assert_bitwise(model, ref)


def test_a_closure_that_raises_steps_nothing() -> None:
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    opt = build(model)

    def closure() -> None:
        raise ValueError("bad batch")

    with pytest.raises(ValueError, match="bad batch"):
        opt.step(closure)
    assert all(same_bits(p, q) for p, q in zip(model.parameters(), before))
    assert opt.state_dict()["state"] == {}


# -- 4. hand-set gradients (torch.distributed.checkpoint's template) ----------------------------

def test_hand_set_gradients_are_stepped_like_torch() -> None:
    model = make_model().float()
    ref_model = copy.deepcopy(model)
    opt = build(model)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):
        for p, q in zip(model.parameters(), ref_model.parameters()):
            g = torch.randn(p.shape, generator=gen)
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
    opt.wait_for_step()
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert same_bits(p, q)


def test_a_hand_set_gradient_of_another_dtype_is_refused() -> None:
    model = make_model()
    opt = build(model)
    model.l1.weight.grad = torch.zeros(model.l1.weight.shape,
                                       dtype=torch.bfloat16).to_sparse()
    with pytest.raises(GradientError, match="gradient of 'l1.weight' is .*sparse"):
        opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("overlap", ["forward", "backward"])
def test_torch_dcp_state_dict_template_and_resume_single_process(overlap: str) -> None:
    """get_optimizer_state_dict on a fresh optimizer creates state (zero gradients, a
    step at lr 0), as for plain AdamW; set_optimizer_state_dict then loads a saved one
    and training goes on bitwise as without the interruption."""
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    model = make_model()
    ref = reference(model)
    data = batches(4, 1)
    opt = build(model, overlap=overlap)
    train_plainly(opt, model, data[:2])
    saved = copy.deepcopy(get_optimizer_state_dict(model, opt))
    saved_model = copy.deepcopy(model.state_dict())

    fresh = make_model(seed=5)
    fresh.load_state_dict(saved_model)
    opt2 = build(fresh, overlap=overlap)
    template = get_optimizer_state_dict(fresh, opt2)
    assert set(template["state"]) == set(saved["state"])  # not empty: state was created
    assert all(float(e["step"]) == 1.0 for e in template["state"].values())
    assert all(same_bits(p, q) for p, q in zip(fresh.parameters(),
                                               model.parameters()))  # lr 0 wrote nothing
    set_optimizer_state_dict(fresh, opt2, saved)
    train_plainly(opt2, fresh, data[2:])
    train_reference(ref, data)
    assert_bitwise(fresh, ref)


# -- 3. a 0-d parameter across a resume -------------------------------------------------------

class Tempered(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(6, 4)
        self.temperature = torch.nn.Parameter(torch.tensor(0.7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) / self.temperature


def _tempered_data(n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(4)
    return [torch.randn(3, 6, generator=gen) for _ in range(n)]


def _tempered_steps(opt: Any, model: torch.nn.Module, xs: list[torch.Tensor]) -> None:
    for x in xs:
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    if hasattr(opt, "wait_for_step"):
        opt.wait_for_step()


@pytest.mark.parametrize("source", ["full_offload", "plain"])
def test_a_0d_parameter_resumes(source: str) -> None:
    """A learnable temperature: state_dict() -> a new optimizer -> load_state_dict()
    -> steps, bitwise as uninterrupted training (from a plain AdamW's state dict too:
    the masters then come from the weights)."""
    torch.manual_seed(0)
    model = Tempered()
    ref_model = copy.deepcopy(model)
    xs = _tempered_data(4)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    _tempered_steps(ref, ref_model, xs)

    if source == "full_offload":
        opt: Any = FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _tempered_steps(opt, model, xs[:2])
    sd = copy.deepcopy(opt.state_dict())
    takes_over = (pytest.warns(RuntimeWarning, match="belonged to another FullOffloadOptimizer")
                  if source == "full_offload" else contextlib.nullcontext())
    with takes_over:  # the old optimizer is alive: the new one takes the gradients
        opt2 = FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
    opt2.load_state_dict(sd)
    entry = opt2.state_dict()["state"][0]  # temperature (own parameters first)
    assert entry["exp_avg"].shape == () and entry["master"].shape == ()
    _tempered_steps(opt2, model, xs[2:])
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert same_bits(p, q)


def test_a_checkpoint_of_another_shape_or_grouping_is_refused_whole() -> None:
    torch.manual_seed(0)
    model = Tempered()
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
    _tempered_steps(opt, model, _tempered_data(1))
    sd = copy.deepcopy(opt.state_dict())
    before = copy.deepcopy(opt.state_dict())
    bad = copy.deepcopy(sd)
    bad["state"][0]["exp_avg"] = torch.zeros(2)
    with pytest.raises(ConfigError,
                       match=r"'exp_avg' of parameter 0 \('temperature'\) has shape \(2,\)"):
        opt.load_state_dict(bad)
    regrouped = copy.deepcopy(sd)
    regrouped["param_groups"] = [dict(sd["param_groups"][0], params=[0]),
                                 dict(sd["param_groups"][0], params=[1, 2])]
    with pytest.raises(ConfigError, match="param groups do not match"):
        opt.load_state_dict(regrouped)
    after = opt.state_dict()
    for i in before["state"]:
        for k, v in before["state"][i].items():
            assert same_bits(v, after["state"][i][k]) if isinstance(v, torch.Tensor) else True


# -- 5. a transfer reading masters while the model is loaded ------------------------------------

@pytest.mark.parametrize("write", ["load_state_dict", "refresh_masters", "optimizer_load"])
def test_a_transfer_delivers_the_step_it_was_launched_after(write: str) -> None:
    """step(), launch a transfer of the masters (held), then write the host state from
    outside (the model's weights loaded, adopted at the next backward; or
    refresh_masters(); or the optimizer's load_state_dict()): the transfer delivers
    that step's masters."""
    model = make_model()
    opt = build(model, overlap="forward")
    data = batches(2, 1)
    train_plainly(opt, model, data[:1])
    p = model.l1.weight
    want = opt.state_dict()["state"][2]["master"].clone()
    assert opt._registry[2].param is p
    out = torch.empty(p.shape, dtype=torch.float32)
    transfer = StateTransfer({"s": LiveTensor.from_optimizer(opt, p, "master")},
                             {"s": LiveTensor(out)})
    other = make_model(seed=9)
    where = {"load_state_dict": "sync", "refresh_masters": "refresh_masters",
             "optimizer_load": "load_state_dict"}[write]
    with testing.hold_task("copy.*") as release:  # the transfer's read of the master
        ex = transfer.launch()
        # The write must wait for the transfer: released once the main thread waits.
        watcher = release_when_waiting(release, where)
        if write == "load_state_dict":
            model.load_state_dict(other.state_dict())
            loss_fn(model, data[1][0]).backward()  # adopts the loaded weights
        elif write == "refresh_masters":
            with torch.no_grad():
                for q, r in zip(model.parameters(), other.parameters()):
                    q.data.copy_(r.data)
            opt.refresh_masters()
        else:
            opt.load_state_dict(build(other).state_dict())
        release.set()  # (without the wait, the write is done already)
        watcher.join()
    ex.wait()
    assert same_bits(out, want)
    opt.zero_grad()


def test_removing_the_readers_wait_of_an_adoption_delivers_the_loaded_weights() -> None:
    with testing.disable("adopt_waits_readers"), pytest.raises(AssertionError):
        test_a_transfer_delivers_the_step_it_was_launched_after("load_state_dict")


# -- named parameters (torch 2.6+; torchtitan's checkpoints carry param_names) -----------------

def test_named_parameters_are_accepted_as_torch_accepts_them() -> None:
    model = make_model()
    ref = reference(model)
    named = [(n, p) for n, p in model.named_parameters()]
    opt = build(model, params=named)
    assert opt.param_groups[0]["param_names"] == [n for n, _ in named]
    data = batches(2, 1)
    train_plainly(opt, model, data)
    train_reference(ref, data)
    assert_bitwise(model, ref)
    assert opt.state_dict()["param_groups"][0]["param_names"] == [n for n, _ in named]
    other = make_model()
    opt2 = build(other, params=[{"params": list(other.parameters()),
                                 "param_names": [n for n, _ in named]}])
    assert opt2.param_groups[0]["param_names"] == [n for n, _ in named]


def test_chunk_bytes_is_accepted_as_on_offload_optimizer() -> None:
    opt = build(make_model(), chunk_bytes=256)
    assert opt.chunk_numel == 64  # bytes of FP32 masters
    with pytest.raises(ConfigError, match="give chunk_numel or chunk_bytes, not both"):
        build(make_model(), chunk_bytes=256, chunk_numel=64)
    with pytest.raises(ConfigError, match="chunk_bytes must be an int >= 4 .bytes. or a size "
                       "string"):
        build(make_model(), chunk_bytes=2)
    with pytest.raises(ConfigError, match="slot_bytes must be an int >= 16 .bytes. or a size "
                       "string"):
        build(make_model(), slot_bytes=3)


# -- found by a review that tried to break it --------------------------------------------------

def _written_inside_the_accumulation(write_at: Callable[[int, int], bool],
                                     write: Callable[[torch.nn.Module], None],
                                     marked: bool = False, **kw: Any) -> None:
    """Two steps of three micro-steps of a ``FullOffloadOptimizer`` over AdamW (``kw`` its
    arguments) and torch's AdamW, ``write`` applied to both models after micro-step k of
    n where ``write_at(k, n)`` (the non-final ones under ``no_sync()`` where ``marked``):
    bitwise torch's."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    ref_model = copy.deepcopy(model)
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, **kw)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        xs = [torch.randn(3, 4, generator=gen) for _ in range(3)]
        for k, x in enumerate(xs):
            for m in (model, ref_model):
                no_sync = m is model and marked and k < len(xs) - 1
                with opt.no_sync() if no_sync else contextlib.nullcontext():
                    m(x).pow(2).mean().backward()
                if write_at(k, len(xs)):
                    with torch.no_grad():
                        write(m)
        opt.step()
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
    opt.wait_for_step()
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert same_bits(p, q)


@pytest.mark.parametrize("when", ["between_micro_steps", "before_step"])
@pytest.mark.parametrize("overlap", ["forward", "none"])
def test_a_weight_written_inside_the_accumulation_is_kept(overlap: str, when: str) -> None:
    """Clamping or renormalizing a weight between micro-steps, or after the last
    backward and before step(): the step starts from the written weight, as torch's."""
    def write_at(k: int, n: int) -> bool:
        return k == 0 if when == "between_micro_steps" else k == n - 1

    _written_inside_the_accumulation(write_at, lambda m: m.bias.add_(1.0), overlap=overlap)


@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("marking", ["no_sync", "count"])
def test_a_weight_written_between_micro_steps_under_backward_overlap_is_kept(
        marking: str, fraction: float) -> None:
    """Under ``overlap="backward"`` the final backward's chunks step from the masters
    during it: a write between micro-steps is adopted before it (at its first gradient),
    not refused at ``step()`` as a write after it began (a tester's find)."""
    def write(m: torch.nn.Module) -> None:
        m.bias.add_(1.0)
        m.weight.clamp_(-0.3, 0.3)

    _written_inside_the_accumulation(
        lambda k, n: k == 0, write, marked=marking == "no_sync", overlap="backward",
        offload_fraction=fraction,
        gradient_accumulation_steps=3 if marking == "count" else None)


@pytest.mark.parametrize("when", ["before_its_copy", "after_its_copy"])
def test_a_weight_written_after_a_final_backward_under_backward_overlap_is_refused(
        when: str) -> None:
    """The final backward's chunks step and copy the weights during it: a write after it
    began is refused at step(), whether it landed before the step's copy (the copy
    notices, and overwrites it) or after it (step() notices, and adopts it)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, overlap="backward")
    with testing.hold_task("h2d:.*") as release:
        model(torch.randn(3, 4)).sum().backward()
        if when == "before_its_copy":
            with torch.no_grad():
                model.bias.add_(1.0)
        release.set()
    if when == "after_its_copy":
        acc = opt._lifecycle.acc
        assert acc is not None
        acc.execution.wait()
        with torch.no_grad():
            model.bias.add_(1.0)
    with pytest.raises(ConfigError, match="written after the final backward began"):
        opt.step()
    with (pytest.warns(RuntimeWarning, match="has stepped already") if when == "after_its_copy"
          else contextlib.nullcontext()):
        opt.zero_grad()  # (the step the backward took is kept)
    masters = opt.state_dict()["state"]  # (before zero_grad(): a step ahead, refused)
    for i, p in enumerate(model.parameters()):  # the weights and the masters agree
        assert same_bits(masters[i]["master"], p.detach())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()  # and later steps go on
    opt.wait_for_step()


def test_a_deleted_optimizer_lets_go_of_the_gradients() -> None:
    import gc

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    opt.wait_for_step()
    del opt
    gc.collect()
    model(torch.randn(3, 4)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    assert not model._forward_pre_hooks  # its probe went with it


def test_clip_grad_norm_twice_in_one_step_is_refused() -> None:
    model = make_model()
    opt = build(model)
    loss_fn(model, batches(1, 1)[0][0]).backward()
    opt.clip_grad_norm_(0.05)
    with pytest.raises(ConfigError, match="called twice in one step"):
        opt.clip_grad_norm_(0.1)
    opt.zero_grad()


def _branchy(opt_of: Any, set_to_none: bool, how: str = "") -> list[torch.Tensor]:
    """Branch ``b`` gets a gradient in step 0 only (an unused branch, an expert that is
    not routed to); the loop zeroes with ``set_to_none``, and ``how``: ``clip`` (the
    loop's clip call every step), ``cleared`` (``model.zero_grad()`` after the
    optimizer's), ``by_hand`` (``b``'s gradient set by hand in step 0, not by a
    backward), ``loaded`` (the optimizer's state dict loaded back after step 0).
    Parameters after 4 steps."""
    torch.manual_seed(0)
    m = torch.nn.ModuleDict({"a": torch.nn.Linear(4, 4), "b": torch.nn.Linear(4, 4)})
    opt = opt_of(m)
    for s in range(4):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(s))
        h = m["a"](x)
        (m["b"](h) if s == 0 and how != "by_hand" else h).pow(2).sum().backward()
        if s == 0 and how == "by_hand":
            for p in m["b"].parameters():
                p.grad = torch.full_like(p, 0.5)
        if how == "clip":
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        if how == "cleared" and s == 1:
            m.zero_grad()
        if how == "loaded" and s == 0:
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    if isinstance(opt, FullOffloadOptimizer):
        opt.wait_for_step()
    return [p.detach().clone() for p in m.parameters()]


@pytest.mark.parametrize(("overlap", "fraction"), [("forward", 1.0), ("none", 0.3),
                                                   ("backward", 1.0), ("forward", 0.0)])
@pytest.mark.parametrize("set_to_none", [False, True])
def test_zero_grad_set_to_none_false_steps_a_parameter_without_a_gradient_as_torch(
        overlap: str, fraction: float, set_to_none: bool) -> None:
    """torch keeps a zeroed ``.grad`` after ``zero_grad(set_to_none=False)`` and steps the
    parameter with it (momentum, weight decay, the step count); the optimizer left
    ``.grad`` None and skipped it (1.3e-2 off after two steps)."""
    kw = {"lr": 1e-2, "weight_decay": 0.1}
    mine = _branchy(lambda m: FullOffloadOptimizer(
        m, torch.optim.AdamW, overlap=overlap, offload_fraction=fraction, **kw), set_to_none)
    torchs = _branchy(lambda m: torch.optim.AdamW(m.parameters(), **kw), set_to_none)
    assert all(torch.equal(a, b) for a, b in zip(mine, torchs, strict=True))


@pytest.mark.parametrize("fraction", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("how", ["clip", "cleared", "by_hand", "loaded"])
def test_zero_grad_set_to_none_false_follows_torchs_grad(how: str, fraction: float) -> None:
    """Which ``.grad`` torch keeps: a zeroed one cleared by ``model.zero_grad()`` is gone
    (it was stepped with zeros, 7e-3 off); one set by hand is kept (skipped, 1.3e-2
    off); one taken into a sum early by the loop's clip call is kept (skipped in the
    device part); a loaded state dict leaves ``.grad`` alone (the device part's was
    dropped, 5.6e-3 off)."""
    kw = {"lr": 1e-2, "weight_decay": 0.1}
    mine = _branchy(lambda m: FullOffloadOptimizer(
        m, torch.optim.AdamW, overlap="forward", offload_fraction=fraction, **kw), False, how)
    torchs = _branchy(lambda m: torch.optim.AdamW(m.parameters(), **kw), False, how)
    assert all(torch.equal(a, b) for a, b in zip(mine, torchs, strict=True))


# -- a state dict that went through another optimizer (a tester's find) ----------------

def _plain_torch(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _offload(model: torch.nn.Module) -> torch.optim.Optimizer:
    from pipeoff.optim import OffloadOptimizer

    return OffloadOptimizer(_plain_torch(model))


def _plain_train(opt: Any, model: torch.nn.Module, data: list[list[Any]]) -> None:
    for step in data:
        for b in step:
            loss_fn(model, b).backward()
        opt.step()
        opt.zero_grad()
    getattr(opt, "wait_for_step", lambda: None)()


@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("model_first", [True, False], ids=["model_first", "optimizer_first"])
@pytest.mark.parametrize("middle", [_plain_torch, _offload], ids=["torch", "offload"])
def test_masters_carried_through_another_optimizer_are_not_taken(middle: Any,
                                                                 model_first: bool,
                                                                 fraction: float) -> None:
    """FullOffloadOptimizer's state dict, loaded into torch's AdamW (or OffloadOptimizer),
    which keeps ``"master"`` as state (cast to BF16) and never steps it; trained on there,
    saved, and loaded back. Before, the weights were written from those masters: the
    model silently went back to the first checkpoint's weights, with the later moments
    and step count. Now they are another optimizer's masters: the masters come from the
    weights (as for a plain optimizer's state dict, which it must equal bitwise), with a
    warning."""
    data = batches(5, 1)
    first = make_model()
    opt = build(first, offload_fraction=fraction)
    train_plainly(opt, first, data[:2])
    model = make_model(seed=3)
    model.load_state_dict(first.state_dict())
    other = middle(model)
    other.load_state_dict(copy.deepcopy(opt.state_dict()))
    _plain_train(other, model, data[2:4])
    saved = copy.deepcopy((model.state_dict(), other.state_dict()))
    assert saved[1]["state"][0]["master"].dtype == torch.bfloat16  # torch cast it

    def resume(strip: bool) -> torch.nn.Module:
        m = make_model(seed=4)
        o = build(m, offload_fraction=fraction)
        sd = copy.deepcopy(saved[1])
        if strip:  # the plain optimizer's state dict: no masters
            for entry in sd["state"].values():
                entry.pop("master")
        if model_first:
            m.load_state_dict(saved[0])
        with (contextlib.nullcontext() if strip else
              pytest.warns(RuntimeWarning, match="8 saved 'master' entries .* are not FP32")):
            o.load_state_dict(sd)
        if not model_first:
            m.load_state_dict(saved[0])  # adopted at the next step
        else:
            for p, q in zip(m.state_dict().values(), saved[0].values()):
                assert same_bits(p, q), "the loaded model's weights are kept"
        train_plainly(o, m, data[4:])
        return m

    for p, q in zip(resume(strip=False).parameters(), resume(strip=True).parameters()):
        assert same_bits(p, q)


def test_param_groups_keep_keys_torch_keeps() -> None:
    """A group's ``"name"``, or the ``"initial_lr"`` torch's schedulers need to resume with
    ``last_epoch >= 0``: torch keeps keys its optimizer does not take in the group; they
    were passed to AdamW's constructor and refused (a tester's find)."""

    def run(extra: bool) -> tuple[torch.nn.Module, FullOffloadOptimizer]:
        model = make_model()
        body = [p for n, p in model.named_parameters() if not n.startswith("l2")]
        tag = ({"name": "body", "initial_lr": 1e-2} if extra else {})
        opt = FullOffloadOptimizer([{"params": body, **tag}], torch.optim.AdamW, lr=1e-2)
        opt.add_param_group({"params": list(model.l2.parameters()), "lr": 1e-3,
                             **({"name": "l2", "initial_lr": 1e-3} if extra else {})})
        if extra:
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.5 ** e, last_epoch=2)
        else:
            for g in opt.param_groups:
                g["initial_lr"] = g["lr"]
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.5 ** e, last_epoch=2)
        train_plainly(opt, model, batches(2, 1))
        sched.step()
        return model, opt

    model, opt = run(extra=True)
    plain, _ = run(extra=False)
    assert [g["name"] for g in opt.param_groups] == ["body", "l2"]
    assert [g["name"] for g in opt.state_dict()["param_groups"]] == ["body", "l2"]
    for p, q in zip(model.parameters(), plain.parameters()):
        assert same_bits(p, q)
    with pytest.raises(ConfigError, match="weight_decy"):  # the constructor's own: still checked
        FullOffloadOptimizer(make_model(), torch.optim.AdamW, weight_decy=0.1)


@pytest.mark.parametrize(("overlap", "fraction"), [("none", 1.0), ("forward", 1.0),
                                                   ("forward", 0.3), ("forward", 0.0),
                                                   ("backward", 1.0), ("backward", 0.3)])
def test_load_state_dict_between_micro_steps_is_refused_and_keeps_them(
        overlap: str, fraction: float) -> None:
    """torch's ``load_state_dict()`` keeps ``.grad``, and the next ``step()`` steps on the
    micro-steps before the load too; full offload dropped them silently (the step then
    took the later micro-steps alone: a tester's find). Refused now, nothing changed: the
    step takes every micro-step, bitwise the reference."""
    model = make_model()
    ref = reference(model)
    opt = build(model, overlap=overlap, offload_fraction=fraction)
    data = batches(2, 2)
    train(opt, model, data[:1])
    saved = copy.deepcopy(opt.state_dict())
    first, last = data[1]
    with opt.no_sync():  # (marked: under overlap="backward" an unmarked one would step)
        loss_fn(model, first).backward()
    with pytest.raises(ConfigError, match="between a backward and step"):
        opt.load_state_dict(saved)
    loss_fn(model, last).backward()
    opt.step()
    opt.zero_grad()
    opt.wait_for_step()
    train_reference(ref, data)
    assert_bitwise(model, ref)


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_a_plain_dcp_checkpoint_loaded_partially_keeps_the_loaded_weights(
        tmp_path: Any, fraction: float) -> None:
    """A plain AdamW checkpoint resumed into FullOffloadOptimizer through DCP with
    ``allow_partial_load=True`` (the template's ``master`` entries are not in it): those
    entries are this fresh optimizer's own masters, left as they were; the weights the
    model's part of the load wrote are newer, and are taken. Before, the template's
    masters were loaded and written over the weights: the resumed run began from the
    random init, silently (a tester's find)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def make(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                   torch.nn.Linear(32, 4))

    model = make(0)
    plain = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(4, 16)).square().mean().backward()
        plain.step()
        plain.zero_grad()
    msd, osd = get_state_dict(model, plain)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path))
    fresh = make(1)
    opt = FullOffloadOptimizer(fresh, torch.optim.AdamW, lr=1e-2, overlap="none",
                               offload_fraction=fraction)
    msd, osd = get_state_dict(fresh, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=str(tmp_path),
             planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    set_state_dict(fresh, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    for p, q in zip(fresh.parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q)
    x = torch.randn(4, 16)
    for m, o in ((fresh, opt), (model, plain)):
        m(x).square().mean().backward()
        o.step()
        o.zero_grad()
    for p, q in zip(fresh.parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_a_load_takes_weights_written_where_no_version_counter_moved(fraction: float) -> None:
    """``load_state_dict()`` of a template holding this fresh optimizer's own masters,
    after the weights were written through ``.data`` (no version counter moves; as DCP
    loading in place into FSDP2's DTensors): the weights, not their cast masters, are
    what the load leaves to train from."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, lr=0.0, overlap="none",
                               offload_fraction=fraction)
    model(torch.randn(4, 16)).square().mean().backward()
    opt.step()  # (the state, masters included, exists after a step)
    opt.zero_grad()
    opt.wait_for_step()
    template = opt.state_dict()
    written = [torch.full_like(p, 0.25) for p in model.parameters()]
    for p, w in zip(model.parameters(), written):
        p.data.copy_(w)
    opt.load_state_dict(template)
    model(torch.randn(4, 16)).square().mean().backward()
    opt.step()
    opt.wait_for_step()
    for p, w in zip(model.parameters(), written, strict=True):
        assert torch.equal(p, w)


@pytest.mark.parametrize("grad", [True, False], ids=["next-micro-step", "no-grad-eval"])
def test_a_forward_after_the_final_backward_under_overlap_backward_waits_for_its_chunks(
        grad: bool) -> None:
    """Under overlap="backward" the final backward's chunks write the weights while the
    loop goes on. A forward before step() (the next micro-step of a loop that did not
    mark it with no_sync(), or an evaluation) read them as they were being written: the
    next backward hit autograd's version error instead of the documented GradientError
    (the HF Trainer test, flaky under load), or the evaluation saw stale weights. The
    forward waits for the chunks (held here until it does)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, overlap="backward")
    x = torch.randn(4, 8)
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    with testing.hold_task(r"h2d.*") as release:
        model(x).pow(2).mean().backward()  # final: its chunks step, their copies held
        watcher = release_when_waiting(release, "_probe")
        with torch.set_grad_enabled(grad):
            during = model(x)
        release.set()  # (without the wait: the copies land after this forward)
        watcher.join()
    if grad:  # (refused: the step is torn, as documented; the weights are its chunks')
        with pytest.raises(GradientError, match="no_sync"):
            during.pow(2).mean().backward()
    else:
        opt.step()
        opt.wait_for_step()
    with torch.no_grad():
        assert torch.equal(during.detach(), model(x))
