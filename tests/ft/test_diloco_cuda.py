"""pipeoff.ft.DiLoCo with device staging: streams, pinned host buffers and budgets, on the
simulated CUDA device (and a real GPU where there is one).

The collective follows NCCL's stream rules (``tests/ft/test_local_sgd_cuda.py``):
it runs on a stream of its own that first waits for the caller's current
stream, and ``wait()`` makes the caller's stream wait for it. A missing stream
wait is a :class:`pipeoff.testing.DataRaceError` on the simulated device.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn, optim

import pipeoff
import pipeoff.ft
import pipeoff.testing
from tests.ft.test_local_sgd_cuda import _manager
from tests.gpu_device import Gpu

MODES: dict[str, dict[str, Any]] = {
    "original": {},
    "synchronous": {"offload_to_cpu": True, "schedule": "synchronous"},
    "pipelined": {"offload_to_cpu": True, "bucket_bytes": 4 << 10,
                  "device_budget_bytes": 8 << 10},
}


def _run(gpu: Gpu, mode: str, *, steps: int = 6, delay_s: float = 0.002) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = gpu.module(nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 50), nn.Linear(50, 7)))
    manager = _manager(gpu)
    manager._use_async_quorum = False
    step = [0]  # torchft's step: it moves on at each commit

    def should_commit(*_: Any, **__: Any) -> bool:
        step[0] += 1
        return True

    manager.current_step.side_effect = lambda: step[0]
    manager.should_commit.side_effect = should_commit
    inner = optim.SGD(model.parameters(), lr=0.1)
    outer = [optim.SGD(m.parameters(), lr=0.7, momentum=0.9, nesterov=True) for m in model]
    x = gpu.tensor(torch.randn(8, 64))
    # Slow lanes (stream-side sleeps) provoke what a missing wait lets through.
    with pipeoff.ft.DiLoCo(manager, list(model), inner, outer, sync_every=6,
                           fragment_sync_delay=1, fragment_update_alpha=0.5,
                           **MODES[mode]) as diloco, \
            pipeoff.testing.delay_lane("h2d", delay_s), pipeoff.testing.delay_lane("comm", delay_s):
        for _ in range(steps):
            inner.zero_grad()
            model(x).pow(2).mean().backward()
            inner.step()
            if mode == "pipelined" and diloco.last_trace is not None \
                    and not pipeoff._faults.any_disabled():
                summary = diloco.last_trace.summary()
                assert summary.peak_device_staging_bytes <= MODES[mode]["device_budget_bytes"]
    if mode != "original":
        assert diloco.last_trace is not None
        pools = pipeoff.pools_for(gpu.device)
        assert pools.device.stats().live_bytes == 0
    return [gpu.read(p) for p in model.parameters()]


@pytest.mark.timeout(120)
def test_offloaded_modes_match_torchft_under_delays(gpu: Gpu) -> None:
    results = {mode: _run(gpu, mode) for mode in MODES}
    for mode in MODES:
        for got, want in zip(results[mode], results["original"], strict=True):
            if gpu.simulated:
                assert torch.equal(got, want), mode
            else:
                # On a real GPU the offloaded outer step runs torch's CPU kernel,
                # torchft's the CUDA one: the same formula, rounded by another
                # implementation (docs/diloco.md).
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=mode)


@pytest.mark.parametrize("mutation", ["diloco_formed_wait", "cross_lane_wait", "base_wait"])
def test_every_stream_wait_of_the_sync_is_needed(gpu: Gpu, mutation: str) -> None:
    if not gpu.simulated:
        pytest.skip("a real GPU shows a missing wait only by luck")
    with pipeoff.testing.disable(mutation), pytest.raises(pipeoff.testing.DataRaceError):
        if mutation == "diloco_formed_wait":
            _run_with_the_formation_held(gpu)
        else:
            # Stream-side sleeps long against a busy host's scheduling: what the
            # missing stream wait lets through is still pending when it is read.
            _run(gpu, "pipelined", delay_s=0.05)
        gpu.synchronize()


def _run_with_the_formation_held(gpu: Gpu) -> None:
    """The pseudo-gradients are not even issued until the caller blocks in a wait for
    them: before the next inner step (the formation wait, in DiLoCo's pre-step hook)
    or, without it, in ``perform_sync``, after that inner step has written the
    parameters they read. The interleaving is forced, not hoped for from lane delays (a run on a
    busy machine once formed them before the write, and saw no race)."""
    from tests._stacks import release_when_waiting

    with pipeoff.testing.hold_task(r"pseudograd:.*") as release:
        watchers = [release_when_waiting(release, "wait_formed"),
                    release_when_waiting(release, "on_read", "wait_for"),
                    release_when_waiting(release, "perform_sync")]
        try:
            _run(gpu, "pipelined")
        finally:
            release.set()
            for w in watchers:
                w.join()


def test_the_held_formation_is_clean_with_its_wait(gpu: Gpu) -> None:
    """The same forced interleaving with the formation wait in place raises nothing: the
    race above is the missing wait's, not the hold's."""
    if not gpu.simulated:
        pytest.skip("the hold proves an order on the simulated device")
    _run_with_the_formation_held(gpu)
    gpu.synchronize()


# -- the sync's writes under the next forward (docs/diloco.md, "After the decision") ----
def _forward_after_a_held_sync(gpu: Gpu, mode: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One sync (one fragment, every 2 steps) whose writes are held until the next
    forward blocks in a module's wait (without that wait: until the forward has been
    enqueued); that forward's output and the parameters after it."""
    from tests._stacks import release_when_waiting

    torch.manual_seed(0)
    model = gpu.module(nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 50), nn.Linear(50, 7)))
    manager = _manager(gpu)
    manager._use_async_quorum = False
    step = [0]

    def should_commit(*_: Any, **__: Any) -> bool:
        step[0] += 1
        return True

    manager.current_step.side_effect = lambda: step[0]
    manager.should_commit.side_effect = should_commit
    inner = optim.SGD(model.parameters(), lr=0.1)
    outer = optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    x = gpu.tensor(torch.randn(8, 64))
    with pipeoff.ft.DiLoCo(manager, [model], inner, outer, sync_every=2,
                           fragment_update_alpha=0.5, **MODES[mode]) as diloco:
        inner.zero_grad()
        model(x).pow(2).mean().backward()
        inner.step()
        inner.zero_grad()
        model(x).pow(2).mean().backward()
        with pipeoff.testing.hold_task(r"write:b.*") as release:
            inner.step()  # the sync: returns with its writes held
            watcher = release_when_waiting(release, "on_module", "wait_for")
            try:
                out = model(x)
            finally:
                release.set()
                watcher.join()
        # The writes run before the device is synchronized (on a busy machine they could
        # run after it, ordered after the forward by its host clock: the race a test
        # expects without the forward's wait would not happen).
        diloco.wait_for_sync()
        gpu.synchronize()
        return gpu.read(out.detach()), [gpu.read(p) for p in model.parameters()]


