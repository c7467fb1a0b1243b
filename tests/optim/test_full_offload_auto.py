"""FullOffloadOptimizer(offload_fraction="auto"): the fastest fraction whose device part
fits device_budget_bytes, by full offload's step-time model (_full_offload/_auto.py)
from rates measured at construction (injected here); bitwise the reference at the chosen
fraction; its report (offload_choice, repr, the trace's metadata, step stats); the
refusals."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from pipeoff import ConfigError
from pipeoff.optim import FullOffloadOptimizer
from pipeoff.optim._full_offload import _auto
from pipeoff.optim._offload._auto import Rates
from tests.gpu_device import Gpu
from tests.optim.test_full_offload import (
    assert_bitwise,
    batches,
    loss_fn,
    make_model,
    train,
    train_reference,
)
from tests.optim.test_full_offload_cuda import batches as gbatches
from tests.optim.test_full_offload_cuda import make_net
from tests.optim.test_full_offload_cuda import reference as greference
from tests.optim.test_full_offload_cuda import train as gtrain
from tests.optim.test_full_offload_fraction import reference

pytestmark = pytest.mark.filterwarnings("ignore:pipeoff. pinned host memory")

GPU_LIKE = Rates(h2d_bytes_per_s=25e9, d2h_bytes_per_s=25e9, step_elements_per_s=20e9,
                 host_step_elements_per_s=1e9)
"""A fast device step, a link-bound host part (4 B per element over 25 GB/s)."""
CPU_LIKE = Rates(h2d_bytes_per_s=10e9, d2h_bytes_per_s=10e9, step_elements_per_s=0.2e9,
                 host_step_elements_per_s=1e9)
"""torch's step on the "device" (the CPU) slower than the native host step."""
BALANCED = Rates(h2d_bytes_per_s=1e15, d2h_bytes_per_s=1e15, step_elements_per_s=1e9,
                 host_step_elements_per_s=1e9)
"""Free copies, equal steps: the two parts split the work."""
TOTAL = 4 * (88 + 192 + 24 + 192 + 8 + 64 + 8) * 4  # Toy's 576 elements, 16 B each (AdamW)


def inject(monkeypatch: pytest.MonkeyPatch, rates: Rates) -> list[Any]:
    calls: list[Any] = []

    def fake(*args: Any, **kw: Any) -> Rates:
        calls.append((args, kw))
        return rates
    monkeypatch.setattr(_auto, "measure_full_rates", fake)
    return calls


def build(model: torch.nn.Module, budget: Any = TOTAL, **kw: Any) -> FullOffloadOptimizer:
    defaults: dict[str, Any] = {"lr": 1e-2, "weight_decay": 0.1}
    defaults.update(kw)
    return FullOffloadOptimizer(model, torch.optim.AdamW, offload_fraction="auto",
                                device_budget_bytes=budget, **defaults)


def device_bytes(opt: FullOffloadOptimizer) -> int:
    s = opt.memory_stats()
    return s["master_bytes_device"] + s["state_bytes_device"] + s["grad_sum_bytes_device"]


# -- the choice ---------------------------------------------------------------------------

