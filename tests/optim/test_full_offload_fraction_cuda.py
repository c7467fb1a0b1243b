"""FullOffloadOptimizer(offload_fraction=f) on the simulated CUDA device (and a real GPU
where there is one): the device part's masters, state and sums in device memory, bitwise
the reference beside the host part's streams; its join's wait removed is a race."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import pipeoff.testing
from pipeoff.optim import FullOffloadOptimizer
from tests.gpu_device import Gpu
from tests.optim.test_full_offload_cuda import batches, loss, make_net, reference, train


@pytest.mark.parametrize("f", [0.0, 0.3])
@pytest.mark.parametrize("overlap", ["none", "forward", "backward"])
def test_bitwise_equal_on_streams_with_a_device_part(gpu: Gpu, overlap: str, f: float) -> None:
    """(overlap="backward" refuses max_norm: unclipped there, its host part stepping
    during the backward, the device part at step(), the next forward waiting on both.)"""
    data = batches(gpu, 3, 2)
    kw: dict[str, Any] = {"lr": 1e-2, "weight_decay": 0.1,
                          "max_norm": None if overlap == "backward" else 0.05}
    ref = reference(gpu, data, **kw)
    net = make_net(gpu)
    opt = FullOffloadOptimizer(net, torch.optim.AdamW, overlap=overlap, chunk_numel=3000,
                               slot_bytes=4096, offload_fraction=f, **kw)
    opt.attach()
    with pipeoff.testing.delay_lane("d2h", 0.002), pipeoff.testing.delay_lane("h2d", 0.002):
        train(net, opt, data)
    gpu.synchronize()
    for p, q in zip(net.parameters(), ref.model.parameters()):
        assert torch.equal(gpu.read(p), gpu.read(q))
    part = opt._lifecycle.part
    assert part.params and (f == 0.0) == (len(part.params) == len(list(net.parameters())))
    for rec in part.params.values():
        assert gpu.accel.on_device(rec.master)
        assert gpu.accel.on_device(rec.state["exp_avg"])
    stats = opt.memory_stats()
    dev = sum(rec.param.numel() for rec in part.params.values())
    assert stats["master_bytes_device"] == 4 * dev
    assert stats["state_bytes_device"] >= 8 * dev


@pytest.mark.parametrize("f", [0.0, 0.3])
def test_the_loops_clip_call_over_both_parts_on_streams(gpu: Gpu, f: float) -> None:
    """torch.nn.utils.clip_grad_norm_(net.parameters()) in the loop: the device part's
    norms and its coefficient run on the caller's stream beside the host part's lanes;
    bitwise the reference's clip over the FP32 sums."""
    data = batches(gpu, 3, 2)
    kw: dict[str, Any] = {"lr": 1e-2, "weight_decay": 0.1}
    ref = reference(gpu, data, max_norm=0.02, **kw)  # the same clip, on the FP32 sums
    net = make_net(gpu)
    opt = FullOffloadOptimizer(net, torch.optim.AdamW, chunk_numel=3000, slot_bytes=4096,
                               offload_fraction=f, **kw)
    opt.attach()
    norms = []
    with pipeoff.testing.delay_lane("d2h", 0.002), pipeoff.testing.delay_lane("h2d", 0.002):
        for step in data:
            for k, x in enumerate(step):
                with opt.no_sync() if k < len(step) - 1 else contextlib.nullcontext():
                    loss(net, x).backward()
            norms.append(torch.nn.utils.clip_grad_norm_(net.parameters(), 0.02))
            opt.step()
            opt.zero_grad()
        opt.wait_for_step()
    gpu.synchronize()
    for p, q in zip(net.parameters(), ref.model.parameters()):
        assert torch.equal(gpu.read(p), gpu.read(q))
    assert all(float(n) > 0.02 for n in norms), norms  # it did clip


_ISOLATED = "PIPEOFF_TEST_ISOLATED"


