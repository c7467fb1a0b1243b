"""pipeoff.ft.LocalSGD: real 2-replica averaging, quorum rejection, failures, budgets."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import warnings
from typing import Any
from unittest.mock import MagicMock, create_autospec

import pytest
import torch
import torch.distributed as dist
from torch import nn, optim
from torchft.manager import Manager
from torchft.work import _DummyWork

import pipeoff
import pipeoff.ft
import pipeoff.testing
from tests.ft._replicas import ReplicaRun, make_model, run_replicas

OFF = {"offload_to_cpu": True}
# The model has 16*32+32 + 32*8+8 + 8*3+3 = 835 float32 parameters (3340 bytes).
PIPELINED: dict[str, dict[str, Any]] = {
    "per_parameter": {**OFF, "bucket_bytes": "per_parameter", "device_budget_bytes": 1024},
    "small_split": {**OFF, "bucket_bytes": 100, "device_budget_bytes": 200},
    "packed": {**OFF, "bucket_bytes": 1200, "device_budget_bytes": 2400},
    "one_bucket": {**OFF, "bucket_bytes": 4096, "device_budget_bytes": 4096},
}
MODES: dict[str, dict[str, Any]] = {"sync": {**OFF, "schedule": "synchronous"}, **PIPELINED}


def _assert_pools_idle() -> None:
    pools = pipeoff.pools_for("cpu")
    assert pools.device.stats().live_bytes == 0
    assert pools.host.stats().live_bytes == 0


def _assert_trace_budget(local_sgd: pipeoff.ft.LocalSGD) -> None:
    budget = local_sgd.device_budget_bytes
    if budget is not None:
        assert local_sgd.last_trace.summary().peak_device_staging_bytes <= budget


def _assert_budget(runs: list[ReplicaRun], kwargs: dict[str, Any]) -> None:
    budget = kwargs.get("device_budget_bytes")
    for run in runs:
        for trace in run.traces:
            summary = trace.summary()
            assert summary.failed == 0 and summary.cancelled == 0
            if budget is not None:
                assert summary.peak_device_staging_bytes <= budget


@pytest.fixture(scope="module")
def original() -> list[ReplicaRun]:
    """torchft's original path: the reference every mode must match bit for bit."""
    runs = run_replicas({}, syncs=2)
    for run in runs:
        assert run.traces == [None, None]  # the original path builds no graph
    return runs


def _assert_matches(runs: list[ReplicaRun], reference: list[ReplicaRun]) -> None:
    for sync in range(len(reference[0].params_after_sync)):
        ref = reference[0].params_after_sync[sync]
        for run in runs:
            for got, want in zip(run.params_after_sync[sync], ref, strict=True):
                assert torch.equal(got, want), f"sync {sync}"
    # 2 replicas: the mean is exact, (a + b) / 2, on both.
    for a, b, avg in zip(reference[0].params_before_sync[0], reference[1].params_before_sync[0],
                         reference[0].params_after_sync[0], strict=True):
        assert torch.equal((a + b) / 2, avg)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", list(MODES))
def test_two_replicas_bitwise_equal_to_original(mode: str, original: list[ReplicaRun]) -> None:
    runs = run_replicas(MODES[mode], syncs=2)
    assert [r.steps for r in runs] == [2, 2]
    _assert_matches(runs, original)
    _assert_budget(runs, MODES[mode])
    assert not any(r.errors_reported for r in runs)
    _assert_pools_idle()
    trace = runs[0].traces[-1]
    lanes = {t.lane.split("#")[0] for t in trace.tasks}
    assert lanes == ({"main"} if mode == "sync" else {"comm", "d2h", "host", "h2d"})


@pytest.mark.timeout(120)
@pytest.mark.parametrize("lane", ["comm", "d2h", "h2d"])
def test_delayed_lane_still_bitwise(lane: str, original: list[ReplicaRun]) -> None:
    # Slot k > 0 suffixes lane names with "#k" (two replicas share this process).
    with contextlib.ExitStack() as stack:
        for name in (lane, f"{lane}#1"):
            stack.enter_context(pipeoff.testing.delay_lane(name, 0.004))
        runs = run_replicas(PIPELINED["small_split"], syncs=2)
    _assert_matches(runs, original)
    _assert_budget(runs, PIPELINED["small_split"])
    _assert_pools_idle()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["sync", "small_split"])
