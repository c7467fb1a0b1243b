"""Test helper: DiLoCo replicas (threads of this process) behind a real Lighthouse, each
with a real torchft Manager over gloo; the reference is torchft's own DiLoCo."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn, optim
from torchft.coordination import LighthouseServer
from torchft.local_sgd import DiLoCo as TorchftDiLoCo

import pipeoff.ft
from tests.ft._managers import replica_manager


@dataclass
class DiLoCoRun:
    """What one replica saw."""

    params: list[list[torch.Tensor]] = field(default_factory=list)
    """The parameters after every inner step (and its sync, if any)."""
    backups: dict[str, torch.Tensor] = field(default_factory=dict)
    """Every fragment's backup at the end, by ``"{fragment}.{name}"``."""
    outer_states: list[dict[str, Any]] = field(default_factory=list)
    """Every fragment's outer optimizer state dict at the end."""
    traces: list[Any] = field(default_factory=list)
    errors_reported: list[Exception] = field(default_factory=list)
    steps: int = 0


def make_model(seed: int) -> nn.Sequential:
    """Two fragments (blocks) of odd sizes; distinct values per replica."""
    g = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Sequential(nn.Linear(12, 24), nn.ReLU()),
                          nn.Sequential(nn.Linear(24, 7), nn.Linear(7, 3)))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def sgd_nesterov(params: Any) -> optim.Optimizer:
    """torchtitan's outer optimizer."""
    return optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


@dataclass(frozen=True)
class Setup:
    """How a replica builds what DiLoCo wraps (defaults: :func:`make_model`, its two
    blocks as fragments or the whole model as one)."""

    model: Callable[[int], nn.Module] = make_model
    fragments: Callable[[nn.Module, int], list[nn.Module]] | None = None
    pre_build: Callable[[int, nn.Module, Any], None] | None = None
    """``(replica, model, outer optimizers)`` before DiLoCo is built (a resume)."""
    post_step: Callable[[nn.Module], None] | None = None
    """``(model)`` after every inner ``step()`` (a weight clip the loop does)."""


def _replica(replica_id: int, lighthouse: str, cls: type[Any], kwargs: dict[str, Any],
             steps: int, n_fragments: int,
             outer: Callable[[Any], optim.Optimizer], shared_outer: bool,
             inner: Callable[[nn.Module], optim.Optimizer] | None,
             on_step: Callable[[int, int, Any], None] | None,
             setup: Setup = Setup()) -> DiLoCoRun:
    model = setup.model(replica_id)
    if setup.fragments is not None:
        frags = setup.fragments(model, n_fragments)
    else:
        frags = list(model) if n_fragments == 2 else [model]
    opt = (optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1) if inner is None
           else inner(model))
    outers: Any = outer(model.parameters()) if shared_outer else [outer(f.parameters())
                                                                 for f in frags]
    if setup.pre_build is not None:
        setup.pre_build(replica_id, model, outers)
    data = torch.Generator().manual_seed(100 + replica_id)
    manager, _store = replica_manager(
        f"replica_{replica_id}", lighthouse,
        load_state_dict=lambda sd: model.load_state_dict(sd["model"]),
        # A snapshot: torchft's transport serializes it while the peer trains on (the
        # live weights would make a healing replica's run depend on the timing).
        state_dict=lambda: {"model": {k: v.detach().clone()
                                      for k, v in model.state_dict().items()}},
        timeout_s=20, quorum_timeout_s=30)
    out = DiLoCoRun()
    report = manager.report_error

    def spy(e: Exception) -> None:
        out.errors_reported.append(e)
        report(e)

    manager.report_error = spy  # type: ignore[method-assign]
    try:
        with cls(manager, frags, opt, outers, **kwargs) as diloco:
            for step in range(steps):
                opt.zero_grad()
                model(torch.randn(4, 12, generator=data)).pow(2).mean().backward()
                if on_step is not None:
                    on_step(replica_id, step, diloco)
                opt.step()
                if setup.post_step is not None:
                    setup.post_step(model)
                out.params.append([p.detach().clone() for p in model.parameters()])
                out.traces.append(getattr(diloco, "last_trace", None))
            wait = getattr(opt, "wait_for_step", None)
            if callable(wait):
                wait()
            if isinstance(diloco, pipeoff.ft.DiLoCo):
                diloco.wait_for_sync()  # (the backups below are read directly)
            for i, f in enumerate(diloco._fragments):
                for name, t in f.original_parameters.items():
                    out.backups[f"{i}.{name}"] = t.clone()
                state = (diloco.outer_state_dict(i) if isinstance(diloco, pipeoff.ft.DiLoCo)
                         else f._outer_optimizer.state_dict())
                out.outer_states.append(state)
        out.steps = manager.current_step()
        return out
    finally:
        manager.shutdown(wait=False)


