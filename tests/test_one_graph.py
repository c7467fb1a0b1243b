"""A real run and the simulator build the same graph: the features' own builders
run shape-only for the simulator, so the tasks, kinds, bytes, buffers and
dependencies of a real step's trace and of the simulated one are equal."""

from __future__ import annotations

import torch
from torch import nn

import pipeoff
from pipeoff.optim import OffloadOptimizer
from pipeoff.sim._workloads import ModelShape, optimizer_graph, optimizer_schedule
from pipeoff.trace import Trace


def shape_of(model: nn.Module) -> ModelShape:
    return ModelShape(name="test", fsdp=1, global_shapes=tuple(
        (n, tuple(p.shape)) for n, p in model.named_parameters()))


def structure(trace: Trace) -> tuple[dict[str, tuple[object, ...]], dict[str, tuple[object, ...]]]:
    tasks = {t.name: (t.kind, t.nbytes, tuple(sorted(t.deps)), t.buffers) for t in trace.tasks}
    buffers = {b.name: (b.nbytes, b.where) for b in trace.buffers}
    return tasks, buffers


def test_the_optimizer_step_simulated_is_the_step_that_runs() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.Linear(64, 5))
    opt = OffloadOptimizer(torch.optim.AdamW(model.parameters()), mode="chunked",
                           chunk_bytes=4096, prefetch=2)
    for _ in range(2):  # the second step: every parameter has its state
        model(torch.randn(8, 32)).sum().backward()
        opt.step()
        opt.zero_grad()
    real = opt.last_trace
    assert real is not None
    shape = shape_of(model)
    graph = optimizer_graph(shape, chunk_bytes=4096)
    sched = optimizer_schedule(shape, chunk_bytes=4096, prefetch=2)
    simulated = pipeoff.execute(graph, sched, backend="sim").trace
    assert structure(real) == structure(simulated)
    assert real.device_budget_bytes == simulated.device_budget_bytes
    assert len(real.tasks) > 9


def test_the_full_offload_step_simulated_is_the_step_that_runs() -> None:
    from pipeoff.optim import FullOffloadOptimizer
    from pipeoff.sim._workloads import full_offload_graph, full_offload_schedule

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64),
                          nn.Linear(64, 5)).to(torch.bfloat16)
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, overlap="backward",
                               chunk_numel=4096, slot_bytes=2048, slots=2)
    for _ in range(2):
        model(torch.randn(8, 32).to(torch.bfloat16)).float().sum().backward()
        opt.step()
        opt.zero_grad()
    real = opt.last_trace
    assert real is not None
    shape = shape_of(model)
    graph = full_offload_graph(shape, chunk_numel=4096, slot_bytes=2048)
    sched = full_offload_schedule(shape, pipelined=True, chunk_numel=4096, slot_bytes=2048,
                                  slots=2)
    simulated = pipeoff.execute(graph, sched, backend="sim").trace
    # Gate records carry the payload's bytes when a gate really opens; the
    # simulator opens them empty at launch.
    def tasks(trace: Trace) -> tuple[object, object]:
        t, b = structure(trace)
        return {k: v for k, v in t.items() if v[0] != "gate"}, b

    assert tasks(real) == tasks(simulated)
    assert real.host_budget_bytes == simulated.host_budget_bytes == opt.host_budget_bytes
    assert len({t.name for t in real.tasks if t.name.startswith("d2h:")}) > len(shape.global_shapes)


def test_the_transfer_simulated_is_the_transfer_that_runs() -> None:
    from pipeoff.sim._workloads import transfer_graph_shape
    from pipeoff.transfer import LiveTensor, StateTransfer

    shapes = (("a", (7, 5)), ("b", (3,)), ("c", (40, 9)))
    shape = ModelShape(name="test", fsdp=1, global_shapes=shapes)
    srcs = {n: LiveTensor(torch.randn(s)) for n, s in shapes}
    dsts = {n: LiveTensor(torch.zeros(s, dtype=torch.bfloat16), residency="device")
            for n, s in shapes}
    t = StateTransfer(srcs, dsts, host_budget_bytes=256, device_budget_bytes=256, wire="device",
                      cast={"*": torch.bfloat16})
    t.run()
    real = t.last_trace
    assert real is not None
    sim = pipeoff.execute(transfer_graph_shape(shape, budget_bytes=256),
                          pipeoff.Schedule.pipelined(device_budget_bytes=256,
                                                     host_budget_bytes=256),
                          backend="sim").trace
    assert structure(real) == structure(sim)
