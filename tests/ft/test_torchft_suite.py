"""torchft's own LocalSGD tests, run against pipeoff.ft.LocalSGD in each of its modes.

The installed ``torchft.local_sgd_test`` and ``torchft.local_sgd_integ_test``
modules resolve ``LocalSGD`` through their module globals; each test swaps in
a subclass of pipeoff's class whose defaults select one mode, then runs
torchft's unmodified test method.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

pytest.importorskip("parameterized", reason="torchft's tests need the parameterized package")

import torchft.local_sgd  # noqa: E402
import torchft.local_sgd_integ_test as integ  # noqa: E402
import torchft.local_sgd_test as unit  # noqa: E402

import pipeoff.ft  # noqa: E402
from tests.ft._torchft_cases import run_case  # noqa: E402

BUDGET = 128
MODES: dict[str, dict[str, Any]] = {
    "original": {},
    "sync": {"offload_to_cpu": True, "schedule": "synchronous"},
    # One bucket per parameter keeps torchft's "one all-reduce per parameter" count;
    # 128 bytes of device staging holds the largest parameter of either test model.
    "pipelined": {"offload_to_cpu": True, "schedule": "pipelined",
                  "bucket_bytes": "per_parameter", "device_budget_bytes": BUDGET},
}


def _mode_class(mode: str, created: list[pipeoff.ft.LocalSGD]) -> type[pipeoff.ft.LocalSGD]:
    defaults = MODES[mode]

    class ModeLocalSGD(pipeoff.ft.LocalSGD):
        def __init__(self, manager: Any, model: Any, optimizer: Any, sync_every: int) -> None:
            super().__init__(manager, model, optimizer, sync_every, **defaults)
            created.append(self)

    return ModeLocalSGD


@pytest.fixture(params=list(MODES))
def mode_class(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Any:
    created: list[pipeoff.ft.LocalSGD] = []
    cls = _mode_class(request.param, created)
    for module in (torchft.local_sgd, unit, integ):
        monkeypatch.setattr(module, "LocalSGD", cls)
    yield request.param, created


@pytest.mark.timeout(60)
@pytest.mark.parametrize("test", ["test_local_sgd_healthy", "test_local_sgd_recovery",
                                  "test_extract_local_tensor"])
def test_torchft_local_sgd_unit(mode_class: tuple[str, list[Any]], test: str) -> None:
    mode, created = mode_class
    run_case(unit.LocalSGDTest(test))
    if test != "test_extract_local_tensor":
        assert created, "torchft's test did not construct pipeoff's class"
    if test == "test_local_sgd_healthy" and mode != "original":
        trace = created[0].last_trace
        assert trace is not None  # the sync ran as a pipeoff graph
        if mode == "pipelined":
            assert trace.summary().peak_device_staging_bytes <= BUDGET


@pytest.mark.timeout(120)
@pytest.mark.parametrize("use_async_quorum", [False, True], ids=["sync_quorum", "async_quorum"])
def test_torchft_local_sgd_recovery_integ(mode_class: tuple[str, list[Any]],
                                          use_async_quorum: bool,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    mode, created = mode_class
    runners: list[Any] = []
    if use_async_quorum:
        # torchft's test hard-codes use_async_quorum=False; run it the other way too.
        @dataclasses.dataclass
        class AsyncRunner(integ.Runner):  # type: ignore[misc, name-defined]
            def __post_init__(self) -> None:
                self.manager_args = {**self.manager_args, "use_async_quorum": True}
                runners.append(self)

        monkeypatch.setattr(integ, "Runner", AsyncRunner)
    # Fixed ports 19530-19531: never run this concurrently with another copy.
    run_case(integ.LocalSGDIntegTest("test_local_sgd_recovery_0"))
    assert len(runners) == (2 if use_async_quorum else 0)
    assert len(created) >= 3  # replica 0 once, replica 1 twice (injected failure)
    traces = [c.last_trace for c in created if c.last_trace is not None]
    if mode == "original":
        assert not traces
    else:
        assert traces and all(t.summary().failed == 0 for t in traces)
        if mode == "pipelined":
            assert all(t.summary().peak_device_staging_bytes <= BUDGET for t in traces)
