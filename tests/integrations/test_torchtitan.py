"""pipeoff.integrations.torchtitan against torchtitan's own ``OptimizersContainer``.

Real torchtitan components (its container, ``default_adamw``, its LR schedulers, its
``clip_grad_norm_``, its flat checkpoints through ``torch.distributed.checkpoint``),
one process, CPU, FP32: the right value is torchtitan's own container on the same
model parts, bitwise. The loop is torchtitan's ``Trainer.train_step``: ``zero_grad``
in place (``training.disable_cuda_graphs=False``), two micro-batches, the clip over
every model part's parameters, ``step()``, the LR schedulers' ``step()``.
"""

from __future__ import annotations

import copy
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from pipeoff import ConfigError, UnsupportedOptimizerError
from pipeoff.integrations import torchtitan as titan
from pipeoff.optim import FullOffloadOptimizer, OffloadOptimizer

try:
    from torchtitan.components.optimizer import (
        LRSchedulersContainer,
        OptimizersContainer,
        ParamGroupConfig,
        default_adamw,
    )
except ImportError:  # every test but the import's is skipped
    HAVE_TORCHTITAN = False
else:
    HAVE_TORCHTITAN = True
try:  # torchtitan's train step clips with this (a PP-aware torch clip_grad_norm_)
    from torchtitan.distributed.utils import clip_grad_norm_
except ImportError:
    clip_grad_norm_ = torch.nn.utils.clip_grad_norm_

needs_torchtitan = pytest.mark.skipif(not HAVE_TORCHTITAN,
                                      reason="needs torchtitan (pip install torchtitan)")

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
              # torchtitan's LRSchedulersContainer.load_state_dict
              pytest.mark.filterwarnings("ignore:To get the last learning rate"),
              pytest.mark.filterwarnings("ignore:pipeoff. pinned host memory")]

MAX_NORM = 0.05  # below every step's norm here: torchtitan's clip scales every step
STEPS = 3
MICRO = 2  # gradient accumulation steps

