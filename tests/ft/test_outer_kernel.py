"""DiLoCo's native outer steps (``pipeoff.ft._outer_kernel``): bitwise torch's CPU
``torch.optim.SGD``, ``Adam`` and ``AdamW`` in every configuration they take, torch's
own step for the rest, a self-test that turns a wrong kernel off, and the real
DiLoCo sync taking them."""

from __future__ import annotations

import copy
import logging
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import optim

from pipeoff import _native
from pipeoff.ft import _outer_kernel
from pipeoff.ft._outer import HostOuterOptimizer
from pipeoff.optim._full_offload._host_kernel import _values


@pytest.fixture
def native() -> None:
    """Skips where the native kernels cannot be built (no C compiler)."""
    if _native.library() is None:
        pytest.skip(f"no native kernels: {_native.unavailable_reason()}")


needs_native = pytest.mark.usefixtures("native")


@pytest.fixture
def fresh() -> Iterator[None]:
    """The kernel decision forgotten before and after (the build cache kept)."""
    _native._reset_for_tests()
    _outer_kernel._reset_for_tests()
    yield
    _native._reset_for_tests()
    _outer_kernel._reset_for_tests()


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes the native step was called for (outside its self-test)."""
    seen: list[int] = []
    real = _outer_kernel.OuterKernel.step

    def spy(self: Any, param: torch.Tensor, *a: Any, **k: Any) -> None:
        if threading.current_thread().name != "pipeoff-self-test":
            seen.append(param.numel())
        real(self, param, *a, **k)

    monkeypatch.setattr(_outer_kernel.OuterKernel, "step", spy)
    return seen


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int32)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(_bits(a), _bits(b))


CONFIGS = {
    "diloco-nesterov": {"lr": 0.7, "momentum": 0.9, "nesterov": True},
    "plain": {"lr": 0.5},
    "momentum-dampening": {"lr": 0.1, "momentum": 0.8, "dampening": 0.25},
    "weight-decay-maximize": {"lr": 0.3, "momentum": 0.9, "nesterov": True,
                              "weight_decay": 0.05, "maximize": True},
    "weight-decay-only": {"lr": 1e-2, "weight_decay": 0.1},
}


ADAM_CONFIGS: dict[str, tuple[type[optim.Optimizer], dict[str, Any]]] = {
    "adamw-outer": (optim.AdamW, {"lr": 0.7, "betas": (0.9, 0.95), "weight_decay": 0.1}),
    "adamw-defaults": (optim.AdamW, {"lr": 1e-3}),
    "adam-l2-maximize": (optim.Adam, {"lr": 1e-2, "betas": (0.8, 0.99), "weight_decay": 0.01,
                                      "maximize": True}),
    "adam-plain": (optim.Adam, {"lr": 0.1, "eps": 1e-6}),
    "adam-decoupled": (optim.Adam, {"lr": 0.1, "weight_decay": 0.05,
                                    "decoupled_weight_decay": True}),
}


def _host_pair(kw: dict[str, Any], shapes: list[tuple[int, ...]], seed: int = 0,
               cls: type[optim.Optimizer] = optim.SGD,
               ) -> tuple[HostOuterOptimizer, optim.Optimizer, list[torch.Tensor],
                          list[torch.Tensor]]:
    """A HostOuterOptimizer over host copies of ``shapes``, and torch's ``cls`` over others."""
    gen = torch.Generator().manual_seed(seed)
    device = [torch.nn.Parameter(_values(int(torch.Size(s).numel()), gen)[0].view(s))
              for s in shapes]
    host = [p.detach().clone() for p in device]
    ref = [p.detach().clone() for p in device]
    user = cls(device, **kw)
    mirror = HostOuterOptimizer(user, {id(p): h for p, h in zip(device, host)})
    return mirror, cls(ref, **kw), host, ref


