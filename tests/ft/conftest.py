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

    Found as torch 2.13's first ``optimizer.step()`` in a process going wrong: the
    first parameter's update 7e-5 off (relative) in one thread's share, its state
    exact (5 of 80 fresh runs of ``test_bitwise_torchft[1frag-original]``). Since
    root-caused in MKL inside torch: the process's first MKL vector-math call
    (``exp_avg_sq.sqrt()``) can run one intra-op thread's share on a low-precision
    kernel (``pipeoff/_vml.py``), which ``import pipeoff`` now prevents. Kept: a
    whole first step of each optimizer here costs nothing and covers whatever else a
    first step sets up lazily.
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