def test_the_next_forward_waits_for_the_held_writes_on_streams(gpu: Gpu) -> None:
    """The forward's compute stream waits for each bucket's write event (the host only
    until the held write is issued): the output and parameters are torchft's."""
    out, params = _forward_after_a_held_sync(gpu, "pipelined")
    want_out, want_params = _forward_after_a_held_sync(gpu, "original")
    if gpu.simulated:
        assert torch.equal(out, want_out)
        assert all(torch.equal(a, b) for a, b in zip(params, want_params, strict=True))
    else:
        torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)


def test_without_the_forward_waits_the_write_races_the_forward(gpu: Gpu) -> None:
    """Hazard: the next forward's kernels reading parameters that the merge's stream
    writes after them with no event between. The writes are held until the forward
    has been issued (on the simulated device an out-of-place op runs at its issue), so
    the forward read the parameters before the merge: the simulator reports the race,
    or, where something else ordered the two (a busy machine once ran the writes
    after the test's device sync, ordered by it), the output is not torchft's. Either
    way a failure, forced by the hold, not by timing."""
    if not gpu.simulated:
        pytest.skip("a real GPU shows a missing wait only by luck")
    want_out, _ = _forward_after_a_held_sync(gpu, "original")
    with pipeoff.testing.disable("diloco_forward_wait"):
        try:
            out, _ = _forward_after_a_held_sync(gpu, "pipelined")
            gpu.synchronize()
        except pipeoff.testing.DataRaceError:
            return
    assert not torch.equal(out, want_out)  # it read the parameters before the merge