class Stage(nn.Module):
    """A pipeline stage as torchtitan names one: ``layers.<global index>``."""

    def __init__(self, first: int, n: int, dim: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({
            str(i): nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
            for i in range(first, first + n)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = x + layer(x)
        return x


def model_parts(n: int, dtype: torch.dtype = torch.float32) -> list[nn.Module]:
    """Four layers, as one part or as ``n`` pipeline stages (same weights either way)."""
    torch.manual_seed(0)
    per = 4 // n
    return [Stage(k * per, per).to(dtype) for k in range(n)]


def batches(steps: int = STEPS) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [[torch.randn(4, 8, generator=g) * 3 for _ in range(MICRO)] for _ in range(steps)]


def train(parts: list[nn.Module], opt: Any, scheds: Any, data: list[list[torch.Tensor]]
          ) -> list[float]:
    """torchtitan's train_step, once per element of ``data``; the clip norms."""
    norms = []
    for micro in data:
        opt.zero_grad(set_to_none=False)
        for x in micro:
            for part in parts:
                x = part(x.to(next(part.parameters()).dtype))
            x.float().pow(2).mean().backward()
        norm = clip_grad_norm_([p for m in parts for p in m.parameters()], MAX_NORM,
                               foreach=True)
        opt.step()
        scheds.step()
        norms.append(float(norm))
    return norms


def schedulers(opt: Any) -> Any:
    return LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=opt,
                                                              training_steps=10)


def config(**overrides: Any) -> Any:
    """Two param groups (no weight decay on biases), as torchtitan configs write them."""
    adamw = default_adamw(lr=1e-2).param_groups[0]
    cfg = OptimizersContainer.Config(param_groups=[
        ParamGroupConfig(pattern=r"\.bias$", optimizer_name="AdamW",
                         optimizer_kwargs={**adamw.optimizer_kwargs, "weight_decay": 0.0}),
        adamw])
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def bits(parts: list[nn.Module]) -> list[torch.Tensor]:
    return [p.detach().reshape(-1).view(torch.int32).clone()
            for m in parts for p in m.parameters()]


def same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v.reshape(-1).view(torch.int32) if v.dim() else v,
                               b[k].reshape(-1).view(torch.int32) if b[k].dim() else b[k]), k
        else:
            assert v == b[k], k


def cases() -> list[Any]:
    out = []
    for parts in (1, 2):
        for full in (False, True):
            for overlap in ("forward", "none"):
                out.append(pytest.param(parts, full, overlap,
                                        id=f"{parts}part-{'full' if full else 'state'}-{overlap}"))
    return out


# -- stepping ------------------------------------------------------------------------------
@needs_torchtitan
@pytest.mark.parametrize(("n_parts", "full_offload", "overlap"), cases())
def test_steps_bitwise_torchtitans_container(n_parts: int, full_offload: bool,
                                             overlap: str) -> None:
    ref = model_parts(n_parts)
    parts = copy.deepcopy(ref)
    init = bits(ref)
    want_opt = config().build(model_parts=ref)
    # chunk_bytes: several chunks per step (a layer's state is 2.4 KiB, its masters 1.2 KiB)
    opt = titan.build_optimizers(parts, config(), full_offload=full_offload, overlap=overlap,
                                 chunk_bytes=2048)
    kind = FullOffloadOptimizer if full_offload else OffloadOptimizer
    assert [type(o) for o in opt.optimizers] == [kind] * n_parts
    want = train(ref, want_opt, schedulers(want_opt), batches())
    got = train(parts, opt, schedulers(opt), batches())
    assert all(n > MAX_NORM for n in want)  # the clip scaled every step
    assert got == want
    got_bits, want_bits = bits(parts), bits(ref)
    assert all(torch.equal(a, b) for a, b in zip(got_bits, want_bits))
    assert not any(torch.equal(a, b) for a, b in zip(got_bits, init))
    assert [g["lr"] for o in opt.optimizers for g in o.param_groups] == [
        g["lr"] for o in want_opt.optimizers for g in o.param_groups]
    same_state(want_opt.state_dict(), opt.state_dict())


@needs_torchtitan
@pytest.mark.parametrize("implementation", ["foreach", "for-loop"])
@pytest.mark.parametrize("full_offload", [False, True], ids=["state", "full"])
def test_implementations(full_offload: bool, implementation: str) -> None:
    ref = model_parts(1)
    parts = copy.deepcopy(ref)
    want_opt = config(implementation=implementation).build(model_parts=ref)
    opt = titan.build_optimizers(parts, config(implementation=implementation),
                                 full_offload=full_offload)
    assert train(parts, opt, schedulers(opt), batches()) == train(
        ref, want_opt, schedulers(want_opt), batches())
    assert all(torch.equal(a, b) for a, b in zip(bits(parts), bits(ref)))


# -- checkpoints ---------------------------------------------------------------------------
@needs_torchtitan
@pytest.mark.parametrize("full_offload", [False, True], ids=["state", "full"])
def test_state_dict_keys_are_torchtitans(full_offload: bool) -> None:
    ref, parts = model_parts(2), model_parts(2)
    init = bits(parts)
    want_opt = config().build(model_parts=ref)
    opt = titan.build_optimizers(parts, config(), full_offload=full_offload)
    # Before any step: torchtitan creates the state with a zero-lr, zero-grad step.
    fresh = opt.state_dict()
    assert all(torch.equal(a, b) for a, b in zip(bits(parts), init))  # (weights untouched)
    same_state(want_opt.state_dict(), fresh)
    assert {k.split(".")[0] for k in fresh} == {"state", "param_groups"}
    assert "param_groups.layers.0.0.bias.weight_decay" in fresh
    assert "state.layers.3.2.weight.exp_avg_sq" in fresh


@needs_torchtitan
@pytest.mark.parametrize("full_offload", [False, True], ids=["state", "full"])
@pytest.mark.parametrize("saver", ["torchtitan", "pipeoff"])
def test_checkpoint_into_the_other_container(saver: str, full_offload: bool,
                                             tmp_path: Path) -> None:
    """dcp.save with one container, dcp.load (strict, as torchtitan's checkpointer) into
    the other, two more steps: bitwise torchtitan's uninterrupted run."""
    import torch.distributed.checkpoint as dcp

    data = batches(4)
    ref = model_parts(1)
    ref_opt = config().build(model_parts=ref)
    ref_sched = schedulers(ref_opt)
    want = train(ref, ref_opt, ref_sched, data)

    def container(parts: list[nn.Module], ours: bool) -> Any:
        return (titan.build_optimizers(parts, config(), full_offload=full_offload) if ours
                else config().build(model_parts=parts))

    src_parts, dst_parts = model_parts(1), model_parts(1)
    src = container(src_parts, saver == "pipeoff")
    src_sched = schedulers(src)
    got = train(src_parts, src, src_sched, data[:2])
    dcp.save({"model": src_parts[0].state_dict(), "optimizer": src,
              "lr_scheduler": src_sched}, checkpoint_id=str(tmp_path))
    dst = container(dst_parts, saver != "pipeoff")
    dst_sched = schedulers(dst)
    dcp.load({"model": dst_parts[0].state_dict(), "optimizer": dst,
              "lr_scheduler": dst_sched}, checkpoint_id=str(tmp_path))  # (in place)
    got += train(dst_parts, dst, dst_sched, data[2:])
    assert got == want
    assert all(torch.equal(a, b) for a, b in zip(bits(dst_parts), bits(ref)))
    same_state(ref_opt.state_dict(), dst.state_dict())


@needs_torchtitan
def test_low_precision_weights_save_their_masters(tmp_path: Path) -> None:
    """A BF16 weight is not its FP32 master: the checkpoint keeps the master, and a
    resumed run is bitwise the uninterrupted one."""
    import torch.distributed.checkpoint as dcp

    data = batches(4)
    ref = model_parts(1, torch.bfloat16)
    ref_opt = titan.build_optimizers(ref, config(), full_offload=True)
    want = train(ref, ref_opt, schedulers(ref_opt), data)

    src_parts, dst_parts = model_parts(1, torch.bfloat16), model_parts(1, torch.bfloat16)
    src = titan.build_optimizers(src_parts, config(), full_offload=True)
    src_sched = schedulers(src)
    got = train(src_parts, src, src_sched, data[:2])
    sd = src.state_dict()
    names = [n for n, _ in src_parts[0].named_parameters()]
    assert {k for k in sd if k.endswith(".master")} == {f"state.{n}.master" for n in names}
    assert all(sd[f"state.{n}.master"].dtype == torch.float32 for n in names)
    dcp.save({"model": src_parts[0].state_dict(), "optimizer": src,
              "lr_scheduler": src_sched}, checkpoint_id=str(tmp_path))
    dst = titan.build_optimizers(dst_parts, config(), full_offload=True)
    dst_sched = schedulers(dst)
    dcp.load({"model": dst_parts[0].state_dict(), "optimizer": dst,
              "lr_scheduler": dst_sched}, checkpoint_id=str(tmp_path))
    got += train(dst_parts, dst, dst_sched, data[2:])
    assert got == want
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16))
               for a, b in zip(dst_parts[0].parameters(), ref[0].parameters()))