@needs_native
@pytest.mark.parametrize("config", list(CONFIGS))
def test_bitwise_torchs_sgd_over_steps_and_value_classes(config: str, calls: list[int]) -> None:
    """Subnormals, infinities, NaNs and signed zeros included; a length torch splits
    over its threads; three steps (the momentum buffer's first step and later)."""
    kw = CONFIGS[config]
    shapes = [(7,), (33, 5), (100_003,), (0,)]
    mirror, ref_opt, host, ref = _host_pair(kw, shapes)
    gen = torch.Generator().manual_seed(9)
    for _ in range(3):
        grads = [_values(h.numel(), gen)[1].view(h.shape) for h in host]
        mirror.step(list(zip(host, grads)))
        for r, g in zip(ref, grads):
            r.grad = g.clone()
        ref_opt.step()
        assert all(_same(a, b) for a, b in zip(host, ref))
    assert len(calls) == 3 * len(shapes)
    mine, theirs = mirror.state_dict(), ref_opt.state_dict()
    assert mine["param_groups"] == theirs["param_groups"]
    assert mine["state"].keys() == theirs["state"].keys()
    for k, st in theirs["state"].items():
        assert st.keys() == mine["state"][k].keys()
        assert _same(mine["state"][k]["momentum_buffer"], st["momentum_buffer"])


