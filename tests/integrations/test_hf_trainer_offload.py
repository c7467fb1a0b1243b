"""OffloadOptimizer inside Hugging Face's ``transformers.Trainer``, unmodified.

The Trainer (through accelerate) wraps the optimizer, clips the gradients,
accumulates micro-batches, drives an LR scheduler and zeroes grads; the right
value is the same Trainer run with a plain ``torch.optim.AdamW``, bitwise.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeoff.optim import OffloadOptimizer
from tests.integrations import _hf

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

SEED = _hf.SEED


def tiny_llama() -> Any:
    return _hf.tiny_llama()



def train(model: Any, opt: torch.optim.Optimizer, out: Path) -> Any:
    args = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_grad_norm=1.0, max_steps=3, learning_rate=1e-2, lr_scheduler_type="linear",
        warmup_steps=1, report_to=[], use_cpu=True, save_strategy="no", logging_steps=1,
        seed=SEED, data_seed=SEED, dataloader_num_workers=0, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_hf.Tokens(12),
                                   optimizers=(opt, None))
    return trainer.train()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["chunked", "overlap"])
def test_trainer_with_offload_optimizer_matches_adamw(mode: str, tmp_path: Path) -> None:
    ref = tiny_llama()
    model = copy.deepcopy(ref)
    init = [p.detach().clone() for p in ref.parameters()]
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    opt = OffloadOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01),
                           mode=mode, chunk_bytes=8192)  # type: ignore[arg-type]
    assert len(opt.plan.chunks) > 1
    want = train(ref, ref_opt, tmp_path / "ref")
    got = train(model, opt, tmp_path / "offload")
    assert want.global_step == got.global_step == 3
    assert want.training_loss == got.training_loss
    # No wait_for_step() here: reading the weights waits for a step in flight.
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(p, q), name
    assert not any(torch.equal(a, p) for a, p in zip(init, model.parameters()))
    assert opt.last_execution is not None  # the Trainer stepped through the chunks
    want_sd, got_sd = ref_opt.state_dict(), opt.state_dict()
    assert [float(e["step"]) for e in got_sd["state"].values()] == [3.0] * len(init)
    assert want_sd["param_groups"] == got_sd["param_groups"]
    for i, entry in want_sd["state"].items():
        for k, v in entry.items():
            assert torch.equal(v, got_sd["state"][i][k]), (i, k)