def test_failure_mid_pipeline_keeps_model_and_next_sync_works(mode: str) -> None:
    with contextlib.ExitStack() as stack:
        # Both replicas fail before issuing bucket 1's all-reduce (the hook is
        # process-wide), so neither waits on a collective the other never joins.
        target = "allreduce:b1"
        stack.enter_context(pipeoff.testing.fail_task(target, lambda: RuntimeError("injected")))
        runs = run_replicas(MODES[mode], syncs=2, barrier=threading.Barrier(2, action=stack.close))
    for run in runs:
        # Sync 0 failed: reported to the manager, nothing written back.
        assert [str(e) for e in run.errors_reported] == ["injected"]
        for got, local in zip(run.params_after_sync[0], run.params_before_sync[0], strict=True):
            assert torch.equal(got, local)
        summary = run.traces[0].summary()
        assert summary.failed == 1 and summary.cancelled > 0
        assert run.steps == 1  # sync 0 did not commit, sync 1 did
    # Sync 1 succeeded: the exact mean of both replicas' local values.
    for a, b, got0, got1 in zip(runs[0].params_before_sync[1], runs[1].params_before_sync[1],
                                runs[0].params_after_sync[1], runs[1].params_after_sync[1],
                                strict=True):
        assert torch.equal(got0, (a + b) / 2) and torch.equal(got1, got0)
    _assert_pools_idle()


# -- unit edges with torchft's autospec'd Manager ---------------------------------------
def _mock_manager(*, commit: bool) -> Any:
    manager = create_autospec(Manager)
    manager.errored.return_value = None
    manager.should_commit.return_value = commit
    manager.allreduce.side_effect = lambda t, should_quantize=False: _DummyWork(t)
    # After a failure, a sync joins its remaining collectives on the process group.
    manager._pg = MagicMock(spec=dist.ProcessGroup)
    manager._pg.allreduce.side_effect = lambda ts, opts: _DummyWork(ts[0])
    return manager


def _step(model: nn.Module, opt: optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.randn(4, 16)).pow(2).mean().backward()
    opt.step()


@pytest.mark.parametrize("mode", list(MODES))
def test_quorum_reject_writes_nothing(mode: str) -> None:
    manager = _mock_manager(commit=False)
    model = make_model(0)
    opt = optim.SGD(model.parameters(), lr=0.1)
    with pipeoff.ft.LocalSGD(manager, model, opt, 2, **MODES[mode]) as local_sgd:
        _step(model, opt)
        # Make the "average" differ from the local values, so a write-back would show.
        manager.allreduce.side_effect = lambda t, should_quantize=False: _DummyWork(t.add_(1.0))
        local = [p.detach().clone() for p in model.parameters()]
        local_sgd.sync()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), local, strict=True))
    assert manager.start_quorum.call_count == 1 and manager.should_commit.call_count == 1
    assert local_sgd._local_step == 0
    manager.report_error.assert_not_called()
    _assert_pools_idle()
    assert local_sgd.last_trace is not None and local_sgd.last_trace.summary().failed == 0
    _assert_trace_budget(local_sgd)


@pytest.mark.parametrize("mode", list(MODES))
def test_commit_writes_average(mode: str) -> None:
    manager = _mock_manager(commit=True)
    # A stand-in "average" that changes every element: the write-back must land it.
    manager.allreduce.side_effect = lambda t, should_quantize=False: _DummyWork(t.mul_(0.5))
    model = make_model(0)
    local_sgd = pipeoff.ft.LocalSGD(manager, model, optim.SGD(model.parameters(), lr=0.1), 1,
                                    **MODES[mode])
    local = [p.detach().clone() for p in model.parameters()]
    local_sgd.sync()
    assert all(torch.equal(p, q * 0.5) for p, q in zip(model.parameters(), local, strict=True))
    _assert_pools_idle()
    _assert_trace_budget(local_sgd)