def test_gpu_like_rates_take_the_smallest_fraction_that_fits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    inject(monkeypatch, GPU_LIKE)
    big = build(make_model(), budget=10 * TOTAL)
    assert big.offload_fraction == 0.0  # all fits: all on the device
    half = build(make_model(), budget=TOTAL // 2)
    c = half.offload_choice
    assert c is not None and 0.0 < c.fraction < 1.0
    assert c.fraction == min(x.fraction for x in c.candidates if x.fits)
    assert half.offload_fraction == c.fraction


def test_cpu_like_rates_keep_all_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's step on the CPU "device" slower than the host step: no device part (chunks
    small enough to pipeline)."""
    inject(monkeypatch, CPU_LIKE)
    opt = build(make_model(), budget=10 * TOTAL, chunk_numel=64)
    assert opt.offload_fraction == 1.0
    assert opt._lifecycle.part.params == {}


def test_balanced_rates_split_the_work(monkeypatch: pytest.MonkeyPatch) -> None:
    inject(monkeypatch, BALANCED)
    opt = build(make_model(), budget=10 * TOTAL)
    c = opt.offload_choice
    assert c is not None and c.fraction == 0.5  # the grid's balance; ties to the larger
    fastest = min(x.step_ms for x in c.candidates if x.fits)
    mine = next(x for x in c.candidates if x.fraction == c.fraction)
    assert mine.step_ms <= fastest * 1.02


def test_full_seconds_formula() -> None:
    r = Rates(h2d_bytes_per_s=1.0, d2h_bytes_per_s=1.0, step_elements_per_s=10.0,
              host_step_elements_per_s=2.0)
    # device 100/10 = 10; host (50 - 5) * max(4, 0.5) + 5 * (4 + 0.5)
    t = _auto.full_seconds(r, device_elements=100, host_elements=50, chunk_elements=5,
                           grad_bytes=2)
    assert t == pytest.approx(45 * 4 + 5 * 4.5)
    assert _auto.full_seconds(r, device_elements=5000, host_elements=50, chunk_elements=5,
                              grad_bytes=2) == pytest.approx(500)
    assert _auto.full_seconds(r, device_elements=100, host_elements=0, chunk_elements=5,
                              grad_bytes=2) == pytest.approx(10)


@pytest.mark.parametrize("overlap", ["forward", "backward"])
@pytest.mark.parametrize("accumulate", ["cpu", "gpu"], ids=lambda v: f"accumulate={v}")
@pytest.mark.parametrize("rates", [GPU_LIKE, BALANCED], ids=["gpu_like", "balanced"])
def test_the_choice_fits_and_trains_bitwise(monkeypatch: pytest.MonkeyPatch,
                                            rates: Rates, accumulate: str, overlap: str) -> None:
    inject(monkeypatch, rates)
    budget = TOTAL // 2
    model = make_model()
    ref = reference(model)
    opt = build(model, budget=budget, accumulate=accumulate, overlap=overlap)
    assert 0.0 < opt.offload_fraction < 1.0
    data = batches(3, 2)
    train(opt, model, data)
    train_reference(ref, data)
    assert_bitwise(model, ref)
    loss_data = batches(1, 1)
    loss_fn(model, loss_data[0][0]).backward()  # mid-accumulation: the sums count too
    assert 0 < device_bytes(opt) <= budget
    opt.zero_grad()


def test_a_checkpoint_of_an_auto_run_resumes_at_another_fraction(
        monkeypatch: pytest.MonkeyPatch) -> None:
    inject(monkeypatch, GPU_LIKE)
    data = batches(4, 2)
    ref = reference(make_model())
    train_reference(ref, data)
    model = make_model()
    opt = build(model, budget=TOTAL // 2)
    assert 0.0 < opt.offload_fraction < 1.0
    train(opt, model, data[:2])
    sd = copy.deepcopy(opt.state_dict())
    weights = copy.deepcopy(model.state_dict())
    model = make_model(seed=7)
    model.load_state_dict(weights)
    again = FullOffloadOptimizer(model, torch.optim.AdamW, offload_fraction=1.0, lr=0.5,
                                 weight_decay=0.1)
    again.load_state_dict(sd)
    train(again, model, data[2:])
    assert_bitwise(model, ref)


# -- the report ---------------------------------------------------------------------------

def test_repr_trace_and_step_stats_report_the_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    inject(monkeypatch, GPU_LIKE)
    model = make_model()
    opt = build(model, budget=TOTAL // 2)
    f = opt.offload_fraction
    assert f"offload_fraction={f:.4g} (auto)" in repr(opt)
    c = opt.offload_choice
    assert c is not None and c.budget_source == "device_budget_bytes"
    assert c.budget_bytes == TOTAL // 2 and c.rates == GPU_LIKE
    assert "offload_fraction=" in c.reason
    train(opt, model, batches(1, 1))
    opt.wait_for_step()
    meta = opt.last_trace.metadata
    assert meta["offload_fraction"] == f
    assert meta["offload_choice"]["fraction"] == f
    assert opt.last_step_stats.offload_fraction == f


def test_a_numeric_fraction_reports_no_choice() -> None:
    model = make_model()
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, offload_fraction=0.3, lr=1e-2)
    assert opt.offload_choice is None and "(auto)" not in repr(opt)
    train(opt, model, batches(1, 1))
    opt.wait_for_step()
    assert opt.last_trace.metadata["offload_fraction"] == 0.3
    assert "offload_choice" not in opt.last_trace.metadata


def test_rates_are_measured_on_the_parameters_device() -> None:
    """The real measurement (CPU here): positive rates, the host step's among them."""
    model = make_model()
    opt = build(model, budget=TOTAL)
    c = opt.offload_choice
    assert c is not None
    assert c.rates.step_elements_per_s > 0 and c.rates.h2d_bytes_per_s > 0
    assert c.rates.host_step_elements_per_s is not None and c.rates.host_step_elements_per_s > 0


