"""``offload_fraction="auto"``: the fastest fraction whose device memory fits a budget,
by the step-time model of ``pipeoff/optim/_offload/_auto.py`` from measured rates. The
choice is checked with rates given (a GPU's, a CPU's), so it does not depend on this
machine's timing; training at the chosen fraction is bitwise torch's."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pipeoff import ConfigError
from pipeoff.optim import OffloadOptimizer
from pipeoff.optim._offload import _auto
from pipeoff.optim._offload._auto import Rates
from tests.gpu_device import Gpu
from tests.optim.test_offload import Net, assert_same, batches, make_net, train

GPU_LIKE = Rates(h2d_bytes_per_s=50e9, d2h_bytes_per_s=50e9, step_elements_per_s=3e11)
"""An H200 on PCIe 5: the link, not the device's kernels, bounds a host part."""
CPU_LIKE = Rates(h2d_bytes_per_s=10e9, d2h_bytes_per_s=10e9, step_elements_per_s=2e8)
"""A CPU: the step's kernels outlast the copies, so keeping state "on the device"
buys no time."""


@pytest.fixture
def rates(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Rates:
    r: Rates = getattr(request, "param", GPU_LIKE)
    monkeypatch.setattr(_auto, "measure_rates", lambda *a, **k: r)
    return r


def make_big() -> Net:
    """``Net`` with a wider hidden layer: 53 KB of AdamW state, room for chunks."""
    net = make_net()
    net.a, net.b = torch.nn.Linear(8, 512), torch.nn.Linear(512, 4)
    return net


def _sched(opt: Any) -> Any:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)


def _state_bytes(net: Net) -> int:
    return sum(8 * p.numel() for p in net.parameters())  # AdamW: two fp32 moments


def _auto_opt(net: Net, budget: Any, **kw: Any) -> OffloadOptimizer:
    return OffloadOptimizer(torch.optim.AdamW(net.parameters(), lr=1e-2), mode="overlap",
                            offload_fraction="auto", device_budget_bytes=budget, **kw)


@pytest.mark.parametrize("share", [0.3, 0.6])
def test_the_budget_bounds_the_device_memory_and_the_rest_is_on_the_host(
        rates: Rates, share: float) -> None:
    net = make_big()
    total = _state_bytes(net)
    budget = int(share * total)
    opt = _auto_opt(net, budget)
    choice = opt.offload_choice
    assert choice is not None and opt.offload_fraction == choice.fraction
    assert 0.0 < choice.fraction < 1.0
    assert choice.chunk_bytes * (choice.prefetch + 1) <= budget // _auto.STAGING_SHARE + 3
    ref = make_big()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    data = batches(4)
    train(ref, ref_opt, _sched(ref_opt), data)
    train(net, opt, _sched(opt), data)
    assert_same(ref, ref_opt, net, opt)
    stats = opt.memory_stats()
    assert stats["state_bytes_device"] + choice.staging_bytes <= budget
    assert stats["state_bytes_device"] > 0 and stats["state_bytes_host"] > 0
    # The fastest that fits: a larger device part would not fit the budget.
    mine = next(c for c in choice.candidates if c.fraction == choice.fraction)
    assert all(not c.fits or c.step_ms >= mine.step_ms / _auto.TIE for c in choice.candidates)


def test_a_budget_that_holds_all_the_state_keeps_it_all_on_the_device(rates: Rates) -> None:
    net = make_big()
    opt = _auto_opt(net, 2 * _state_bytes(net))
    assert opt.offload_fraction == 0.0
    assert opt._host.layout.split.on_device == frozenset(range(len(list(net.parameters()))))


def test_a_budget_of_exactly_the_state_counts_the_step_scalars(rates: Rates) -> None:
    """The device part's ``step`` tensors are device memory too (``memory_stats()`` counts
    them): a budget of the moments' bytes alone does not hold the whole state, and the
    device memory stays within the budget (it went 4 B per parameter over: a tester's
    find)."""
    net = make_big()
    budget = _state_bytes(net)
    opt = _auto_opt(net, budget)
    assert opt.offload_fraction > 0.0
    train(net, opt, _sched(opt), batches(2))
    choice = opt.offload_choice
    assert choice is not None
    stats = opt.memory_stats()
    assert stats["state_bytes_device"] + (choice.staging_bytes if choice.fraction else 0) \
        <= budget
    assert _auto.scalar_bytes(torch.optim.AdamW, {"lr": 1e-2}, torch.device("cpu")) == 4
    assert _auto.scalar_bytes(torch.optim.SGD, {"lr": 1e-2}, torch.device("cpu")) == 0