@pytest.mark.parametrize("mode", ["sync", "small_split", "packed"])
@pytest.mark.parametrize("where", ["allreduce:b1", "d2h:b2"])
def test_task_failure_reports_error_and_writes_nothing(mode: str, where: str) -> None:
    manager = _mock_manager(commit=True)
    manager.allreduce.side_effect = lambda t, should_quantize=False: _DummyWork(t.add_(1.0))
    model = make_model(0)
    opt = optim.SGD(model.parameters(), lr=0.1)
    local_sgd = pipeoff.ft.LocalSGD(manager, model, opt, 5, **MODES[mode])
    local = [p.detach().clone() for p in model.parameters()]
    err = RuntimeError("boom")
    with pipeoff.testing.fail_task(where, err):
        local_sgd.sync()
    manager.report_error.assert_called_once_with(err)
    assert manager.should_commit.call_count == 1
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), local, strict=True))
    _assert_pools_idle()
    summary = local_sgd.last_trace.summary()
    assert summary.failed == 1
    # Every bucket's collective after the failure is still joined (peers would wait
    # for it), on the process group: the manager's allreduce is a no-op after an error;
    # b1's too when its own start failed (a must_run task's work runs anyway).
    buckets = sum(1 for t in local_sgd.last_trace.tasks if t.kind == "allreduce")
    joined = manager.allreduce.call_count + manager._pg.allreduce.call_count
    assert joined == buckets + 1  # and the sync's vote, before should_commit()
    _assert_trace_budget(local_sgd)
    # The next sync works (here the mock "average" adds 1 to every element).
    local_sgd.sync()
    assert manager.should_commit.call_count == 2
    assert all(torch.equal(p, q + 1) for p, q in zip(model.parameters(), local, strict=True))
    _assert_pools_idle()


@pytest.mark.parametrize("mode", ["small_split", "packed"])
def test_a_write_back_failure_after_commit_is_reported_and_raised(mode: str) -> None:
    manager = _mock_manager(commit=True)
    model = make_model(0)
    local_sgd = pipeoff.ft.LocalSGD(manager, model, optim.SGD(model.parameters(), lr=0.1), 1,
                                    **MODES[mode])
    err = RuntimeError("device gone")
    with pipeoff.testing.fail_task("h2d:b1", err), pytest.raises(RuntimeError) as info:
        local_sgd.sync()
    assert info.value is err
    assert any("partly averaged" in n for n in err.__notes__)
    manager.report_error.assert_called_once_with(err)  # the next should_commit() is False
    _assert_pools_idle()


def test_per_parameter_without_a_budget_stages_one_parameter_at_a_time() -> None:
    """The RFC's bound, M, not S: with the copy lane slow, S would pile up."""
    manager = _mock_manager(commit=True)
    model = make_model(0)
    local_sgd = pipeoff.ft.LocalSGD(manager, model, optim.SGD(model.parameters(), lr=0.1), 1,
                                    **OFF, bucket_bytes="per_parameter")
    with pipeoff.testing.delay_lane("d2h", 0.01):
        local_sgd.sync()
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    assert local_sgd.last_trace.summary().peak_device_staging_bytes == largest


def test_a_budget_alone_sets_buckets_of_half_of_it() -> None:
    manager = _mock_manager(commit=True)
    model = make_model(0)
    local_sgd = pipeoff.ft.LocalSGD(manager, model, optim.SGD(model.parameters(), lr=0.1), 1,
                                    **OFF, device_budget_bytes=1024)
    assert (local_sgd.bucket_bytes, local_sgd.device_budget_bytes) == (512, 1024)
    local_sgd.sync()
    assert max(c.args[0].numel() * 4 for c in manager.allreduce.call_args_list) == 512
    _assert_trace_budget(local_sgd)


def test_should_commit_error_propagates() -> None:
    manager = _mock_manager(commit=True)
    manager.should_commit.side_effect = RuntimeError("too many commit failures")
    model = make_model(0)
    local_sgd = pipeoff.ft.LocalSGD(manager, model, optim.SGD(model.parameters(), lr=0.1), 1,
                                    **OFF)
    with pytest.raises(RuntimeError, match="too many commit failures"):
        local_sgd.sync()
    manager.report_error.assert_not_called()
    _assert_pools_idle()


def test_original_path_is_torchft() -> None:
    manager = _mock_manager(commit=True)
    model = make_model(0)
    local_sgd = pipeoff.ft.LocalSGD(manager, model, optim.SGD(model.parameters(), lr=0.1), 1)
    local_sgd.sync()
    assert manager.allreduce.call_count == len(list(model.parameters()))
    assert local_sgd.last_trace is None


