"""Glue for the trainers people run pipeoff's optimizers in; each module imports its
trainer lazily (``pipeoff.integrations.hf``: the HF transformers ``Trainer``;
``pipeoff.integrations.torchtitan``: torchtitan's ``OptimizersContainer``)."""

__all__: list[str] = []