def test_where_the_device_part_buys_no_time_the_state_stays_on_the_host() -> None:
    """Ties go to the largest fraction: device memory is not spent for nothing (a CPU's
    kernels outlast the copies of 100 parameters of 1 MB of state, chunks of 1 MB)."""
    weights, elements = [1 << 20] * 100, 100 * (1 << 17)
    kw: dict[str, Any] = {"budget": 1 << 30, "budget_source": "device_budget_bytes",
                          "chunk_bytes": 1 << 20, "prefetch": 2}
    on_cpu = _auto.choose(weights, elements, rates=CPU_LIKE, **kw)
    assert on_cpu.fraction == 1.0
    assert "fastest fraction that fits" in on_cpu.reason
    on_gpu = _auto.choose(weights, elements, rates=GPU_LIKE, **kw)
    assert on_gpu.fraction == 0.0  # the link bounds the step: all of it on the device


def test_the_choice_is_in_repr_the_trace_and_the_step_stats(rates: Rates) -> None:
    net = make_big()
    opt = _auto_opt(net, _state_bytes(net) // 2)
    opt.attach(net)
    train(net, opt, _sched(opt), batches(2))
    f = opt.offload_fraction
    assert f"offload_fraction={f:.4g} (auto)" in repr(opt)
    trace = opt.last_trace
    assert trace is not None and trace.metadata["offload_fraction"] == f
    assert trace.metadata["offload_choice"]["fraction"] == f
    assert "device memory" in trace.metadata["offload_choice"]["reason"]
    assert opt.last_step_stats.offload_fraction == f
    assert opt.last_step_stats.as_dict()["pipeoff/offload_fraction"] == f


def test_a_checkpoint_of_an_auto_run_loads_into_torch_and_at_another_fraction(
        rates: Rates) -> None:
    net, ref = make_big(), make_big()
    opt = _auto_opt(net, _state_bytes(net) // 2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    data = batches(4)
    train(net, opt, _sched(opt), data[:2])
    train(ref, ref_opt, _sched(ref_opt), data[:2])
    sd = opt.state_dict()
    plain = torch.optim.AdamW(net.parameters(), lr=1e-2)
    plain.load_state_dict(sd)
    train(net, plain, _sched(plain), data[2:], first=2)
    train(ref, ref_opt, _sched(ref_opt), data[2:], first=2)
    assert_same(ref, ref_opt, net, plain)


@pytest.mark.parametrize(("kw", "match"), [
    ({"device_budget_bytes": None}, "offload_fraction='auto' needs device_budget_bytes"),
    ({"device_budget_bytes": 64}, "device_budget_bytes=64 .* cannot hold even the staging"),
    ({"device_budget_bytes": "lots"}, "device_budget_bytes"),
    ({"device_budget_bytes": 1 << 20, "mode": "single_pass"}, "needs a chunked mode"),
    ({"device_budget_bytes": 1 << 20, "prefetch": -1}, "prefetch"),
])
def test_auto_without_what_it_needs_is_a_clear_error(rates: Rates, kw: dict[str, Any],
                                                     match: str) -> None:
    kw = {"mode": "overlap", **kw}
    with pytest.raises(ConfigError, match=match):
        OffloadOptimizer(torch.optim.AdamW(make_big().parameters()), offload_fraction="auto",
                         **kw)


def test_the_rates_are_measured_on_the_parameters_device() -> None:
    net = make_big()
    r = _auto.measure_rates(torch.optim.AdamW(net.parameters(), fused=True), torch.device("cpu"),
                            pin=False, nbytes=1 << 16, numel=1 << 12)
    assert r.h2d_bytes_per_s > 0 and r.d2h_bytes_per_s > 0 and r.step_elements_per_s > 0


def test_the_model_prices_the_link_and_the_kernels() -> None:
    """More host bytes never make a step faster; with no host part it is the kernels."""
    t = [_auto.step_seconds(GPU_LIKE, elements=1 << 20, host_bytes=h, chunk_bytes=1 << 20,
                            bytes_per_element=8.0) for h in (0, 1 << 22, 1 << 23)]
    assert t[0] == (1 << 20) / GPU_LIKE.step_elements_per_s
    assert t[0] < t[1] < t[2]


def test_auto_on_the_device(gpu: Gpu, rates: Rates) -> None:
    """On CUDA streams (the simulated device, and a GPU): the choice within the budget
    (from the fixture's rates: it must not depend on timing), training bitwise torch's."""
    from tests.optim.test_offload_fraction import _device_net, _device_train

    ref = _device_net(gpu)
    ref_out = _device_train(gpu, ref, torch.optim.AdamW(ref.parameters(), lr=1e-3), 3)
    net = _device_net(gpu)
    total = sum(8 * p.numel() for p in net.parameters())
    opt = OffloadOptimizer(torch.optim.AdamW(net.parameters(), lr=1e-3), mode="overlap",
                           offload_fraction="auto", device_budget_bytes=total // 2)
    opt.attach(net)
    out = _device_train(gpu, net, opt, 3)
    opt.wait_for_step()
    gpu.synchronize()
    assert 0.0 < opt.offload_fraction < 1.0
    for a, b in zip(ref_out, out):
        assert torch.equal(gpu.read(a), gpu.read(b))
    for p, q in zip(ref.parameters(), net.parameters()):
        assert torch.equal(gpu.read(p), gpu.read(q))


@pytest.mark.parametrize("full", [False, True], ids=["offload", "full_offload"])
def test_auto_measures_without_firing_global_step_hooks(full: bool) -> None:
    """``"auto"`` times scratch optimizer steps at construction: torch's global step
    hooks (a step counter, a logger) must not see them (they saw 4 pre and 4 post)."""
    from pipeoff.optim import FullOffloadOptimizer
    from tests.optim.test_offload import global_step_hook_calls

    with global_step_hook_calls() as calls:
        model = torch.nn.Linear(16, 16)
        if full:
            FullOffloadOptimizer(model.to(torch.bfloat16), torch.optim.AdamW,
                                 offload_fraction="auto", device_budget_bytes=10_000)
        else:
            OffloadOptimizer(torch.optim.AdamW(model.parameters()), offload_fraction="auto",
                             device_budget_bytes=10_000)
    assert calls == []


def _digest(net: torch.nn.Module) -> str:
    """The parameters' bits, small enough for the ranks' result queue (a pipe)."""
    import hashlib

    return hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                   for p in net.parameters())).hexdigest()


def _ranks_choosing_apart(rank: int, world: int, port: int, queue: Any) -> None:
    """Each rank measures other rates and has another budget (a busy rank, another
    GPU's free memory): before they agreed, each chose its own fraction and the plan
    check failed on both, blaming an ``offload_fraction`` given the same everywhere
    (a tester's find, 4 runs in 5 with measured rates)."""
    import torch.distributed as dist

    from tests.optim.loops_worker import init

    init(rank, world, port)
    try:
        mine = (GPU_LIKE, CPU_LIKE)[rank]
        _auto.measure_rates = lambda *a, **k: mine  # type: ignore[assignment]
        torch.manual_seed(0)
        net = make_big()
        budget = (_state_bytes(net) // 2, _state_bytes(net) // 3)[rank]
        opt = _auto_opt(net, budget)
        choice = opt.offload_choice
        assert choice is not None
        train(net, opt, _sched(opt), batches(3))
        opt.wait_for_step()
        queue.put((rank, (opt.offload_fraction, choice.budget_bytes, choice.rates,
                          _digest(net))))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two processes
def test_ranks_agree_on_what_auto_chooses_from() -> None:
    from tests._two_ranks import run_two_ranks

    out = run_two_ranks(_ranks_choosing_apart)
    (f0, b0, r0, p0), (f1, b1, r1, p1) = out[0], out[1]
    assert (f0, b0, r0) == (f1, b1, r1)
    assert b0 == _state_bytes(make_big()) // 3  # the smallest budget,
    assert r0.step_elements_per_s == CPU_LIKE.step_elements_per_s  # the slowest rates
    assert p0 == p1  # (the same data on both ranks: the same steps)


def _one_rank_auto(rank: int, world: int, port: int, queue: Any) -> None:
    import datetime
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # (Without the check the ranks block in mismatched collectives: a failure, not a hang.)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        _auto.measure_rates = lambda *a, **k: GPU_LIKE  # type: ignore[assignment]
        net = make_big()
        fraction: Any = "auto" if rank == 0 else 0.5
        try:
            OffloadOptimizer(torch.optim.AdamW(net.parameters()), mode="overlap",
                             offload_fraction=fraction,
                             device_budget_bytes=_state_bytes(net) // 2 if rank == 0 else None)
            queue.put((rank, "built"))
        except Exception as err:  # noqa: BLE001 - reported: the test checks which
            queue.put((rank, f"{type(err).__name__}: {err}"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two processes
def test_auto_on_one_rank_only_is_refused_on_every_rank() -> None:
    """Only the rank asking for ``"auto"`` agreed, while the other was already in the plan
    check: the two collectives met and both ranks blocked until the group's timeout (a
    tester's find, 30 minutes under gloo's default)."""
    from tests._two_ranks import run_two_ranks

    out = run_two_ranks(_one_rank_auto)
    for rank in (0, 1):
        assert "given on some ranks of process_group and a number on others" in out[rank]
