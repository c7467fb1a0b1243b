"""StateTransfer's CUDA path (copy lanes on streams, pinned and pageable host memory,
readiness) on the simulated CUDA device, and on a real GPU where there is one."""

from __future__ import annotations

import pytest
import torch

import pipeoff.testing as pt
from pipeoff.testing import DataRaceError
from pipeoff.transfer import LiveTensor, StateTransfer, TransferTornError
from tests.gpu_device import Gpu

RESIDENCIES = ["device", "pinned", "pageable"]


def make(gpu: Gpu, residency: str, values: torch.Tensor) -> torch.Tensor:
    if residency == "device":
        return gpu.tensor(values)
    t = gpu.host(*values.shape, dtype=values.dtype, pinned=residency == "pinned")
    t.copy_(values)
    return t


@pytest.mark.parametrize("src_res", RESIDENCIES)
@pytest.mark.parametrize("dst_res", RESIDENCIES)
def test_every_residency_pair_is_bitwise_under_the_stream_rules(gpu: Gpu, src_res: str,
                                                                dst_res: str) -> None:
    g = torch.Generator().manual_seed(0)
    values = torch.randn(33, 17, generator=g)
    src = make(gpu, src_res, values)
    dst = make(gpu, dst_res, torch.full((34, 18), -7.0))
    t = StateTransfer({"w": LiveTensor(src)},
                      {"w": LiveTensor(dst, box=((0, 0), (33, 17)), global_shape=(33, 17))},
                      host_budget_bytes=512, device_budget_bytes=512,
                      cast={"*": torch.float32})
    with pt.delay_lane("h2d", 0.001), pt.delay_lane("d2h", 0.001):
        t.run()
    out = gpu.read(dst)
    assert torch.equal(out[:33, :17], values)
    assert bool((out[33] == -7).all()) and bool((out[:, 17] == -7).all())
    assert LiveTensor(src).resolved_residency() == src_res


def test_a_bf16_cast_from_device_masters_to_pinned_targets(gpu: Gpu) -> None:
    values = torch.randn(64, 40)
    src = gpu.tensor(values)
    dst = gpu.host(64, 40, dtype=torch.bfloat16)
    StateTransfer({"w": LiveTensor(src)}, {"w": LiveTensor(dst)}, host_budget_bytes=1024,
                  cast={"w": torch.bfloat16}).run()
    assert torch.equal(gpu.read(dst), values.to(torch.bfloat16))


@pytest.mark.parametrize("mutation", [None, ("base_wait", "host_task_event")])
def test_a_source_the_callers_stream_still_writes_is_waited_for(
        gpu: Gpu, mutation: tuple[str, ...] | None) -> None:
    # The copies wait for the caller's stream twice over: each lane's first wait
    # (base_wait), and the preflight's event, recorded on that same stream.
    if mutation and not gpu.simulated:
        pytest.skip("a removed wait is provoked on the simulated device only")
    src = gpu.tensor(torch.ones(256))
    dst = gpu.zeros(256)
    stream = gpu.current_stream()
    gpu.accel.sleep(stream, 0.05)  # the caller's stream is late ...
    src.mul_(3)  # ... with this write, enqueued before the transfer
    t = StateTransfer({"w": LiveTensor(src)}, {"w": LiveTensor(dst)}, host_budget_bytes=256)
    if mutation is None:
        t.run()
        assert bool((gpu.read(dst) == 3).all())
        return
    # The race is a fault after the preflight: the transfer is torn, the race its
    # cause; or, found by the stream after its copy was issued, it surfaces at the
    # next synchronization as itself (as a GPU's asynchronous error would).
    with pt.disable(*mutation), pytest.raises((TransferTornError, DataRaceError)) as info:
        t.run()
        gpu.synchronize()
    assert isinstance(info.value, DataRaceError) or isinstance(info.value.__cause__,
                                                                 DataRaceError)


def test_a_transfer_right_after_an_overlap_step_on_the_device(gpu: Gpu) -> None:
    from pipeoff.optim import OffloadOptimizer

    torch.manual_seed(0)
    m = gpu.module(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)))
    opt = OffloadOptimizer(torch.optim.AdamW(m.parameters(), lr=0.1), mode="overlap",
                           chunk_bytes=256)
    x = gpu.tensor(torch.randn(3, 8))
    for _ in range(2):
        m(x).sum().backward()
        with pt.delay_lane("d2h", 0.01):
            opt.step()
            names = dict(m.named_parameters())
            src = {n: LiveTensor.from_optimizer(opt, p, "exp_avg") for n, p in names.items()}
            tg = {n: gpu.host(*p.shape) for n, p in names.items()}
            StateTransfer(src, {n: LiveTensor(t) for n, t in tg.items()},
                          host_budget_bytes=256).run()
        opt.wait_for_step()
        for n, p in names.items():
            assert torch.equal(tg[n], opt.state[p]["exp_avg"]), n
        opt.zero_grad()
