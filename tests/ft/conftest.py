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


@pytest.fixture(scope="session", autouse=True)
def _optimizer_steps_warmed_up() -> None:
    """One step of each optimizer the replica harnesses use, in this (main) thread,
    before any test starts replicas as threads of this process.

    torch 2.13's first ``optimizer.step()`` in a process, taken by two threads at
    once, sometimes computes the first parameter's update 7e-5 off (relative) in
    one of them while its state (step, moments) is exact: 2 of 150 fresh processes
    of a torch-only reproducer (two threads, one ``AdamW.step()`` each behind a
    barrier), and 5 of 80 fresh runs of ``test_bitwise_torchft[1frag-original]``
    (torchft's DiLoCo code, so not pipeoff's), always in the first run of the
    process. The same operations written out by hand never differed (0 of 150),
    so it is in what the first ``step()`` sets up. A user's replica is a process
    of its own; the harness's replicas share one, and their first steps would race.
    """
    import torch
    from torch import nn, optim

    net = nn.Linear(3, 2)
    makers = [lambda ps: optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
              lambda ps: optim.Adam(ps, lr=0.1),
              lambda ps: optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True),
              lambda ps: optim.SGD(ps, lr=0.5)]
    for make in makers:
        opt = make(net.parameters())
        for _ in range(2):
            net(torch.ones(4, 3)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
