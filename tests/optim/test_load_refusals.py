"""A checkpoint whose state torch's step could not take is refused whole by both
optimizers' ``load_state_dict()``, naming the parameter and the key; nothing is loaded
and training goes on bitwise as if the load had not been tried.

Found by a tester: a meta or sparse state tensor, ``step=None``, a missing ``step`` or
``exp_avg`` loaded the parameters before the bad one and failed inside torch (errors
naming neither), leaving the optimizer half-loaded: later steps raised ``KeyError`` or
(``OffloadOptimizer``) stepped on a mix of two checkpoints; a missing moment tore the
next step (earlier chunks had stepped)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from pipeoff import ConfigError
from pipeoff.optim import FullOffloadOptimizer, OffloadOptimizer


def make_model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(dtype)


def build(kind: str, model: nn.Module) -> Any:
    if kind == "full":
        return FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, overlap="forward")
    if kind == "full-0.5":
        return FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, offload_fraction=0.5)
    return OffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, overlap="forward")


def train(model: nn.Module, opt: Any, seeds: range) -> None:
    for seed in seeds:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
        model(x.to(next(model.parameters()).dtype)).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    opt.wait_for_step()


def twins(kind: str) -> tuple[list[nn.Module], list[Any]]:
    """Two models and optimizers of ``kind``, trained alike for two steps."""
    dtype = torch.float32 if kind == "offload" else torch.bfloat16
    models = [make_model(dtype) for _ in range(2)]
    opts = [build(kind, m) for m in models]
    for m, o in zip(models, opts):
        train(m, o, range(2))
    return models, opts


def go_on_alike(models: list[nn.Module], opts: list[Any]) -> None:
    """Two more steps of each; their weights are bitwise equal."""
    for m, o in zip(models, opts):
        train(m, o, range(2, 4))
    for p, q in zip(*(m.parameters() for m in models)):
        assert torch.equal(p, q)


def _meta(e: dict[str, Any]) -> None:
    e["exp_avg"] = torch.empty_like(e["exp_avg"], device="meta")


def _sparse(e: dict[str, Any]) -> None:
    e["exp_avg"] = e["exp_avg"].to_sparse()


def _step_none(e: dict[str, Any]) -> None:
    e["step"] = None


def _no_step(e: dict[str, Any]) -> None:
    del e["step"]


def _no_exp_avg(e: dict[str, Any]) -> None:
    del e["exp_avg"]


BAD: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "meta": (_meta, "state 'exp_avg' of parameter 2.*meta tensor"),
    "sparse": (_sparse, "state 'exp_avg' of parameter 2.*sparse_coo tensor"),
    "step-None": (_step_none, "state 'step' of parameter 2.*None, not a number"),
    "no-step": (_no_step, "state of parameter 2.*has no 'step'"),
    "no-exp_avg": (_no_exp_avg, "state of parameter 2.*has no 'exp_avg'"),
}


@pytest.mark.parametrize("bad", sorted(BAD))
@pytest.mark.parametrize("kind", ["full", "full-0.5", "offload"])
def test_a_checkpoint_torch_could_not_step_on_is_refused_whole(kind: str, bad: str) -> None:
    models, opts = twins(kind)
    before = copy.deepcopy(opts[1].state_dict())
    other = copy.deepcopy(before)  # another checkpoint (every moment moved), one entry bad
    for entry in other["state"].values():
        entry["exp_avg"] = entry["exp_avg"] + 1.0
    mutate, message = BAD[bad]
    mutate(other["state"][2])
    with pytest.raises(ConfigError, match=message + ".*nothing was loaded"):
        opts[1].load_state_dict(other)
    after = opts[1].state_dict()
    for i, entry in before["state"].items():
        assert sorted(after["state"][i]) == sorted(entry), i
        for k, v in entry.items():
            assert torch.equal(torch.as_tensor(after["state"][i][k]), torch.as_tensor(v)), (i, k)
    go_on_alike(models, opts)  # the refused load changed nothing: bitwise the twin


@pytest.mark.parametrize("kind", ["full", "offload"])
def test_a_numpy_step_loads_as_torchs(kind: str) -> None:
    """A ``step`` a converter left as a NumPy scalar: torch's ``float(step)`` takes it, so
    does the check (it refused ``np.int64`` at first: a tester's find)."""
    np = pytest.importorskip("numpy")
    models, opts = twins(kind)
    saved = copy.deepcopy(opts[0].state_dict())
    as_numpy = copy.deepcopy(saved)
    for entry in as_numpy["state"].values():
        entry["step"] = np.int64(int(entry["step"]))
    opts[0].load_state_dict(saved)
    opts[1].load_state_dict(as_numpy)
    go_on_alike(models, opts)
