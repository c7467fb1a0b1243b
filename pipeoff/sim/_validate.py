"""Real CPU graphs with known shapes, to check the simulator against the threads backend."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pipeoff.graph import TaskContext, TaskGraph, TaskKind
from pipeoff.schedule import Schedule

__all__ = ["ValidationCase", "validation_cases"]


@dataclass(frozen=True, kw_only=True)
class ValidationCase:
    name: str
    build: Callable[[], TaskGraph]
    schedule: Schedule
    backend: str


def _offload_graph(chunks: int, numel: int, *, compute: bool = True) -> Callable[[], TaskGraph]:
    """Per chunk: copy state in, update it (``m.mul_(0.9).add_(g)``), copy it out."""
    host = [torch.randn(numel) for _ in range(chunks)]
    grads = [torch.randn(numel) for _ in range(chunks)]

    def build() -> TaskGraph:
        g = TaskGraph()
        for k in range(chunks):
            b = g.add_buffer(f"state{k}", numel * 4)

            def h2d(ctx: TaskContext, k: int = k) -> None:
                ctx.buffer(f"state{k}", torch.float32).copy_(host[k])

            def update(ctx: TaskContext, k: int = k) -> None:
                ctx.buffer(f"state{k}", torch.float32).mul_(0.9).add_(grads[k])

            def d2h(ctx: TaskContext, k: int = k) -> None:
                host[k].copy_(ctx.buffer(f"state{k}", torch.float32))

            g.add_task(f"h2d:{k}", TaskKind.H2D, h2d, buffers=[b], nbytes=numel * 4)
            prev = f"h2d:{k}"
            if compute:
                g.add_task(f"update:{k}", TaskKind.OPTIMIZER_CHUNK, update, deps=[prev],
                           buffers=[b], nbytes=numel * 4)
                prev = f"update:{k}"
            g.add_task(f"d2h:{k}", TaskKind.D2H, d2h, deps=[prev], buffers=[b],
                       nbytes=numel * 4)
        return g

    return build


def validation_cases(numel: int = 1 << 23, chunks: int = 6) -> list[ValidationCase]:
    """A sequential chain, a copy-only pipeline, and a double-buffered offload step."""
    chunk_bytes = numel * 4
    return [
        ValidationCase(name="offload step, synchronous", build=_offload_graph(chunks, numel),
                       schedule=Schedule.synchronous(), backend="inline"),
        ValidationCase(name="copies in and out, pipelined",
                       build=_offload_graph(chunks, numel, compute=False),
                       schedule=Schedule.pipelined(device_budget_bytes=2 * chunk_bytes),
                       backend="threads"),
        ValidationCase(name="offload step, pipelined 2 chunks",
                       build=_offload_graph(chunks, numel),
                       schedule=Schedule.pipelined(device_budget_bytes=2 * chunk_bytes),
                       backend="threads"),
    ]