@pytest.mark.parametrize("mutated", [False, True])
def test_a_reader_off_the_callers_stream_waits_for_the_device_part(gpu: Gpu,
                                                                   mutated: bool) -> None:
    """After a synchronous step (overlap="none") at 0.3, a stream of its own reads a
    device-part weight and its state: the step's join made the host wait for the device
    part's kernels on the caller's stream. Without that wait the read races them."""
    if not gpu.simulated:
        pytest.skip("a real GPU shows the race only by timing luck")
    if mutated and os.environ.get(_ISOLATED) is None:
        # In a fresh interpreter: in two runs of the whole suite (of about ten) the race
        # went unobserved after earlier tests in the same process, never alone (80 runs,
        # loaded or not); the interleaving is the test's own there. Once (of about ten
        # suite runs) it went unobserved in its own interpreter too, and no delay of any
        # lane reproduces that (tried: accumulate, h2d, d2h, host_step, device_part; the
        # caller on a stream of its own or not), so the interleaving that hides it is not
        # known and cannot be forced: a known gap. Up to three interpreters, each a
        # fresh draw; every one must observe no *other* failure.
        node = f"{Path(__file__)}::test_a_reader_off_the_callers_stream_waits_for_the_device_part"
        outs = []
        for _ in range(3):
            run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                  f"{node}[simulated-True]"], capture_output=True, text=True,
                                 timeout=300, env={**os.environ, _ISOLATED: "1"}, check=False)
            if run.returncode == 0:
                return
            outs.append(run.stdout[-3000:])
            assert "DID NOT RAISE" in run.stdout, run.stdout[-3000:]
        raise AssertionError("\n---\n".join(outs))
    net = make_net(gpu)
    gpu.synchronize()
    opt = FullOffloadOptimizer(net, torch.optim.AdamW, lr=1e-2, overlap="none",
                               offload_fraction=0.3)
    part = opt._lifecycle.part
    first = next(iter(net.parameters()))
    rec = part.owns(first)
    assert rec is not None
    data = batches(gpu, 1, 1)
    side = gpu.accel.new_stream(gpu.device, name="reader")
    got: list[torch.Tensor] = []

    def read() -> None:
        got.extend([first.detach().clone(), rec.state["exp_avg"].clone()])

    switch = (pipeoff.testing.disable("full_device_part_wait") if mutated
              else pipeoff.testing.fail_task("no such task"))
    with switch:
        loss(net, data[0][0]).backward()
        opt.step()  # synchronous: returns after the join
        if mutated:
            with pytest.raises(pipeoff.testing.DataRaceError):
                gpu.accel.launch(side, read)
                gpu.synchronize()
            return
        gpu.accel.launch(side, read)
        gpu.synchronize()
    assert torch.equal(got[0], first.detach())


@pytest.mark.parametrize("overlap", ["none", "forward"])
def test_a_reader_off_the_callers_stream_after_load_state_dict_waits(gpu: Gpu,
                                                                     overlap: str) -> None:
    """load_state_dict() writes the device-part weights (and masters, state) on the
    caller's stream; after wait_for_step() a stream of its own reads them. The join
    waited only for a step's kernels, so the read raced the load's (a tester's find)."""
    if not gpu.simulated:
        pytest.skip("a real GPU shows the race only by timing luck")
    import copy

    net = make_net(gpu)
    opt = FullOffloadOptimizer(net, torch.optim.AdamW, lr=1e-2, overlap=overlap,
                               offload_fraction=0.3)
    loss(net, batches(gpu, 1, 1)[0][0]).backward()
    opt.step()
    opt.zero_grad()
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    opt.wait_for_step()
    first = next(iter(net.parameters()))
    assert opt._lifecycle.part.owns(first) is not None  # a device-part weight
    side = gpu.accel.new_stream(gpu.device, name="reader")
    got: list[torch.Tensor] = []
    gpu.accel.launch(side, lambda: got.append(first.detach().clone()))
    gpu.synchronize()
    assert torch.equal(got[0], first.detach())
