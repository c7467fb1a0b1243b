"""A Ctrl-C while ``load_state_dict()`` writes leaves the optimizer loaded whole, then
reaches the caller (a tester's find: a real SIGINT between two parameters' entries left
the new hyperparameters with the old moments, or some masters loaded and the weights
not). The SIGINT is raised on the main thread from inside the write, between the first
parameter's entry and the second's: without the hold, Python raises it right there.

Also: a Ctrl-C inside ``mode="single_pass"``'s step (the wrapped optimizer's own step, on
the caller's thread, as torch's) says the step may be partly taken, where it said
"call step() again" and a retry stepped the first parameters twice.
"""

from __future__ import annotations

import copy
import signal
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from pipeoff.optim import FullOffloadOptimizer, OffloadOptimizer
from pipeoff.optim._full_offload import _checkpoint
from pipeoff.optim._offload import _host_layout

pytestmark = pytest.mark.filterwarnings("ignore:pipeoff. pinned host memory")

_BUILD: dict[str, Callable[[nn.Module], Any]] = {
    "offload-none": lambda m: OffloadOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-2),
                                               overlap="none"),
    "offload-forward": lambda m: OffloadOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-2),
                                                  overlap="forward"),
    "full": lambda m: FullOffloadOptimizer(m, torch.optim.AdamW, lr=1e-2),
    "full-0.5": lambda m: FullOffloadOptimizer(m, torch.optim.AdamW, lr=1e-2,
                                               offload_fraction=0.5),
}
# Called once per parameter entry as the load writes (module globals, patched).
_WRITES = {"offload": (_host_layout, "loaded_value"), "full": (_checkpoint, "step_entry")}


def _trained(kind: str, seed: int, steps: int = 2) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = _BUILD[kind](model)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    opt.wait_for_step()
    return model, opt


def _snapshot(model: nn.Module, opt: Any) -> list[Any]:
    sd = opt.state_dict()
    state = [(i, k, v) for i, e in sorted(sd["state"].items()) for k, v in sorted(e.items())]
    groups = [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]
    return [state, groups, [p.detach().clone() for p in model.parameters()]]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


@pytest.mark.parametrize("kind", list(_BUILD))
def test_a_ctrl_c_while_load_state_dict_writes_is_passed_on_after_a_whole_load(
        kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    assert threading.current_thread() is threading.main_thread()
    _, source = _trained(kind, seed=7, steps=3)
    ckpt = source.state_dict()
    for g in ckpt["param_groups"]:
        g["lr"], g["weight_decay"] = 3e-3, 0.3
    model_want, want = _trained(kind, seed=1)
    want.load_state_dict(copy.deepcopy(ckpt))
    model, opt = _trained(kind, seed=1)

    module, name = _WRITES[kind.split("-")[0]]
    original = getattr(module, name)
    calls = [0]

    def write(*a: Any, **k: Any) -> Any:
        calls[0] += 1
        if calls[0] == 2:  # (after the first parameter's entry)
            signal.raise_signal(signal.SIGINT)
        return original(*a, **k)

    monkeypatch.setattr(module, name, write)
    with pytest.raises(KeyboardInterrupt) as info:
        opt.load_state_dict(copy.deepcopy(ckpt))
    monkeypatch.undo()
    assert calls[0] > 2
    assert any("held back until that had completed whole" in n
               for n in getattr(info.value, "__notes__", [])), info.value
    assert _same(_snapshot(model, opt), _snapshot(model_want, want))
    # And it goes on as the uninterrupted load does.
    for m, o in ((model, opt), (model_want, want)):
        m(torch.ones(4, 8)).pow(2).mean().backward()
        o.step()
        o.zero_grad()
        o.wait_for_step()
    for p, q in zip(model.parameters(), model_want.parameters(), strict=True):
        assert torch.equal(p, q)


class _CtrlCAtLerp(TorchFunctionMode):
    """A Ctrl-C inside the wrapped AdamW's own update, at its ``n``-th ``lerp_``."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n, self.seen = n, 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") == "lerp_":
            self.seen += 1
            if self.seen == self.n:
                raise KeyboardInterrupt
        return func(*args, **(kwargs or {}))


def test_a_ctrl_c_inside_a_single_pass_step_does_not_say_to_step_again() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = OffloadOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False),
                           mode="single_pass")
    model(torch.ones(4, 8)).pow(2).mean().backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(KeyboardInterrupt) as info, _CtrlCAtLerp(3):
        opt.step()
    assert not torch.equal(model[0].weight, before[0])  # (a part was stepped, as in torch)
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert "load a checkpoint rather than call step() again" in notes, notes
    assert "call step() again to take it" not in notes, notes


@pytest.mark.parametrize("call", ["load_state_dict", "refresh_device_weights"])
def test_a_ctrl_c_with_no_step_in_flight_is_not_taken_for_a_failed_step(
        call: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C in the wait for the step in flight once none was (or it had just ended)
    was taken for that step's failure and swallowed (a tester's find)."""
    from pipeoff.optim._full_offload import _lifecycle

    model, opt = _trained("full", seed=1)
    sd = opt.state_dict()
    wait_step = _lifecycle.Lifecycle.wait_step

    armed = [True]

    def interrupted(self: Any) -> Any:
        if armed[0]:  # (once: the first wait, in the quiesce before anything is written)
            armed[0] = False
            signal.raise_signal(signal.SIGINT)  # (the handler runs at the next bytecode)
        return wait_step(self)

    monkeypatch.setattr(_lifecycle.Lifecycle, "wait_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        opt.load_state_dict(sd) if call == "load_state_dict" else opt.refresh_device_weights()