# -- what LocalSGD calls -------------------------------------------------------------------
@needs_torchtitan
@pytest.mark.parametrize("full_offload", [False, True], ids=["state", "full"])
def test_weights_written_outside_then_refresh_masters(full_offload: bool) -> None:
    """A committed LocalSGD average writes the weights through ``.data``; after
    ``wait_for_step()`` and ``refresh_masters()`` (what pipeoff.ft.LocalSGD calls) the
    next steps start from it, as torch's optimizers do."""
    ref, parts = model_parts(1), model_parts(1)
    ref_opt = config().build(model_parts=ref)
    opt = titan.build_optimizers(parts, config(), full_offload=full_offload)
    ref_sched, sched = schedulers(ref_opt), schedulers(opt)
    data = batches(4)
    train(ref, ref_opt, ref_sched, data[:2])
    train(parts, opt, sched, data[:2])
    opt.wait_for_step()
    for m in (ref[0], parts[0]):
        for p in m.parameters():
            p.data.mul_(0.5)  # (the "average")
    opt.refresh_masters()
    assert train(parts, opt, sched, data[2:]) == train(ref, ref_opt, ref_sched, data[2:])
    assert all(torch.equal(a, b) for a, b in zip(bits(parts), bits(ref)))


# -- the API -------------------------------------------------------------------------------
@needs_torchtitan
def test_the_config_builds_the_container() -> None:
    cls = titan.PipeoffOptimizersContainer
    assert issubclass(cls, OptimizersContainer)
    assert cls.__module__ == "pipeoff.integrations.torchtitan"
    assert cls.Config.__qualname__ == "PipeoffOptimizersContainer.Config"
    cfg = cls.Config(param_groups=default_adamw(lr=1e-3).param_groups, full_offload=True,
                     chunk_bytes="1MiB", offload_kwargs={"slots": 2})
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    parts = model_parts(1)
    opt = cfg.build(model_parts=parts)  # as torchtitan's Trainer builds it
    assert type(opt) is cls
    (inner,) = opt.optimizers
    assert isinstance(inner, FullOffloadOptimizer)
    assert (inner.slots, inner.chunk_numel, inner.overlap) == (2, 1 << 18, "forward")
    state = titan.build_optimizers(model_parts(1), default_adamw(lr=1e-3), chunk_bytes=4096,
                                   offload_kwargs={"prefetch": 1}, overlap="none")
    (inner,) = state.optimizers
    assert isinstance(inner, OffloadOptimizer)
    assert (inner.mode, inner.chunk_bytes, inner.prefetch) == ("chunked", 4096, 1)
    # A pipeoff Config given to build_optimizers keeps its fields unless overridden.
    again = titan.build_optimizers(model_parts(1), cfg, offload_kwargs={})
    assert isinstance(again.optimizers[0], FullOffloadOptimizer)
    assert again.optimizers[0].slots == 4