def run_diloco(kwargs: dict[str, Any], *, torchft: bool = False, steps: int = 8,
               n_fragments: int = 2, outer: Callable[[Any], optim.Optimizer] = sgd_nesterov,
               shared_outer: bool = False,
               inner: Callable[[nn.Module], optim.Optimizer] | None = None,
               on_step: Callable[[int, int, Any], None] | None = None,
               setup: Setup = Setup()) -> list[DiLoCoRun]:
    """Two replicas; ``kwargs`` go to DiLoCo (torchft's class if ``torchft``, else
    pipeoff's); ``on_step(replica, step, diloco)`` runs before every inner step."""
    cls = TorchftDiLoCo if torchft else pipeoff.ft.DiLoCo
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    try:
        with ThreadPoolExecutor(2) as ex:
            futs = [ex.submit(_replica, i, lighthouse.address(), cls, kwargs, steps,
                              n_fragments, outer, shared_outer, inner, on_step, setup)
                    for i in range(2)]
            return [f.result(timeout=120) for f in futs]
    finally:
        lighthouse.shutdown()


def assert_bitwise(runs: list[DiLoCoRun], reference: list[DiLoCoRun]) -> None:
    """Every replica's parameters after every step, backups and outer state equal the
    reference's, bit for bit."""
    for r, (got, want) in enumerate(zip(runs, reference)):
        assert len(got.params) == len(want.params)
        for s, (a, b) in enumerate(zip(got.params, want.params)):
            for k, (x, y) in enumerate(zip(a, b)):
                assert torch.equal(x, y), f"replica {r} step {s} parameter {k}"
        assert got.backups.keys() == want.backups.keys()
        for name in got.backups:
            assert torch.equal(got.backups[name], want.backups[name]), f"replica {r} {name}"
        assert len(got.outer_states) == len(want.outer_states)
        for gs, ws in zip(got.outer_states, want.outer_states):
            assert gs["param_groups"] == ws["param_groups"]
            assert gs["state"].keys() == ws["state"].keys()
            for idx in gs["state"]:
                for key, v in gs["state"][idx].items():
                    w = ws["state"][idx][key]
                    assert torch.equal(torch.as_tensor(v), torch.as_tensor(w).to(
                        torch.as_tensor(v).device)), f"replica {r} outer state {idx}.{key}"


def process_main(replica_id: int, lighthouses: dict[str, str],
                 modes: dict[str, dict[str, Any]], steps: int, queue: Any) -> None:
    """One replica process: every mode in turn (``"torchft"``: torchft's own DiLoCo),
    each against its own Lighthouse. Puts ``(replica_id, {mode: (parameters after every
    step, backups, peak device staging per sync or None, budget, errors reported)})``
    on ``queue`` (numpy arrays: this process will have exited when the parent reads)."""
    out = {}
    for mode, kwargs in modes.items():
        run = _replica(replica_id, lighthouses[mode],
                       TorchftDiLoCo if mode == "torchft" else pipeoff.ft.DiLoCo,
                       {"sync_every": 4, "fragment_sync_delay": 1,
                        "fragment_update_alpha": 0.5, **kwargs},
                       steps, 2, sgd_nesterov, False, None, None)
        peaks = [t.summary().peak_device_staging_bytes for t in run.traces if t is not None]
        out[mode] = ([[p.numpy() for p in step] for step in run.params],
                     {k: v.numpy() for k, v in run.backups.items()}, peaks,
                     kwargs.get("device_budget_bytes"), len(run.errors_reported))
    queue.put((replica_id, out))
