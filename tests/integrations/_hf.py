"""A tiny transformers causal LM built from a config (no download) and its data, for
the Trainer tests."""

from __future__ import annotations

from typing import Any

import torch

SEED = 1234


def tiny_llama(**config: Any) -> Any:
    """A 2-layer Llama; ``config`` overrides (``initializer_range``...)."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, **config)
    torch.manual_seed(SEED)
    return transformers.LlamaForCausalLM(cfg)


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Fixed random sequences; labels are the inputs (the model shifts them)."""

    def __init__(self, n: int, length: int = 16) -> None:
        g = torch.Generator().manual_seed(7)
        self.ids = torch.randint(0, 64, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}