@pytest.mark.slow  # runs a Python interpreter (subprocess)
def test_import_costs_nothing_until_used() -> None:
    """``import pipeoff.integrations.torchtitan`` imports no torchtitan; the class does
    (or says that torchtitan is missing). Runs without torchtitan too."""
    code = ("import sys, pipeoff.integrations.torchtitan as t\n"
            "assert 'torchtitan' not in sys.modules, 'imported at import'\n"
            "assert {'PipeoffOptimizersContainer', 'build_optimizers'} <= set(dir(t))\n"
            "try:\n"
            "    t.PipeoffOptimizersContainer\n"
            "except ModuleNotFoundError as err:\n"
            "    assert 'pip install torchtitan' in str(err), err\n"
            "    print('missing')\n"
            "else:\n"
            "    assert 'torchtitan.components.optimizer' in sys.modules\n"
            "    print('imported')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["imported" if HAVE_TORCHTITAN else "missing"]
    with pytest.raises(AttributeError, match="'PipeoffOptimizer'$"):
        titan.PipeoffOptimizer  # noqa: B018


@needs_torchtitan
@pytest.mark.parametrize(("fields", "names"), [
    ({"full_offload": "yes"}, "full_offload"),
    ({"overlap": "backward"}, "overlap"),
    ({"overlap": "sideways"}, "overlap"),
    ({"chunk_bytes": "lots"}, "chunk_bytes"),
    ({"chunk_bytes": 0}, "chunk_bytes"),
    ({"implementation": "fused_opt_states_bf16"}, "implementation"),
    ({"offload_kwargs": {"max_norm": 1.0}}, "max_norm"),
    ({"offload_kwargs": {"mode": "overlap"}}, "'mode'"),
    ({"offload_kwargs": {"prefetchh": 1}}, "'prefetchh'"),
    ({"full_offload": True, "offload_kwargs": {"prefetch": 1}}, "'prefetch'"),
    ({"offload_kwargs": ["prefetch"]}, "offload_kwargs"),
])
def test_bad_config_fields_raise_config_error(fields: dict[str, Any], names: str) -> None:
    with pytest.raises(ConfigError, match=names):
        titan.PipeoffOptimizersContainer.Config(
            param_groups=default_adamw().param_groups, **fields)
    cfg = default_adamw()
    if "implementation" in fields:
        cfg.implementation = fields.pop("implementation")
    with pytest.raises(ConfigError, match=names):
        titan.build_optimizers(model_parts(1), cfg, **fields)


@needs_torchtitan
def test_bad_build_arguments_raise_config_error() -> None:
    parts = model_parts(1)
    with pytest.raises(ConfigError, match="model_parts"):
        titan.build_optimizers(parts[0], default_adamw())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="model_parts"):
        titan.build_optimizers([], default_adamw())
    with pytest.raises(ConfigError, match="optimizer_config"):
        titan.build_optimizers(parts, {"lr": 1e-3})
    with pytest.raises(ConfigError, match="config"):
        titan.PipeoffOptimizersContainer(default_adamw(), model_parts=parts)


@needs_torchtitan
def test_optimizers_that_are_not_elementwise_are_refused() -> None:
    cfg = OptimizersContainer.Config(param_groups=[ParamGroupConfig(
        pattern=".*", optimizer_name="DistMuon", optimizer_kwargs={"lr": 1e-3})])
    with pytest.raises(UnsupportedOptimizerError, match="DistMuon"):
        titan.build_optimizers(model_parts(1), cfg)
