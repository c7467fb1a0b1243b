"""pipeoff's optimizers in Hugging Face's ``transformers.Trainer``.

A small Llama built from a config (nothing is downloaded) trains on a tiny
in-memory dataset with 4 gradient-accumulation micro-batches per step and
``max_grad_norm=1.0``, three times from the same initial weights:

* ``torch.optim.AdamW``, the reference;
* ``pipeoff.optim.OffloadOptimizer``: the AdamW state in host memory, stepped in
  chunks; the Trainer is used unmodified;
* ``pipeoff.optim.FullOffloadOptimizer``: FP32 masters, AdamW state and the
  gradient sum in host memory. The gradients never stay in ``param.grad``, so
  ``pipeoff.integrations.hf.prepare_trainer(trainer)`` routes the Trainer's
  clipping (and its logged ``grad_norm``) to the optimizer.

It prints the logged loss and ``grad_norm`` of every step and whether the final
weights are bitwise those of AdamW (the model is FP32 and has no dropout, so
they are; with dropout, compare runs with it off or with the same seed).

    python examples/hf_trainer.py --steps 4
"""

from __future__ import annotations

import argparse
import copy
import tempfile
from typing import Any

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from pipeoff.integrations.hf import prepare_trainer
from pipeoff.optim import FullOffloadOptimizer, OffloadOptimizer

SEED = 0
VOCAB = 64


def tiny_llama() -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, initializer_range=0.1)
    torch.manual_seed(SEED)
    return LlamaForCausalLM(config)  # FP32; .to(torch.bfloat16) for BF16 weights


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Fixed random token sequences; the labels are the inputs (the model shifts them)."""

    def __init__(self, n: int = 64, length: int = 16) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, VOCAB, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


class KeepLogs(transformers.TrainerCallback):
    """Keeps the Trainer's per-step logs (loss, grad_norm, learning_rate)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None,
               **kwargs: Any) -> None:
        if logs and "grad_norm" in logs:
            self.steps.append(dict(logs))


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int,
          full_offload: bool) -> list[dict[str, float]]:
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=4,
            max_grad_norm=1.0, max_steps=steps, learning_rate=1e-2,
            lr_scheduler_type="linear", use_cpu=True, report_to=[], save_strategy="no",
            logging_steps=1, seed=SEED, dataloader_num_workers=0, disable_tqdm=True)
        logs = KeepLogs()
        trainer = Trainer(model=model, args=args, train_dataset=Tokens(),
                          optimizers=(optimizer, None), callbacks=[logs])
        trainer.remove_callback(transformers.PrinterCallback)  # we print our own table
        if full_offload:
            prepare_trainer(trainer)  # clip with (and log the norm of) the host gradients
        trainer.train()
    return logs.steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()

    reference = tiny_llama()
    runs: dict[str, tuple[torch.nn.Module, list[dict[str, float]]]] = {}

    model: torch.nn.Module = copy.deepcopy(reference)
    plain = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    runs["AdamW"] = model, train(model, plain, args.steps, full_offload=False)

    model = copy.deepcopy(reference)
    # On a GPU, model.cuda() first: the AdamW state then lives in pinned host memory.
    offload = OffloadOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2,
                                                 weight_decay=0.01),
                               mode="overlap", chunk_bytes=16384)
    runs["OffloadOptimizer"] = model, train(model, offload, args.steps, full_offload=False)

    model = copy.deepcopy(reference)
    full = FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.01,
                                chunk_numel=4096)  # overlap="forward", the default
    full.attach()  # each module's forward waits only for its own weights
    runs["FullOffloadOptimizer"] = model, train(model, full, args.steps, full_offload=True)
    full.wait_for_step()  # the last step runs in the background; wait before reading

    for name, (_, steps) in runs.items():
        print(name)
        for k, log in enumerate(steps, 1):
            print(f"  step {k}  loss {log['loss']:.6f}  grad_norm {log['grad_norm']:.6f}  "
                  f"lr {log['learning_rate']:.4g}")
    ref_model, ref_steps = runs["AdamW"]
    for name, (trained, steps) in runs.items():
        if name == "AdamW":
            continue
        same_weights = all(torch.equal(p, q) for p, q in
                           zip(ref_model.parameters(), trained.parameters(), strict=True))
        same_logs = [(s["loss"], s["grad_norm"]) for s in steps] == [
            (s["loss"], s["grad_norm"]) for s in ref_steps]
        print(f"{name}: weights bitwise equal to AdamW's: {same_weights}; "
              f"logged loss and grad_norm equal: {same_logs}")


if __name__ == "__main__":
    main()