def _nan_same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise, a NaN matching any NaN (torch's own passes propagate one operand's payload
    or the other's; which is not a property of the math)."""
    an, bn = a.isnan(), b.isnan()
    return (a.shape == b.shape and a.dtype == b.dtype and torch.equal(an, bn)
            and torch.equal(_bits(a)[~an], _bits(b)[~bn]))


@needs_native
@pytest.mark.parametrize("config", list(ADAM_CONFIGS))
def test_bitwise_torchs_adam_over_steps_and_value_classes(
        config: str, calls: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's for-loop Adam/AdamW (a CPU Adam's default): the parameters, both moments
    and the step counter, over value classes, a length torch splits over its threads,
    one the kernel steps in several rounds (chunks) and three steps; ``state_dict()``
    in torch's format."""
    monkeypatch.setattr(_outer_kernel, "_ADAM_CHUNK", 1 << 18)  # (3, 400_003): 5 rounds
    cls, kw = ADAM_CONFIGS[config]
    shapes = [(7,), (33, 5), (100_003,), (3, 400_003), (0,)]
    mirror, ref_opt, host, ref = _host_pair(kw, shapes, cls=cls)
    gen = torch.Generator().manual_seed(11)
    for _ in range(3):
        grads = [_values(h.numel(), gen)[1].view(h.shape) for h in host]
        mirror.step(list(zip(host, grads)))
        for r, g in zip(ref, grads):
            r.grad = g.clone()
        ref_opt.step()
        assert all(_nan_same(a, b) for a, b in zip(host, ref))
    assert len(calls) == 3 * len(shapes)
    mine, theirs = mirror.state_dict(), ref_opt.state_dict()
    assert mine["param_groups"] == theirs["param_groups"]
    assert mine["state"].keys() == theirs["state"].keys()
    for k, st in theirs["state"].items():
        assert list(st) == list(mine["state"][k])  # torch's keys, in torch's order
        for name, t in st.items():
            assert _nan_same(mine["state"][k][name], t), (k, name)


@needs_native
def test_adam_continues_torchs_state_and_edited_hyperparameters(calls: list[int]) -> None:
    """Moments and a step counter torch's AdamW made (a checkpoint) are continued; an
    edited ``lr`` and ``betas`` are the ones stepped with."""
    cls, kw = ADAM_CONFIGS["adamw-outer"]
    mirror, ref_opt, host, ref = _host_pair(kw, [(64,), (9, 3)], cls=cls)
    grads = [torch.randn(h.shape) for h in host]
    for r, g in zip(ref, grads):
        r.grad = g.clone()
    ref_opt.step()
    mirror.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
    for h, r in zip(host, ref):
        h.copy_(r)
    for lr, betas in ((0.5, (0.9, 0.95)), (0.25, (0.8, 0.9))):
        for opt in (mirror.user, ref_opt):
            opt.param_groups[0].update(lr=lr, betas=betas)
        mirror.sync_from_user()
        grads = [torch.randn(h.shape) for h in host]
        mirror.step(list(zip(host, grads)))
        for r, g in zip(ref, grads):
            r.grad = g.clone()
        ref_opt.step()
        assert all(_same(a, b) for a, b in zip(host, ref))
    assert calls
    st = mirror.state_dict()["state"][0]
    assert float(st["step"]) == 3.0 and st["step"].dtype == torch.float32


@needs_native
def test_the_step_continues_torchs_state_and_edited_hyperparameters(calls: list[int]) -> None:
    """State that torch's SGD made (a loaded checkpoint) is continued, and an ``lr``
    edited between syncs (a schedule) is the one stepped with."""
    kw = CONFIGS["diloco-nesterov"]
    mirror, ref_opt, host, ref = _host_pair(kw, [(64,), (9, 3)])
    grads = [torch.randn(h.shape) for h in host]
    for r, g in zip(ref, grads):
        r.grad = g.clone()
    ref_opt.step()  # torch's first step, into a checkpoint
    mirror.load_state_dict(copy.deepcopy(ref_opt.state_dict()))  # (as from a file)
    for h, r in zip(host, ref):
        h.copy_(r)
    for lr in (0.5, 0.25):
        mirror.user.param_groups[0]["lr"] = lr
        mirror.sync_from_user()
        ref_opt.param_groups[0]["lr"] = lr
        grads = [torch.randn(h.shape) for h in host]
        mirror.step(list(zip(host, grads)))
        for r, g in zip(ref, grads):
            r.grad = g.clone()
        ref_opt.step()
        assert all(_same(a, b) for a, b in zip(host, ref))
    assert calls


@needs_native
@pytest.mark.parametrize("why", ["foreach", "tensor-lr", "bf16", "amsgrad", "beta1-half",
                                 "adam-foreach"])
def test_what_the_kernel_does_not_take_runs_torchs_step(why: str, calls: list[int]) -> None:
    dtype = torch.bfloat16 if why == "bf16" else torch.float32
    device = [torch.nn.Parameter(torch.randn(40, dtype=dtype))]
    host = [device[0].detach().clone()]
    ref = [device[0].detach().clone()]
    kw: dict[str, Any] = {"lr": torch.tensor(0.5) if why == "tensor-lr" else 0.5,
                          "momentum": 0.9}
    if why == "foreach":
        kw["foreach"] = True

    def make(ps: Any) -> optim.Optimizer:
        if why == "amsgrad":
            return optim.Adam(ps, lr=0.5, amsgrad=True)
        if why == "beta1-half":  # torch's lerp rounds its body and tails apart there
            return optim.AdamW(ps, lr=0.5, betas=(0.5, 0.9))
        if why == "adam-foreach":
            return optim.AdamW(ps, lr=0.5, foreach=True)
        return optim.SGD(ps, **kw)

    mirror = HostOuterOptimizer(make(device), {id(device[0]): host[0]})
    ref_opt = make(ref)
    for _ in range(2):
        g = torch.randn(40, dtype=dtype)
        mirror.step([(host[0], g)])
        ref[0].grad = g.clone()
        ref_opt.step()
    assert _same(host[0], ref[0])
    assert calls == []


def test_sgd_hyper_names_what_it_takes() -> None:
    group = {"lr": 0.7, "momentum": 0.9, "dampening": 0, "weight_decay": 0,
             "nesterov": True, "maximize": False, "foreach": None, "fused": None,
             "differentiable": False}
    hyper = _outer_kernel.sgd_hyper(optim.SGD, group)
    assert hyper == _outer_kernel.SgdHyper(lr=0.7, momentum=0.9, dampening=0.0,
                                           weight_decay=0.0, nesterov=True, maximize=False)
    for change in ({"foreach": True}, {"fused": True}, {"differentiable": True},
                   {"lr": torch.tensor(0.7)}, {"weight_decay": torch.tensor(0.1)}):
        assert _outer_kernel.sgd_hyper(optim.SGD, {**group, **change}) is None, change
    assert _outer_kernel.sgd_hyper(optim.Adam, group) is None


def test_adam_hyper_names_what_it_takes() -> None:
    group = {"lr": 0.7, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1,
             "amsgrad": False, "maximize": False, "foreach": None, "fused": None,
             "capturable": False, "differentiable": False, "decoupled_weight_decay": True}
    hyper = _outer_kernel.adam_hyper(optim.AdamW, group)
    assert hyper == _outer_kernel.AdamHyper(lr=0.7, beta1=0.9, beta2=0.95, eps=1e-8,
                                            weight_decay=0.1, decoupled=True, maximize=False)
    assert _outer_kernel.outer_hyper(optim.AdamW, group) == hyper
    for change in ({"foreach": True}, {"fused": True}, {"amsgrad": True},
                   {"capturable": True}, {"lr": torch.tensor(0.7)},
                   {"betas": (0.5, 0.95)}, {"betas": (0.0, 0.95)}, {"betas": (0.9, 1.0)},
                   {"betas": (torch.tensor(0.9), 0.95)}):
        assert _outer_kernel.adam_hyper(optim.AdamW, {**group, **change}) is None, change
    assert _outer_kernel.adam_hyper(optim.SGD, group) is None
    plain_adam = {k: v for k, v in group.items() if k != "decoupled_weight_decay"}
    adam = _outer_kernel.adam_hyper(optim.Adam, plain_adam)
    assert adam is not None and not adam.decoupled  # Adam's L2 term


@needs_native
def test_a_kernel_that_differs_from_torch_is_turned_off_with_a_warning(
        monkeypatch: pytest.MonkeyPatch, fresh: None, calls: list[int]) -> None:
    level = torch.backends.cpu.get_cpu_capability()
    if level not in _outer_kernel.ATEN_FMA:
        pytest.skip(f"no kernel at dispatch level {level}")
    # the wrong rounding: an fma where torch has none, or none where it has one
    monkeypatch.setitem(_outer_kernel.ATEN_FMA, level, 1 - _outer_kernel.ATEN_FMA[level])  # type: ignore[index]
    with pytest.warns(RuntimeWarning, match="self-test against torch's optimizers failed"):
        assert _outer_kernel.outer_kernel() is None
    assert _outer_kernel.outer_step_status().startswith("torch: its self-test")
    mirror, ref_opt, host, ref = _host_pair(CONFIGS["diloco-nesterov"], [(50,)])
    g = torch.randn(50)
    mirror.step([(host[0], g)])
    ref[0].grad = g.clone()
    ref_opt.step()
    assert _same(host[0], ref[0]) and calls == []  # torch's step, the same bits


def test_no_compiler_says_so_on_the_logger_and_steps_with_torch(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path,
        fresh: None) -> None:
    monkeypatch.setenv("PIPEOFF_CACHE_DIR", str(tmp_path / "cache"))  # nothing built
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with warnings.catch_warnings(), caplog.at_level(logging.INFO, logger="pipeoff"):
        warnings.simplefilter("error")
        assert _outer_kernel.outer_kernel() is None
        mirror, ref_opt, host, ref = _host_pair(CONFIGS["diloco-nesterov"], [(50,)])
        g = torch.randn(50)
        mirror.step([(host[0], g)])
    ref[0].grad = g.clone()
    ref_opt.step()
    assert _same(host[0], ref[0])
    said = [r.getMessage() for r in caplog.records if "native outer step" in r.getMessage()]
    assert len(said) == 1 and "nonexistent" in said[0], said


def test_pipeoff_native_0_turns_it_off_silently(monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture,
                                                fresh: None) -> None:
    monkeypatch.setenv("PIPEOFF_NATIVE", "0")
    with warnings.catch_warnings(), caplog.at_level(logging.INFO, logger="pipeoff"):
        warnings.simplefilter("error")
        assert _outer_kernel.outer_kernel() is None
    assert not [r for r in caplog.records if "native outer step" in r.getMessage()]
    assert "PIPEOFF_NATIVE" in _outer_kernel.outer_step_status()


@needs_native
def test_bad_tensors_are_refused_by_name() -> None:
    kernel = _outer_kernel.outer_kernel()
    if kernel is None:
        pytest.skip(_outer_kernel.outer_step_status())
    hyper = _outer_kernel.sgd_hyper(optim.SGD, {"lr": 0.1, "momentum": 0.9, "dampening": 0,
                                                "weight_decay": 0})
    assert hyper is not None
    with pytest.raises(ValueError, match="grad must be a contiguous FP32"):
        kernel.sgd_step(torch.zeros(4), torch.zeros(4, dtype=torch.bfloat16), {}, hyper,
                        threads=1)
    with pytest.raises(ValueError, match="momentum_buffer must be"):
        kernel.sgd_step(torch.zeros(4), torch.zeros(4), {"momentum_buffer": torch.zeros(3)},
                        hyper, threads=1)


# -- in the real sync -------------------------------------------------------------------
def _outer_adamw(ps: Any) -> optim.Optimizer:
    return optim.AdamW(ps, lr=0.7, betas=(0.9, 0.95), weight_decay=0.1)


@needs_native
@pytest.mark.timeout(120)
@pytest.mark.parametrize("outer", ["sgd-nesterov", "adamw"])
def test_the_pipelined_sync_steps_natively_bitwise_torchft(outer: str,
                                                           calls: list[int]) -> None:
    """Two replicas behind a real Lighthouse, torchft's outer SGD with Nesterov (or an
    outer AdamW): the sync's outer step is the native one, and the replicas are
    torchft's bit for bit."""
    from tests.ft._diloco_replicas import assert_bitwise
    from tests.ft.test_diloco import reference, run

    cfg: dict[str, Any] = {"sync_every": 4, "fragment_sync_delay": 1,
                           "fragment_update_alpha": 0.5, "n_fragments": 2}
    if outer == "adamw":
        cfg["outer"] = _outer_adamw
    assert_bitwise(run("pipelined", **cfg), reference(**cfg))
    assert calls


@needs_native
@pytest.mark.parametrize("outer", ["sgd", "adamw"])
def test_on_the_simulated_device_only_host_memory_reaches_the_kernel(outer: str,
                                                                     calls: list[int]) -> None:
    """Native code must not touch device memory: tensors the (simulated) accelerator
    counts as device memory step with torch; pinned host backups step natively, with
    the accesses announced to the device's checker, bitwise torch."""
    from pipeoff import _accel
    from pipeoff.testing import simulated_cuda

    cls, kw = (optim.SGD, CONFIGS["diloco-nesterov"]) if outer == "sgd" \
        else ADAM_CONFIGS["adamw-outer"]
    gen = torch.Generator().manual_seed(3)
    start = _values(300, gen)[0]
    grads = [_values(300, gen)[1] for _ in range(2)]
    ref = [start.clone()]
    ref_opt = cls(ref, **kw)
    for g in grads:
        ref[0].grad = g.clone()
        ref_opt.step()
    with simulated_cuda() as device:
        accel = _accel.current()
        for pinned in (False, True):
            calls.clear()
            user_p = torch.nn.Parameter(start.clone())
            if pinned:
                host = device.host_empty((300,), torch.float32, pinned=True)
                host.copy_(start)
                g_host = [device.host_empty((300,), torch.float32, pinned=True) for _ in grads]
                for a, b in zip(g_host, grads):
                    a.copy_(b)
            else:
                host, g_host = start.clone(), [g.clone() for g in grads]  # "device" memory
                assert accel.on_device(host)
            mirror = HostOuterOptimizer(cls([user_p], **kw), {id(user_p): host})
            for g in g_host:
                mirror.step([(host, g)])
            assert _nan_same(host, ref[0]), pinned
            assert (calls == [300, 300]) if pinned else (calls == []), (pinned, calls)
