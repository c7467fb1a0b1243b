"""Checks every offloaded LocalSGD sync in these tests makes, whatever the test asserts."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _every_pipelined_sync_stays_within_its_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[list[int]]:
    """The device staging high-water mark of each pipelined sync, against its budget.

    The budget is the one the sync planned with (its trace records it), so the
    per-parameter default (the largest parameter) is checked too. Syncs run in
    this process only: replicas in other processes are checked by their tests.
    """
    from pipeoff.ft import LocalSGD

    real = LocalSGD._offloaded_sync
    peaks: list[int] = []

    def checked(self: LocalSGD) -> bool:
        import pipeoff.testing

        try:
            return real(self)
        finally:
            trace = self.last_trace
            # A mutation test switches a wait off on purpose: the budget goes too.
            if (trace is not None and self.schedule == "pipelined"
                    and not pipeoff._faults.any_disabled()):
                peak = trace.summary().peak_device_staging_bytes
                peaks.append(peak)
                assert trace.device_budget_bytes is not None, "a pipelined sync without a budget"
                assert peak <= trace.device_budget_bytes, (peak, trace.device_budget_bytes)

    monkeypatch.setattr(LocalSGD, "_offloaded_sync", checked)
    yield peaks
