"""pipeoff's optimizers in Hugging Face's ``transformers.Trainer``.

A small Llama built from a config (nothing is downloaded) trains on a tiny
in-memory dataset with 4 gradient-accumulation micro-batches per step and
``max_grad_norm=1.0`` and ``weight_decay=0.01``, three times from the same
initial weights. Each time the Trainer builds the optimizer itself, with its
decay / no-decay param groups:

* its default (``adamw_torch_fused``: ``torch.optim.AdamW``), the reference;
* ``pipeoff.optim.OffloadOptimizer``: the AdamW state in host memory, stepped in
  chunks overlapped with the next forward;
* ``pipeoff.optim.FullOffloadOptimizer``: FP32 masters, AdamW state and the
  gradient sum in host memory; ``param.grad`` holds placeholders for the host
  sums, so the Trainer's own clipping and its logged ``grad_norm`` work as they
  are.

Both pipeoff classes go in through ``optimizer_cls_and_kwargs=(cls, kwargs)``,
the Trainer's documented way to name an optimizer class: it calls
``cls(grouped_params, **kwargs)``, with ``kwargs`` holding ``optimizer_class``.

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


def train(model: torch.nn.Module, steps: int,
          pipeoff_class: type | None = None, **options: Any) -> list[dict[str, float]]:
    """Train with the Trainer's own optimizer construction; with ``pipeoff_class``, that
    class (and ``options``) wrapping the Trainer's default optimizer class."""
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=4,
            max_grad_norm=1.0, max_steps=steps, learning_rate=1e-2, weight_decay=0.01,
            lr_scheduler_type="linear", use_cpu=True, report_to=[], save_strategy="no",
            logging_steps=1, seed=SEED, dataloader_num_workers=0, disable_tqdm=True)
        cls_and_kwargs = None
        if pipeoff_class is not None:
            # The class and keywords the Trainer would use (AdamW, lr, betas, eps, fused).
            optimizer_class, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
            cls_and_kwargs = (pipeoff_class,
                              {"optimizer_class": optimizer_class, **kwargs, **options})
        logs = KeepLogs()
        trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[logs],
                          optimizer_cls_and_kwargs=cls_and_kwargs)
        trainer.remove_callback(transformers.PrinterCallback)  # we print our own table
        trainer.train()
        opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # (accelerate's wrapper)
        getattr(opt, "wait_for_step", lambda: None)()  # the last step may still run
    return logs.steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()

    reference = tiny_llama()
    runs: dict[str, tuple[torch.nn.Module, list[dict[str, float]]]] = {}

    model: torch.nn.Module = copy.deepcopy(reference)
    runs["AdamW"] = model, train(model, args.steps)

    model = copy.deepcopy(reference)
    # On a GPU, the AdamW state lives in pinned host memory.
    runs["OffloadOptimizer"] = model, train(model, args.steps, OffloadOptimizer,
                                            overlap="forward", chunk_bytes=16384)

    model = copy.deepcopy(reference)
    # overlap="forward" (the default): the host step runs under the next forward. The
    # Trainer's gradient_accumulation_steps (4) tells it which backward is a step's last,
    # as it begins (the Trainer marks none on one process).
    runs["FullOffloadOptimizer"] = model, train(model, args.steps, FullOffloadOptimizer,
                                                chunk_numel=4096, gradient_accumulation_steps=4)

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