# -- refusals ------------------------------------------------------------------------------

def test_no_budget_on_cpu_is_refused() -> None:
    with pytest.raises(ConfigError, match="offload_fraction='auto' needs device_budget_bytes"):
        FullOffloadOptimizer(make_model(), torch.optim.AdamW, offload_fraction="auto")


def test_a_budget_too_small_takes_all_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """Full offload stages nothing on the device: a budget below the smallest parameter
    is all on the host (offload_fraction=1.0), not an error."""
    inject(monkeypatch, GPU_LIKE)
    opt = build(make_model(), budget=1)
    assert opt.offload_fraction == 1.0


def test_modes_without_a_device_part_refuse_auto(monkeypatch: pytest.MonkeyPatch,
                                                 fake_group: Any) -> None:
    calls = inject(monkeypatch, GPU_LIKE)
    with pytest.raises(ConfigError, match="offload_fraction='auto'"):
        build(make_model(), process_group=fake_group)
    assert not calls  # refused before measuring


def test_a_budget_without_auto_is_refused() -> None:
    with pytest.raises(ConfigError, match="device_budget_bytes"):
        FullOffloadOptimizer(make_model(), torch.optim.AdamW, device_budget_bytes=1 << 20)


def test_bad_values_are_refused() -> None:
    with pytest.raises(ConfigError, match="offload_fraction"):
        FullOffloadOptimizer(make_model(), torch.optim.AdamW, offload_fraction="fast")
    with pytest.raises(ConfigError, match="device_budget_bytes"):
        build(make_model(), budget=-1)


# -- the simulated CUDA device -------------------------------------------------------------

def test_auto_on_the_simulated_cuda_device(gpu: Gpu) -> None:
    """Rates measured on the device (the simulated one here: its copies and kernels), a
    choice within the budget, bitwise the reference beside the host part's streams."""
    data = gbatches(gpu, 2, 2)
    kw: dict[str, Any] = {"lr": 1e-2, "weight_decay": 0.1}
    ref = greference(gpu, data, **kw)
    net = make_net(gpu)
    budget = 16 * sum(p.numel() for p in net.parameters()) // 2
    opt = FullOffloadOptimizer(net, torch.optim.AdamW, chunk_numel=3000, slot_bytes=4096,
                               offload_fraction="auto", device_budget_bytes=budget, **kw)
    c = opt.offload_choice
    assert c is not None and c.rates.host_step_elements_per_s is not None
    assert opt.offload_fraction >= 0.5 - 1e-9  # half the state at most fits
    gtrain(net, opt, data)
    gpu.synchronize()
    for p, q in zip(net.parameters(), ref.model.parameters()):
        assert torch.equal(gpu.read(p), gpu.read(q))
    assert device_bytes(opt) <= budget
    for rec in opt._lifecycle.part.params.values():
        assert gpu.accel.on_device(rec.master)


def test_a_ddp_wrapper_refuses_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    """(DTensor parameters take it, the ranks agreeing: ``test_full_offload_fsdp2.py``.)"""
    inject(monkeypatch, GPU_LIKE)
    opt = build(make_model(), budget=TOTAL // 2)  # a device part...
    assert opt.offload_fraction < 1.0
    with pytest.raises(ConfigError, match="offload_fraction < 1.*DistributedDataParallel"):
        opt._lifecycle.use_wrapper(object())  # ...and a wrapper found at a forward


def test_a_budget_below_accumulate_gpus_host_sums_says_what_they_are(
        monkeypatch: pytest.MonkeyPatch) -> None:
    inject(monkeypatch, GPU_LIKE)
    with pytest.raises(ConfigError, match=r"device_budget_bytes=64 .*FP32 gradient sums, "
                                          r"which accumulate='gpu' keeps on the device.*"
                                          r"accumulate='cpu'"):
        build(make_model(), budget=64, accumulate="gpu")