def test_split_parameter_buckets() -> None:
    manager = _mock_manager(commit=True)
    model = nn.Linear(64, 64)  # weight: 16 KiB, split into 4 KiB buckets
    local_sgd = pipeoff.ft.LocalSGD(manager, model, optim.SGD(model.parameters(), lr=0.1), 1,
                                    **OFF, bucket_bytes=4096, device_budget_bytes=8192)
    local_sgd.sync()
    sizes = [c.args[0].numel() for c in manager.allreduce.call_args_list]
    assert sizes == [1024, 1024, 1024, 1024, 64]
    assert local_sgd.last_trace.summary().peak_device_staging_bytes <= 8192


def test_never_mixes_dtypes() -> None:
    manager = _mock_manager(commit=True)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).to(torch.float64), nn.Linear(4, 4))
    local_sgd = pipeoff.ft.LocalSGD(manager, model, optim.SGD(model.parameters(), lr=0.1), 1,
                                    **OFF, bucket_bytes=1 << 20)
    local_sgd.sync()
    dtypes = [c.args[0].dtype for c in manager.allreduce.call_args_list]
    assert dtypes == [torch.float32, torch.float64, torch.float32]


# -- configuration -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({**OFF, "bucket_bytes": 0}, "bucket_bytes must be a positive int"),
        ({**OFF, "bucket_bytes": -5}, "bucket_bytes must be a positive int"),
        ({**OFF, "bucket_bytes": 1.5}, "bucket_bytes must be a positive int"),
        ({**OFF, "bucket_bytes": "per_param"}, "or 'per_parameter', got 'per_param'"),
        ({**OFF, "bucket_bytes": 2}, "bucket_bytes=2 is smaller than one element"),
        ({**OFF, "bucket_bytes": "per_parameter", "device_budget_bytes": 2},
         "device_budget_bytes=2 is smaller than one element"),
        ({**OFF, "bucket_bytes": 4096, "device_budget_bytes": 1024},
         "device_budget_bytes=1024 is smaller than one bucket"),
        ({**OFF, "device_budget_bytes": 0}, "device_budget_bytes must be a positive int"),
        ({**OFF, "schedule": "chunked"}, "schedule must be 'pipelined' or 'synchronous'"),
        ({"schedule": "pipelined"}, "applies only with offload_to_cpu=True"),
        ({"bucket_bytes": 1024}, "applies only with offload_to_cpu=True"),
        ({"device_budget_bytes": 1024}, "applies only with offload"),
        ({**OFF, "schedule": "synchronous", "bucket_bytes": 0},
         "bucket_bytes must be a positive int"),
        ({"offload_to_cpu": 1}, "must be True or False"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict[str, Any], match: str) -> None:
    model = make_model(0)
    with pytest.raises(pipeoff.ConfigError, match=match):
        pipeoff.ft.LocalSGD(_mock_manager(commit=True), model,
                            optim.SGD(model.parameters(), lr=0.1), 1, **kwargs)


@pytest.mark.parametrize("which", ["manager", "model", "optimizer"])
def test_a_missing_component_is_refused_naming_it(which: str) -> None:
    """(A new user's find: each was accepted, then failed inside torchft at the first
    ``with`` or sync, with an AttributeError.)"""
    model = make_model(0)
    args: dict[str, Any] = {"manager": _mock_manager(commit=True), "model": model,
                            "optimizer": optim.SGD(model.parameters(), lr=0.1)}
    args[which] = None
    with pytest.raises(pipeoff.ConfigError, match=f"{which} must be a .*, got None"):
        pipeoff.ft.LocalSGD(args["manager"], args["model"], args["optimizer"], 1)


