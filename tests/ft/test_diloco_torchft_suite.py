"""torchft's own DiLoCo tests, run against pipeoff.ft.DiLoCo in each of its modes.

The installed ``torchft.local_sgd_test`` and ``torchft._test.diloco_trainer``
modules resolve ``DiLoCo`` through their module globals; each test swaps in a
subclass of pipeoff's class whose defaults select one mode, then runs
torchft's unmodified test method. The unit tests read torchft's internals
(``_fragments[0]._grads``, ``_average_grads``), so they run with
``offload_to_cpu=False``; the integration tests (real Lighthouse, real
Managers over gloo, injected failures, healing) in all three modes.

Every configuration of torchft's parameterized integration tests runs (12
each: fragments, ``fragment_sync_delay``, ``fragment_update_alpha``).
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

pytest.importorskip("parameterized", reason="torchft's tests need the parameterized package")

import torchft._test.diloco_trainer as trainer  # noqa: E402
import torchft.local_sgd  # noqa: E402
import torchft.local_sgd_integ_test as integ  # noqa: E402
import torchft.local_sgd_test as unit  # noqa: E402
from torchft._torchft import LighthouseServer as _LighthouseServer  # noqa: E402
from torchft.manager import Manager as _Manager  # noqa: E402

import pipeoff.ft  # noqa: E402
from tests.ft._torchft_cases import run_case  # noqa: E402

BUDGET = 64
MODES: dict[str, dict[str, Any]] = {
    "original": {},
    "synchronous": {"offload_to_cpu": True, "schedule": "synchronous"},
    # Buckets of 32 bytes: the test models' parameters (6 and 2 floats) are split
    # across buckets and the budget holds two of them.
    "pipelined": {"offload_to_cpu": True, "schedule": "pipelined", "bucket_bytes": 32,
                  "device_budget_bytes": BUDGET},
}

# (n_fragments, fragment_sync_delay, alpha) of torchft's CONFIG, by test-name suffix.
CONFIG = {f"{i:02d}": c for i, c in enumerate(
    (n, d, a) for n in [1, 2] for d in [0, 1] for a in [0.0, 0.5, 1.0])}
SUFFIXES = list(CONFIG)  # about a second each: the whole matrix


def _mode_class(mode: str, created: list[Any]) -> type[Any]:
    defaults = MODES[mode]

    class ModeDiLoCo(pipeoff.ft.DiLoCo):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs, **defaults)
            created.append(self)

    return ModeDiLoCo


@pytest.fixture(autouse=True)
def _no_default_process_group_left() -> Iterator[None]:
    """torchft's DiLoCo trainer initializes the default process group (for its device
    mesh) and never destroys it; later tests in this process would find one."""
    import torch.distributed as dist

    before = dist.is_initialized()
    yield
    if dist.is_initialized() and not before:
        dist.destroy_process_group()


JOIN_TIMEOUT_MS = 2000
"""How long the Lighthouse waits for a heartbeating replica to join a changed quorum.
torchft's tests leave its default (about 100 ms): on 2 shared cores, with three
replicas in one process sharing the GIL, a replica can lag its peers by more
than that (0.64 s seen in CI; at 1000 ms, upscale-06 and upscale-07 each failed
once in a fresh-clone run beside other test processes), the quorum forms
without it, its peers finish their loops, and it times out waiting alone. A wait
only for quorums whose membership changes, which each upscale case pays once
(its third replica heartbeats behind a barrier): 2.7 s per upscale case at
2000 ms, 1.7 s at 1000 ms, 4.7 s at 4000 ms."""


def _lighthouse(**kwargs: Any) -> Any:
    kwargs.setdefault("join_timeout_ms", JOIN_TIMEOUT_MS)
    return _LighthouseServer(**kwargs)


MANAGER_TIMEOUT = timedelta(seconds=30)
"""The least quorum, connect and operation timeout of the trainer's Managers. torchft's
trainer sets 10 s: in a fresh-clone CI run beside other processes on 2 cores, one
upscale case's quorum RPC ran out of it once (its peers were slow, not stuck; alone
the case passes). Only a slower failure is waited for longer."""


def _manager(*args: Any, **kwargs: Any) -> Any:
    for key in ("timeout", "quorum_timeout", "connect_timeout"):
        if key in kwargs:
            kwargs[key] = max(kwargs[key], MANAGER_TIMEOUT)
    return _Manager(*args, **kwargs)


def _patch(monkeypatch: pytest.MonkeyPatch, mode: str) -> list[Any]:
    created: list[Any] = []
    cls = _mode_class(mode, created)
    for module in (torchft.local_sgd, unit, integ, trainer):
        monkeypatch.setattr(module, "DiLoCo", cls)
    monkeypatch.setattr(integ, "LighthouseServer", _lighthouse)
    monkeypatch.setattr(trainer, "Manager", _manager)
    return created


@pytest.mark.timeout(60)
@pytest.mark.parametrize("test", [
    "test_diloco_healthy", "test_gradient_correctness", "test_bucketization_correctness",
    "test_diloco_allreduce_call_efficiency_0_bucketized_should_use_fewer_calls",
    "test_diloco_allreduce_call_efficiency_1_non_bucketized_should_call_per_param"])
def test_torchft_diloco_unit(monkeypatch: pytest.MonkeyPatch, test: str) -> None:
    created = _patch(monkeypatch, "original")
    run_case(unit.DiLoCoTest(test))
    assert created, "torchft's test did not construct pipeoff's class"


def _check_traces(mode: str, created: list[Any]) -> None:
    assert created, "torchft's test did not construct pipeoff's class"
    traces = [c.last_trace for c in created if c.last_trace is not None]
    if mode == "original":
        assert not traces
        return
    assert traces, "no offloaded sync ran"
    if mode == "pipelined":
        assert all(t.summary().peak_device_staging_bytes <= BUDGET for t in traces)


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("test", ["test_diloco_healthy_0", "test_diloco_recovery_0",
                                  "test_streaming_diloco_recovery_0"])
def test_torchft_diloco_integ(monkeypatch: pytest.MonkeyPatch, mode: str, test: str) -> None:
    created = _patch(monkeypatch, mode)
    # Fixed ports 19530-19532 (torchft's trainer): never run this concurrently.
    run_case(integ.LocalSGDIntegTest(test))
    _check_traces(mode, created)


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("suffix", SUFFIXES)
@pytest.mark.parametrize("kind", ["upscale", "commit_failure"])
def test_torchft_streaming_diloco(monkeypatch: pytest.MonkeyPatch, mode: str, suffix: str,
                                  kind: str) -> None:
    created = _patch(monkeypatch, mode)
    run_case(integ.LocalSGDIntegTest(f"test_streaming_diloco_{kind}_{suffix}"),
             quorum_retries=1 if kind == "upscale" else 0)
    _check_traces(mode, created)
