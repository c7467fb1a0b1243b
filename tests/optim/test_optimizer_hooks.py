"""torch's optimizer hooks and state entries under pipeoff's optimizers, as a fresh tester
used them.

- Step hooks registered on the optimizer *instance* handed to ``OffloadOptimizer``
  (an EMA update in a post hook) run once per step, as they would on that optimizer
  alone (the chunks step through the class's step body, which torch's hook wrapper
  does not reach: they silently never ran).
- State-dict and load hooks registered on either pipeoff optimizer run, as torch's
  ``Optimizer.state_dict`` / ``load_state_dict`` run them (the overrides skipped them).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from pipeoff.optim import FullOffloadOptimizer, OffloadOptimizer


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _train(model: nn.Module, opt: Any, steps: int = 3) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        model(torch.randn(5, 8, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _ema_run(wrap: Any) -> tuple[list[torch.Tensor], list[str]]:
    model = _model()
    base = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ema = [p.detach().clone() for p in model.parameters()]
    calls: list[str] = []

    def pre(opt: Any, args: Any, kwargs: Any) -> None:
        assert opt is base
        calls.append("pre")

    def post(opt: Any, args: Any, kwargs: Any) -> None:
        assert opt is base
        calls.append("post")
        with torch.no_grad():
            for e, p in zip(ema, model.parameters()):
                e.lerp_(p, 0.1)

    base.register_step_pre_hook(pre)
    base.register_step_post_hook(post)
    _train(model, wrap(base))
    return ema, calls


@pytest.mark.parametrize("fraction", [0.5, 1.0])
@pytest.mark.parametrize("mode", ["single_pass", "chunked", "overlap"])
def test_the_wrapped_optimizers_step_hooks_run_once_per_step(mode: str, fraction: float) -> None:
    want, want_calls = _ema_run(lambda base: base)
    got, calls = _ema_run(lambda base: OffloadOptimizer(
        base, mode=mode, offload_fraction=fraction, chunk_bytes=256))
    assert calls == want_calls == ["pre", "post"] * 3
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_a_pre_hook_may_hand_step_another_closure() -> None:
    model = _model()
    base = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ran: list[str] = []

    def swap(opt: Any, args: Any, kwargs: Any) -> Any:
        return (args[0],), {"closure": lambda: ran.append("swapped") or 1.0}

    base.register_step_pre_hook(swap)
    opt = OffloadOptimizer(base, mode="chunked", chunk_bytes=256)
    model(torch.randn(5, 8)).pow(2).mean().backward()
    assert opt.step(lambda: ran.append("mine") or 0.0) == 1.0
    assert ran == ["swapped"]


def _offload(model: nn.Module) -> Any:
    return OffloadOptimizer(model.parameters(), torch.optim.AdamW, mode="overlap",
                            chunk_bytes=256)


def _full(model: nn.Module) -> Any:
    return FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)


@pytest.mark.parametrize("build", [_offload, _full], ids=["offload", "full_offload"])
def test_state_dict_and_load_hooks_registered_on_the_optimizer_run(build: Any) -> None:
    model = _model()
    opt = build(model)
    _train(model, opt, steps=1)
    seen: list[str] = []
    opt.register_state_dict_pre_hook(lambda o: seen.append("sd pre"))

    def tag(o: Any, sd: dict[str, Any]) -> dict[str, Any]:
        seen.append("sd post")
        return {**sd, "param_groups": [{**g, "tag": 1} for g in sd["param_groups"]]}

    opt.register_state_dict_post_hook(tag)
    sd = opt.state_dict()
    assert seen == ["sd pre", "sd post"]
    assert all(g["tag"] == 1 for g in sd["param_groups"])  # the post hook's dict

    def untag(o: Any, sd: dict[str, Any]) -> dict[str, Any]:
        seen.append("load pre")
        return {**sd, "param_groups": [{k: v for k, v in g.items() if k != "tag"}
                                       for g in sd["param_groups"]]}

    opt.register_load_state_dict_pre_hook(untag)
    opt.register_load_state_dict_post_hook(lambda o: seen.append("load post"))
    opt.load_state_dict(sd)
    assert seen[2:] == ["load pre", "load post"]
    assert all("tag" not in g for g in opt.param_groups)  # the pre hook's dict was loaded


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("mode", ["single_pass", "chunked", "overlap"])
def test_sgd_without_momentum_keeps_no_state_entries(mode: str, fraction: float) -> None:
    """torch's SGD without momentum keeps no state; neither does the wrapper (it
    showed an empty entry per parameter in chunked and overlap: a fresh tester's
    find). Its state dict is torch's."""
    ref_model, model = _model(), _model()
    ref = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    opt = OffloadOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), mode=mode,
                           offload_fraction=fraction, chunk_bytes=256)
    _train(ref_model, ref, steps=2)
    _train(model, opt, steps=2)
    assert opt.state_dict() == ref.state_dict() == {
        "state": {}, "param_groups": ref.state_dict()["param_groups"]}
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters()))


def _decay_run(wrap: Any, held: bool) -> list[torch.Tensor]:
    """A step post hook on the wrapped optimizer halves ``exp_avg`` (a momentum decay):
    with ``held``, the step's chunks are held until the training thread waits."""
    import pipeoff.testing
    from tests._stacks import release_when_any_waiting

    model = _model()
    base = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def post(opt: Any, args: Any, kwargs: Any) -> None:
        for st in opt.state.values():
            st["exp_avg"].mul_(0.5)

    base.register_step_post_hook(post)
    opt = wrap(base)
    if not held:
        _train(model, opt)
    else:
        with pipeoff.testing.hold_task("opt.*") as release:
            # (released by the wait before the hooks, or, without it, by the next
            # forward's read of the weights: after the hooks ran)
            watcher = release_when_any_waiting(release, ("wait_for_step",), ("on_read",),
                                               ("on_module",))
            try:
                _train(model, opt)
            finally:
                release.set()
                watcher.join()
    if isinstance(opt, OffloadOptimizer):
        opt.wait_for_step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_the_wrapped_optimizers_post_hooks_run_after_an_overlapped_step(fraction: float
                                                                        ) -> None:
    """Under mode="overlap" ``step()`` returns with its chunks in flight, and the
    wrapped optimizer's ``state`` does not wait: its post hooks run once the chunks are
    done (they read stale state, a KeyError at the first step, and their writes were
    overwritten: 2e-2 off)."""
    want = _decay_run(lambda b: b, held=False)
    got = _decay_run(lambda b: OffloadOptimizer(b, mode="overlap", offload_fraction=fraction),
                     held=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("mode", ["single_pass", "chunked", "overlap"])
def test_a_checkpoint_with_float_steps_loads_as_torch_loads_it(mode: str) -> None:
    """Older checkpoints keep ``step`` as a Python float: torch's loader makes it the
    tensor its step functions require (the class's ``__setstate__``); every later step
    raised 'state_steps argument must contain a list of singleton tensors'."""
    outs = []
    for wrap in (lambda b: b, lambda b: OffloadOptimizer(b, mode=mode)):
        model = _model()
        opt = wrap(torch.optim.AdamW(model.parameters(), lr=1e-2))
        _train(model, opt, steps=1)
        sd = opt.state_dict()
        for st in sd["state"].values():
            st["step"] = float(st["step"])
        opt.load_state_dict(sd)
        _train(model, opt, steps=2)
        if isinstance(opt, OffloadOptimizer):
            opt.wait_for_step()
        outs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*outs))
