"""Per-sync figures for loggers (issue 24): LocalSGD's and DiLoCo's ``last_sync_stats`` and
their hooks, matching the sync's trace, and their spans on a recorded trace's train row."""

from __future__ import annotations

from typing import Any

from torch import optim

import pipeoff.ft
import pipeoff.trace
from pipeoff.trace import StepStats
from pipeoff.trace._records import train_step
from tests.ft._diloco_replicas import make_model
from tests.ft.test_diloco import _committing_manager, _inner_step


def test_diloco_sync_stats_match_its_trace_and_reach_a_hook() -> None:
    model = make_model(0)
    inner = optim.SGD(model.parameters(), lr=0.1)
    got: list[StepStats] = []
    d = pipeoff.ft.DiLoCo(_committing_manager(), [model], inner,
                          optim.SGD(model.parameters(), lr=0.7), 2, offload_to_cpu=True,
                          bucket_bytes=256, device_budget_bytes=512)
    d.register_sync_stats_hook(got.append)
    with pipeoff.trace.record() as rec, d:
        for _ in range(4):
            _inner_step(model, inner)
    assert [s.step for s in got] == [0, 1]  # torchft's step (a plain inner optimizer)
    last = d.last_sync_stats
    assert last == got[-1] and last.what == "sync" and last.committed is True
    trace = d.last_trace
    assert last.d2h_bytes == sum(t.nbytes for t in trace.tasks if t.kind == "d2h") > 0
    assert last.h2d_bytes == sum(t.nbytes for t in trace.tasks if t.kind == "h2d") > 0
    assert last.chunks == sum(t.kind == "allreduce" for t in trace.tasks)
    spans = {train_step(t) for t in rec.trace.tasks if t.kind == "train"}
    assert ("sync", 0) in spans and ("sync", 1) in spans


def test_local_sgd_sync_stats_on_both_paths() -> None:
    for kwargs in ({}, {"offload_averaged_parameters_to_cpu": True, "bucket_bytes": 256}):
        model = make_model(0)
        inner = optim.SGD(model.parameters(), lr=0.1)
        manager = _committing_manager()
        got: list[Any] = []
        with pipeoff.ft.LocalSGD(manager, model, inner, 1, **kwargs) as local_sgd:
            local_sgd.register_sync_stats_hook(got.append)
            for _ in range(2):
                _inner_step(model, inner)
        assert len(got) == 2 and all(s.committed for s in got)
        assert local_sgd.last_sync_stats == got[-1]
        if kwargs:
            assert got[-1].d2h_bytes == sum(
                t.nbytes for t in local_sgd.last_trace.tasks if t.kind == "d2h") > 0
        else:
            assert got[-1].d2h_bytes == 0 and got[-1].exposed_ms > 0


def test_the_local_sgd_plot_has_its_syncs_on_the_train_row() -> None:
    import pytest

    pytest.importorskip("matplotlib")
    from pipeoff.trace._plot import figure

    model = make_model(0)
    inner = optim.AdamW(model.parameters(), lr=1e-3)
    with pipeoff.ft.LocalSGD(_committing_manager(), model, inner, 2,
                             offload_averaged_parameters_to_cpu=True, bucket_bytes=256,
                             device_budget_bytes=512), pipeoff.trace.record() as rec:
        for _ in range(4):
            _inner_step(model, inner)
    trace = rec.trace
    assert sorted(train_step(t) for t in trace.tasks if t.kind == "train") == [
        ("sync", 0), ("sync", 1)]  # a plain inner optimizer: torchft's step numbers
    ax = figure(trace).axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels[0] == "train" and {"comm", "d2h", "h2d"} <= set(labels)
    legend = {t.get_text() for t in ax.get_legend().get_texts()}
    assert {"train: sync", "all-reduce", "device to host copy"} <= legend
    first = min(t.start_ns for t in trace.tasks) / 1e6
    assert ax.get_xlim()[0] == pytest.approx(first)  # the axis from the first event