def test_the_old_name_of_offload_to_cpu_still_works_and_warns() -> None:
    model = make_model(0)
    opt = optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(FutureWarning, match="now offload_to_cpu"):
        old = pipeoff.ft.LocalSGD(_mock_manager(commit=True), model, opt, 1,
                                  offload_averaged_parameters_to_cpu=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (RFC 0003's position is offload_to_cpu's: no warning)
        positional = pipeoff.ft.LocalSGD(_mock_manager(commit=True), model, opt, 1, True)
    assert old._offload and positional._offload
    with pytest.raises(pipeoff.ConfigError, match="not both"):
        pipeoff.ft.LocalSGD(_mock_manager(commit=True), model, opt, 1, True,
                            offload_averaged_parameters_to_cpu=True)


def test_a_non_floating_parameter_is_refused_at_construction() -> None:
    model = make_model(0)
    model.register_parameter("count", nn.Parameter(torch.zeros(3, dtype=torch.int64),
                                                   requires_grad=False))
    with pytest.raises(pipeoff.ConfigError, match="'count' is torch.int64"):
        pipeoff.ft.LocalSGD(_mock_manager(commit=True), model,
                            optim.SGD(model.parameters(), lr=0.1), 1, **OFF)


def test_flag_is_fifth_positional_argument() -> None:
    model = make_model(0)
    local_sgd = pipeoff.ft.LocalSGD(_mock_manager(commit=True), model,
                                    optim.SGD(model.parameters(), lr=0.1), 1, True)
    assert local_sgd.schedule == "pipelined"
    assert local_sgd.bucket_bytes == pipeoff.ft.DEFAULT_BUCKET_BYTES
    assert local_sgd.device_budget_bytes == 2 * pipeoff.ft.DEFAULT_BUCKET_BYTES


@pytest.mark.slow  # runs a Python interpreter (subprocess)
def test_import_pipeoff_does_not_import_torchft() -> None:
    code = "import sys, pipeoff; assert 'torchft' not in sys.modules, 'torchft imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_ft_exports() -> None:
    assert pipeoff.ft.__all__ == ["DEFAULT_BUCKET_BYTES", "DiLoCo", "LocalSGD"]
    import torchft.local_sgd

    assert issubclass(pipeoff.ft.LocalSGD, torchft.local_sgd.LocalSGD)
    assert issubclass(pipeoff.ft.DiLoCo, torchft.local_sgd.DiLoCo)


@pytest.mark.parametrize("mode", ["sync", "packed"])
def test_a_reserved_sync_allocates_no_staging(mode: str) -> None:
    manager = _mock_manager(commit=True)
    model = make_model(0)
    local_sgd = pipeoff.ft.LocalSGD(manager, model, optim.SGD(model.parameters(), lr=0.1), 1,
                                    **MODES[mode])
    pools = pipeoff.pools_for("cpu")
    before = (pools.device.stats().allocations, pools.host.stats().allocations)
    for _ in range(10):
        local_sgd.sync()
    # The constructor reserved what a sync holds at once: no sync allocates,
    # the first one included.
    after = (pools.device.stats().allocations, pools.host.stats().allocations)
    assert after == before
    assert local_sgd.reserve() == 0  # already reserved for this plan
    _assert_pools_idle()


def test_sync_schedule_accepts_and_ignores_bucket_options() -> None:
    # Switching schedule= alone must keep a call valid (A/B runs of one script).
    manager = _mock_manager(commit=True)
    model = make_model(0)
    local_sgd = pipeoff.ft.LocalSGD(manager, model, optim.SGD(model.parameters(), lr=0.1), 1,
                                    **OFF, schedule="synchronous", bucket_bytes=1 << 20,
                                    device_budget_bytes=2 << 20)
    assert local_sgd.bucket_bytes is None and local_sgd.device_budget_bytes is None
    local_sgd.sync()
    assert manager.allreduce.call_count == len(list(model.parameters()))  # RFC: per parameter


@pytest.mark.parametrize("mode", ["original", "sync", "packed"])
def test_waits_for_an_asynchronous_optimizer_step(mode: str) -> None:
    manager = _mock_manager(commit=True)
    model = make_model(0)
    events: list[str] = []

    class AsyncSGD(optim.SGD):
        def wait_for_step(self) -> None:  # what pipeoff.optim.OffloadOptimizer offers
            events.append("wait_for_step")

    manager.allreduce.side_effect = (
        lambda t, should_quantize=False: events.append("allreduce") or _DummyWork(t))
    # The quorum is when a recovering peer reads this replica's checkpoint.
    manager.start_quorum.side_effect = lambda *a, **k: events.append("start_quorum")
    kwargs = {} if mode == "original" else MODES[mode]
    local_sgd = pipeoff.ft.LocalSGD(manager, model, AsyncSGD(model.parameters(), lr=0.1), 1,
                                    **kwargs)
    local_sgd.sync()
    assert events[:2] == ["wait_for_step", "start_quorum"]
    assert "allreduce" in events


def test_sync_is_the_deprecated_name_of_the_synchronous_schedule() -> None:
    manager = _mock_manager(commit=True)
    model = make_model(0)
    with pytest.warns(FutureWarning, match="now schedule='synchronous'"):
        local_sgd = pipeoff.ft.LocalSGD(manager, model, optim.SGD(model.parameters(), lr=0.1),
                                        1, **OFF, schedule="sync")
    assert local_sgd.schedule == "synchronous"
