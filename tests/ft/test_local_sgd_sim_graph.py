"""A real LocalSGD sync and the simulator build the same graph (LocalSGD's own
builder, run shape-only for the simulator)."""

from __future__ import annotations

import pipeoff
from pipeoff.sim._workloads import ModelShape, local_sgd_graph
from pipeoff.trace import Trace
from tests.ft._replicas import make_model, run_replicas


def structure(trace: Trace) -> tuple[dict[str, tuple[object, ...]], dict[str, tuple[object, ...]]]:
    tasks = {t.name: (t.kind, t.nbytes, tuple(sorted(t.deps)), t.buffers) for t in trace.tasks}
    buffers = {b.name: (b.nbytes, b.where) for b in trace.buffers}
    return tasks, buffers


def test_a_sync_simulated_is_the_sync_that_runs() -> None:
    runs = run_replicas({"offload_to_cpu": True, "bucket_bytes": 512,
                         "device_budget_bytes": 1024}, syncs=1)
    real = runs[0].traces[0]
    model = make_model(0)
    shape = ModelShape(name="test", fsdp=1, global_shapes=tuple(
        (n, tuple(p.shape)) for n, p in model.named_parameters()))
    simulated = pipeoff.execute(local_sgd_graph(shape, variant="pipelined", bucket_bytes=512),
                                pipeoff.Schedule.pipelined(device_budget_bytes=1024),
                                backend="sim").trace
    assert structure(real) == structure(simulated)
    assert len(real.tasks) > 10
