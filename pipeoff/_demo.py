"""``pipeoff demo``: the same offload graph run synchronously and pipelined, side by side."""

from __future__ import annotations

import time
from pathlib import Path

import torch

import pipeoff
from pipeoff import Schedule, TaskGraph, TaskKind


def build_offload_graph(
    host_state: list[torch.Tensor], grads: list[torch.Tensor], chunk_budget: int
) -> TaskGraph:
    """An offloaded momentum-SGD step: per chunk, H2D the state, update it, D2H it back."""
    g = TaskGraph()
    for k, (state, grad) in enumerate(zip(host_state, grads)):
        nbytes = state.numel() * state.element_size()
        buf = g.add_buffer(f"state{k}", nbytes, where="device")

        def h2d(ctx: pipeoff.TaskContext, state: torch.Tensor = state, buf: str = buf) -> None:
            ctx.buffer(buf, state.dtype).copy_(state)

        def update(ctx: pipeoff.TaskContext, grad: torch.Tensor = grad, buf: str = buf) -> None:
            m = ctx.buffer(buf, grad.dtype)
            m.mul_(0.9).add_(grad)
            torch.tanh(m)  # stand-in for more optimizer math

        def d2h(ctx: pipeoff.TaskContext, state: torch.Tensor = state, buf: str = buf) -> None:
            state.copy_(ctx.buffer(buf, state.dtype))

        g.add_task(f"h2d:{k}", TaskKind.H2D, h2d, buffers=[buf], nbytes=nbytes)
        g.add_task(f"update:{k}", TaskKind.OPTIMIZER_CHUNK, update, deps=[f"h2d:{k}"],
                   buffers=[buf], nbytes=nbytes)
        g.add_task(f"d2h:{k}", TaskKind.D2H, d2h, deps=[f"update:{k}"], buffers=[buf],
                   nbytes=nbytes)
    return g


def run_demo(out: Path, quick: bool = False) -> int:
    torch.manual_seed(0)
    chunks, numel = (6, 1 << 18) if quick else (16, 1 << 21)
    host_state = [torch.zeros(numel) for _ in range(chunks)]
    grads = [torch.randn(numel) for _ in range(chunks)]
    chunk_bytes = numel * 4
    budget = 3 * chunk_bytes
    print(f"pipeoff demo: {chunks} chunks of {chunk_bytes / 2**20:.1f} MiB optimizer state, "
          f"device staging budget {budget / 2**20:.1f} MiB")
    results = {}
    for label, sched in (
        ("synchronous", Schedule.synchronous()),
        ("pipelined", Schedule.pipelined(device_budget_bytes=budget)),
    ):
        g = build_offload_graph(host_state, grads, budget)
        t0 = time.perf_counter()
        ex = pipeoff.execute(g, sched)
        ex.wait()
        results[label] = (time.perf_counter() - t0, ex.trace)
        print(f"  {label:<12} {results[label][0] * 1e3:8.1f} ms")
    out.mkdir(parents=True, exist_ok=True)
    path = results["pipelined"][1].save(out / "trace.json")
    ratio = results["pipelined"][0] / results["synchronous"][0]
    print(f"pipelined / synchronous wall time: {ratio:.2f}x")
    print(f"\ntrace written to {path}; summary:\n")
    print(pipeoff.Trace.load(path).summary().format())
    return 0
