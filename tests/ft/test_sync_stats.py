"""Per-sync figures for loggers (issue 24): LocalSGD's and DiLoCo's ``last_sync_stats`` and
their hooks, matching the sync's trace, and their spans on a recorded trace's train row."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn, optim

import pipeoff.ft
import pipeoff.trace
from pipeoff.optim import FullOffloadOptimizer
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
    for kwargs in ({}, {"offload_to_cpu": True, "bucket_bytes": 256}):
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
                             offload_to_cpu=True, bucket_bytes=256,
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


class _LoggerDown(Exception):
    pass


def _raise_once(fired: list[int]) -> Any:
    def hook(stats: StepStats) -> None:
        fired.append(stats.step)
        if len(fired) == 1:
            raise _LoggerDown

    return hook


@pytest.mark.parametrize("offload", [False, True], ids=["torchft_path", "offloaded"])
def test_a_local_sgd_sync_hook_that_raises_leaves_the_schedule_alone(offload: bool) -> None:
    """The hook runs after torchft reset its step counter: a logger that raises once
    reaches the caller, and the syncs still come every sync_every steps."""
    kwargs = {"offload_to_cpu": True, "bucket_bytes": 256} if offload else {}
    model = make_model(0)
    inner = optim.SGD(model.parameters(), lr=0.1)
    manager = _committing_manager()
    synced_after: list[int] = []
    raised: list[int] = []
    with pipeoff.ft.LocalSGD(manager, model, inner, 4, **kwargs) as local_sgd:
        fired: list[int] = []
        hook = _raise_once(fired)
        local_sgd.register_sync_stats_hook(lambda s: (synced_after.append(i), hook(s)))
        for i in range(12):
            try:
                _inner_step(model, inner)
            except _LoggerDown:
                raised.append(i)
    assert raised == [3] and synced_after == [3, 7, 11]
    assert manager.should_commit.call_count == 3


@pytest.mark.parametrize("offload", [False, True], ids=["torchft_path", "offloaded"])
def test_a_diloco_sync_hook_that_raises_still_refreshes_full_offload_masters(
        offload: bool) -> None:
    """Over FullOffloadOptimizer the hook runs after the masters are refreshed from
    the synchronized parameters: a raising logger changes no weight."""

    def run(raise_once: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
        inner = FullOffloadOptimizer(model, optim.SGD, lr=0.1)
        outer = optim.SGD(model.parameters(), lr=0.7)
        fired: list[int] = []
        with pipeoff.ft.DiLoCo(_committing_manager(), [model], inner, outer, 2,
                               offload_to_cpu=offload) as diloco:
            diloco.register_sync_stats_hook(
                _raise_once(fired) if raise_once else lambda s: fired.append(s.step))
            for i in range(3):
                model(torch.randn(4, 16, generator=torch.Generator().manual_seed(i))
                      ).pow(2).mean().backward()
                try:
                    inner.step()
                except _LoggerDown:
                    assert raise_once and i == 1
                inner.zero_grad()
            inner.wait_for_step()
        assert fired == [1]
        return [p.detach().clone() for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(run(False), run(True)))
