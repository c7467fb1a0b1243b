"""FullOffloadOptimizer inside Hugging Face's ``transformers.Trainer``.

The Trainer (through accelerate) accumulates micro-batches without any
``no_sync()`` in one process, clips with ``accelerator.clip_grad_norm_`` (or,
with ``max_grad_norm=0``, asks it for the norm with ``max_norm=inf`` to log
it), steps, drives an LR scheduler and zeroes grads with
``model.zero_grad()``. Under full offload ``param.grad`` holds placeholders for
the host sums (``pipeoff.optim.HostGrad``), so the Trainer's own clip call
works unchanged. The right value is the same Trainer run with a plain
``torch.optim.AdamW`` on the same FP32 model: weights, logged losses and logged
``grad_norm`` equal bitwise.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeoff import ConfigError, GradientError
from pipeoff.integrations.hf import prepare_trainer
from pipeoff.optim import FullOffloadOptimizer, OffloadOptimizer
from tests.integrations import _hf

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

SEED = _hf.SEED
STEPS = 3


def tiny_llama() -> Any:
    # initializer_range=0.1: gradient norms of 1.3 to 3.3, so max_grad_norm=1.0 clips.
    return _hf.tiny_llama(initializer_range=0.1)



class KeepLogs(transformers.TrainerCallback):  # type: ignore[misc]
    def __init__(self) -> None:
        self.steps: list[tuple[float, float]] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None,
               **kwargs: Any) -> None:
        if logs and "grad_norm" in logs:
            self.steps.append((logs["loss"], logs["grad_norm"]))


def trainer_for(model: Any, opt: torch.optim.Optimizer | None, out: Path, *,
                accumulation: int, max_grad_norm: float, weight_decay: float = 0.0,
                cls_and_kwargs: Any = None) -> tuple[Any, KeepLogs]:
    args = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=2,
        gradient_accumulation_steps=accumulation, max_grad_norm=max_grad_norm,
        max_steps=STEPS, learning_rate=1e-2, lr_scheduler_type="linear", warmup_steps=1,
        weight_decay=weight_decay, report_to=[], use_cpu=True, save_strategy="no",
        logging_steps=1, seed=SEED, data_seed=SEED, dataloader_num_workers=0,
        disable_tqdm=True)
    logs = KeepLogs()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_hf.Tokens(32),
                                   optimizers=(opt, None), callbacks=[logs],
                                   optimizer_cls_and_kwargs=cls_and_kwargs)
    trainer.remove_callback(transformers.PrinterCallback)
    return trainer, logs


def adamw(model: Any) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def full_offload(model: Any, **kw: Any) -> FullOffloadOptimizer:
    return FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.01,
                                chunk_numel=2048, **kw)


def check_equal(ref: Any, ref_opt: torch.optim.Optimizer, model: Any,
                opt: FullOffloadOptimizer) -> None:
    opt.wait_for_step()
    for (name, p), q in zip(ref.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q), name
    want, got = ref_opt.state_dict(), opt.state_dict()
    assert want["param_groups"][0]["lr"] == got["param_groups"][0]["lr"]
    params = list(model.parameters())
    for i, entry in want["state"].items():
        for k, v in entry.items():
            assert torch.equal(v, got["state"][i][k]), (i, k)
        assert torch.equal(got["state"][i]["master"], params[i].detach()), i  # FP32 model


@pytest.mark.parametrize(("accumulation", "max_grad_norm", "fraction"), [
    (4, 1.0, 1.0), (1, 1.0, 1.0), (4, 0.0, 1.0),
    # A device part: the Trainer's clip call sees both parts' gradients (issue 36).
    (4, 1.0, 0.0), (4, 1.0, 0.5)])
def test_trainer_with_full_offload_matches_adamw(accumulation: int, max_grad_norm: float,
                                                 fraction: float, tmp_path: Path) -> None:
    ref = tiny_llama()
    model = copy.deepcopy(ref)
    init = [p.detach().clone() for p in ref.parameters()]
    ref_opt = adamw(ref)
    # overlap="forward", the default
    opt = full_offload(model, offload_fraction=fraction)
    if fraction == 0.5:
        assert 0 < opt.memory_stats()["params_device"] < len(list(model.parameters()))
    want_trainer, want = trainer_for(ref, ref_opt, tmp_path / "ref", accumulation=accumulation,
                                     max_grad_norm=max_grad_norm)
    got_trainer, got = trainer_for(model, opt, tmp_path / "full", accumulation=accumulation,
                                   max_grad_norm=max_grad_norm)
    want_out = want_trainer.train()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # nothing to warn about
        warnings.filterwarnings("ignore", "pipeoff. pinned host memory")
        got_out = got_trainer.train()
    assert want_out.global_step == got_out.global_step == STEPS
    assert want_out.training_loss == got_out.training_loss
    assert len(want.steps) == STEPS
    assert got.steps == want.steps  # (loss, grad_norm) per step, exactly as floats
    if max_grad_norm:  # the clipping was exercised: every step's norm was above it
        assert all(norm > max_grad_norm for _, norm in want.steps), want.steps
    check_equal(ref, ref_opt, model, opt)
    assert not any(torch.equal(a, p) for a, p in zip(init, model.parameters()))


def _trainer_default_kwargs(tmp_path: Path) -> tuple[Any, dict[str, Any]]:
    """The optimizer class and keywords the Trainer builds by default (transformers 5:
    ``adamw_torch_fused``), for the same arguments."""
    args = transformers.TrainingArguments(output_dir=str(tmp_path), learning_rate=1e-2,
                                          weight_decay=0.1, use_cpu=True, report_to=[])
    return transformers.Trainer.get_optimizer_cls_and_kwargs(args)  # type: ignore[no-any-return]


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["full_offload", "offload"])
def test_the_trainers_own_optimizer_construction(optimizer: str, tmp_path: Path) -> None:
    """optimizer_cls_and_kwargs=(pipeoff's class, {"optimizer_class": ..., ...}): the
    Trainer builds its decay / no-decay groups and calls cls(groups, **kwargs); the run
    is the Trainer's default AdamW run, logged grad_norm included."""
    cls, kwargs = _trainer_default_kwargs(tmp_path)
    assert cls is torch.optim.AdamW
    ref = tiny_llama()
    model = copy.deepcopy(ref)
    want_trainer, want = trainer_for(ref, None, tmp_path / "ref", accumulation=4,
                                     max_grad_norm=1.0, weight_decay=0.1)
    mine: dict[str, Any] = {"optimizer_class": cls, **kwargs}
    if optimizer == "offload":
        mine["mode"] = "overlap"
    klass = FullOffloadOptimizer if optimizer == "full_offload" else OffloadOptimizer
    got_trainer, got = trainer_for(model, None, tmp_path / "mine", accumulation=4,
                                   max_grad_norm=1.0, weight_decay=0.1,
                                   cls_and_kwargs=(klass, mine))
    want_trainer.train()
    got_trainer.train()
    opt = got_trainer.optimizer.optimizer  # (accelerate's wrapper around it)
    assert isinstance(opt, klass)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]  # the Trainer's groups
    assert got.steps == want.steps and len(got.steps) == STEPS
    assert all(norm > 1.0 for _, norm in want.steps)
    opt.wait_for_step()
    for (name, p), q in zip(ref.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q), name
    if optimizer == "full_offload":
        assert opt.model is model  # found at the first forward


class _Factory:
    """An optimizer factory (transformers 5's hook: called as ``cls()(model, **kw)``)."""

    def __call__(self, model: Any, **kwargs: Any) -> Any:
        return FullOffloadOptimizer(model, torch.optim.AdamW, chunk_numel=2048, **kwargs)


class _PlainFactory:
    def __call__(self, model: Any, **kwargs: Any) -> Any:
        return torch.optim.AdamW(model.parameters(), **kwargs)


@pytest.mark.slow
def test_the_trainers_optimizer_factory_hook(tmp_path: Path) -> None:
    ref = tiny_llama()
    model = copy.deepcopy(ref)
    kw = {"lr": 1e-2, "weight_decay": 0.01}
    want_trainer, want = trainer_for(ref, None, tmp_path / "ref", accumulation=4,
                                     max_grad_norm=1.0, cls_and_kwargs=(_PlainFactory, kw))
    got_trainer, got = trainer_for(model, None, tmp_path / "mine", accumulation=4,
                                   max_grad_norm=1.0, cls_and_kwargs=(_Factory, kw))
    want_trainer.train()
    got_trainer.train()
    assert got.steps == want.steps and all(norm > 1.0 for _, norm in want.steps)
    got_trainer.optimizer.optimizer.wait_for_step()
    for (name, p), q in zip(ref.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_overlap_backward_with_clipping_is_refused_at_the_trainers_clip(tmp_path: Path) -> None:
    model = tiny_llama()
    opt = full_offload(model, overlap="backward")
    trainer, _ = trainer_for(model, opt, tmp_path, accumulation=1, max_grad_norm=1.0)
    with pytest.raises(ConfigError, match="overlap='backward'"):
        trainer.train()


def test_overlap_backward_with_accumulation_is_refused(tmp_path: Path) -> None:
    model = tiny_llama()
    opt = full_offload(model, overlap="backward")
    trainer, _ = trainer_for(model, opt, tmp_path, accumulation=4, max_grad_norm=0.0)
    with pytest.raises(GradientError, match="no_sync"):
        trainer.train()


def test_overlap_backward_without_clipping_matches_adamw(tmp_path: Path) -> None:
    # One micro-batch per step: in one process accelerate's no_sync() is a no-op,
    # and overlap="backward" steps in every backward outside the optimizer's no_sync().
    # max_grad_norm=0: the Trainer asks for the norm (max_norm=inf) to log it.
    ref = tiny_llama()
    model = copy.deepcopy(ref)
    ref_opt = adamw(ref)
    opt = full_offload(model, overlap="backward")
    want_trainer, want = trainer_for(ref, ref_opt, tmp_path / "ref", accumulation=1,
                                     max_grad_norm=0.0)
    got_trainer, got = trainer_for(model, opt, tmp_path / "full", accumulation=1,
                                   max_grad_norm=0.0)
    want_trainer.train()
    got_trainer.train()
    assert got.steps == want.steps and len(got.steps) == STEPS
    check_equal(ref, ref_opt, model, opt)


def test_prepare_trainer_is_a_no_op_now(tmp_path: Path) -> None:
    model = tiny_llama()
    trainer, _ = trainer_for(model, full_offload(model), tmp_path, accumulation=1,
                             max_grad_norm=1.0)
    clip = trainer.accelerator.clip_grad_norm_
    with pytest.warns(FutureWarning, match="no longer needed"):
        assert prepare_trainer(trainer) is trainer
    assert trainer.accelerator.clip_grad_norm_ == clip


def _resumable(model: Any, opt: torch.optim.Optimizer, out: Path) -> Any:
    args = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_grad_norm=1.0, max_steps=4, learning_rate=1e-2, lr_scheduler_type="linear",
        warmup_steps=1, report_to=[], use_cpu=True, save_strategy="steps", save_steps=2,
        logging_steps=1, seed=SEED, data_seed=SEED, dataloader_num_workers=0,
        disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_hf.Tokens(32),
                                   optimizers=(opt, None))
    trainer.remove_callback(transformers.PrinterCallback)
    return trainer


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["full_offload", "offload"])
def test_resuming_the_trainers_checkpoint_is_bitwise_the_uninterrupted_run(
        optimizer: str, tmp_path: Path) -> None:
    # The Trainer saves optimizer.pt (torch's state dict, with each master under full
    # offload) and loads it into a fresh optimizer: the resumed run ends where the
    # uninterrupted one did, bit for bit.
    def make(model: Any) -> torch.optim.Optimizer:
        if optimizer == "full_offload":
            return full_offload(model)
        return OffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2,
                                weight_decay=0.01, overlap="forward", chunk_bytes="16KiB")

    init = tiny_llama()
    whole = copy.deepcopy(init)
    whole_opt = make(whole)
    _resumable(whole, whole_opt, tmp_path / "whole").train()
    resumed = copy.deepcopy(init)
    opt = make(resumed)
    _resumable(resumed, opt, tmp_path / "whole").train(
        resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-2"))
    for o in (whole_opt, opt):
        o.wait_for_step()  # type: ignore[attr-defined]
    assert not all(torch.equal(p, q) for p, q in zip(init.parameters(), whole.parameters()))
    for (name, p), q in zip(whole.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q), name
