"""A reset of DiLoCo's outer optimizer state by the training loop (``offload_to_cpu``):
state removed from the user's outer optimizer is dropped from the host optimizer it
mirrors, so the next outer step starts it afresh, bitwise torchft's.

``outer.state.clear()``, ``del outer.state[p]``, ``outer.state[p] = {}``, popping every
entry, replacing ``state``, or loading a state dict whose ``"state"`` is empty: right
after the syncing ``step()`` (while its outer step is still in flight, forced) and, with
``fragment_sync_delay`` > 0, between a sync's preparation and its decision (the
speculative step must not be kept). One replica on a mock Manager, against torchft's
DiLoCo on the same model and data.
"""

from __future__ import annotations

import collections
import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import optim
from torchft.local_sgd import DiLoCo as TorchftDiLoCo

import pipeoff.ft
import pipeoff.testing
from tests._stacks import install, release_when_any_waiting
from tests.ft._diloco_replicas import make_model, sgd_nesterov
from tests.ft.test_diloco_speculative import _assert_same, _inner_step, _outer_adamw
from tests.ft.test_diloco_tail import _manager

SYNC_EVERY = 3
KW = {"offload_to_cpu": True, "bucket_bytes": 64, "device_budget_bytes": 128}


def _pop_all(o: optim.Optimizer) -> None:
    for _ in range(100):  # (an entry put back on every access never ends the loop)
        if not o.state:
            return
        o.state.popitem()
    raise AssertionError("popitem() until empty: the entries keep coming back")


def _replace(o: optim.Optimizer) -> None:
    o.state = collections.defaultdict(dict)


RESETS: dict[str, Callable[[optim.Optimizer], None]] = {
    "clear": lambda o: o.state.clear(),
    "del": lambda o: [o.state.__delitem__(p) for p in list(o.state)],  # type: ignore[func-returns-value]
    "set_empty": lambda o: [o.state.__setitem__(p, {}) for p in list(o.state)],  # type: ignore[func-returns-value]
    "popitem": _pop_all,
    "replace": _replace,
    "load_empty": lambda o: o.load_state_dict({**o.state_dict(), "state": {}}),
}


def _end(torchft: bool, d: Any, opt: optim.Optimizer) -> dict[str, Any]:
    """The outer state and the backups once the last sync is done."""
    if not torchft:
        d.wait_for_sync()
    return {"state": copy.deepcopy(opt.state_dict()["state"]),
            "backups": {n: t.clone() for n, t in d._fragments[0].original_parameters.items()}}


def _loop(torchft: bool, reset: str, *, delay: int, schedule: str = "pipelined",
          at: int = 2 * SYNC_EVERY - 1, outer: str = "sgd") -> tuple[list[list[torch.Tensor]],
                                                                      dict[str, Any]]:
    """Three syncs; the outer state reset right after inner step ``at`` (the second
    syncing step by default, the first having created the state; ``SYNC_EVERY - 1``:
    the first, whose step creates it). The parameters after every step, and the outer
    state and backups at the end."""
    model = make_model(0)
    inner = optim.SGD(model.parameters(), lr=0.1)
    opt = (sgd_nesterov if outer == "sgd" else _outer_adamw)(model.parameters())
    cls = TorchftDiLoCo if torchft else pipeoff.ft.DiLoCo
    kw = {} if torchft else {**KW, "schedule": schedule}
    out = []
    with cls(_manager(), [model], inner, opt, SYNC_EVERY, fragment_sync_delay=delay,
             fragment_update_alpha=0.5, **kw) as d:
        for k in range(3 * SYNC_EVERY):
            _inner_step(model, inner, k)
            if k == at:
                RESETS[reset](opt)
                assert not any(opt.state.values()), "the reset's entries came back"
            out.append([p.detach().clone() for p in model.parameters()])
        end = _end(torchft, d, opt)
    return out, end


def _held(reset: str, delay: int, **kw: Any) -> tuple[list[list[torch.Tensor]], dict[str, Any]]:
    """The loop with the sync's outer step (delay 0) or the keep of its spares (delay 1)
    held until the training thread blocks: the reset meets the tail in flight."""
    install()
    with pipeoff.testing.hold_task(r"outer:c\d+" if delay == 0 else "keep") as release:
        watcher = release_when_any_waiting(release, ("_before_outer_state",), ("on_read",),
                                           ("wait_for_sync",))
        try:
            return _loop(False, reset, delay=delay, **kw)
        finally:
            release.set()
            watcher.join()


@pytest.mark.parametrize("reset", list(RESETS))
@pytest.mark.parametrize("delay", [0, 1])
@pytest.mark.parametrize("sync", [1, 2])
def test_a_reset_right_after_the_syncing_step_is_torchfts(reset: str, delay: int,
                                                          sync: int) -> None:
    """torchft's next outer step starts the momentum afresh; pipeoff's host optimizer
    kept the old one (2e-2 off), an entry removed while the tail ran came back at the
    next access (a popitem loop never ended), and after the first sync, whose step
    creates the state under the next forward, ``outer.state = defaultdict(dict)`` was
    undone by the state the step showed (3e-2 off)."""
    at = sync * SYNC_EVERY - 1
    _assert_same(_held(reset, delay, at=at), _loop(True, reset, delay=delay, at=at))


@pytest.mark.parametrize("reset", ["clear", "load_empty", "replace"])
@pytest.mark.parametrize("outer", ["sgd", "adamw"])
def test_a_reset_before_the_decision_is_not_stepped_over(reset: str, outer: str) -> None:
    """Between a delayed sync's preparation and its decision: the speculative step,
    taken from the state before the reset, is dropped and the step taken afresh.
    (``replace``, ``outer.state = defaultdict(dict)``, accesses no watched state: only
    the check for removed entries sees it.)"""
    at = 2 * SYNC_EVERY - 2  # (the preparing step, fragment_sync_delay=1)
    _assert_same(_loop(False, reset, delay=1, at=at, outer=outer),
                 _loop(True, reset, delay=1, at=at, outer=outer))


@pytest.mark.parametrize("reset", ["clear", "del", "load_empty"])
def test_a_reset_in_the_synchronous_schedule_is_torchfts(reset: str) -> None:
    _assert_same(_loop(False, reset, delay=0, schedule="synchronous"),
                 _loop(True, reset, delay=0))


def _views_edited(torchft: bool, outer: str) -> tuple[list[list[torch.Tensor]], dict[str, Any]]:
    """Views of the outer state taken once the first sync is done, edited in place
    after the second (delay 1: its speculative step kept), before the third steps."""
    model = make_model(0)
    inner = optim.SGD(model.parameters(), lr=0.1)
    opt = (sgd_nesterov if outer == "sgd" else _outer_adamw)(model.parameters())
    cls = TorchftDiLoCo if torchft else pipeoff.ft.DiLoCo
    out, views = [], []
    with cls(_manager(), [model], inner, opt, SYNC_EVERY, fragment_sync_delay=1,
             fragment_update_alpha=0.5, **({} if torchft else KW)) as d:
        for k in range(3 * SYNC_EVERY):
            _inner_step(model, inner, k)
            if k == SYNC_EVERY:
                views = [t.view(-1) for st in opt.state.values() for t in st.values()
                         if isinstance(t, torch.Tensor) and t.dim() > 0]
            if k == 2 * SYNC_EVERY:
                for v in views:
                    v.mul_(0.5)
            out.append([p.detach().clone() for p in model.parameters()])
        end = _end(torchft, d, opt)
    return out, end


@pytest.mark.parametrize("outer", ["sgd", "adamw"])
def test_a_view_of_the_outer_state_sees_the_state_after_a_speculative_sync(outer: str) -> None:
    """The speculative step's spares were kept by swapping storages: a view taken before
    (``.view(-1)``, ``.data``, ``.numpy()``) was left on the old storage, and an edit
    through it after that sync was lost (1.7e-2 off)."""
    _assert_same(_views_edited(False, outer), _views_edited(True, outer))


def _reshaped(torchft: bool, outer: str, delay: int) -> None:
    model = make_model(0)
    inner = optim.SGD(model.parameters(), lr=0.1)
    opt = (sgd_nesterov if outer == "sgd" else _outer_adamw)(model.parameters())
    cls = TorchftDiLoCo if torchft else pipeoff.ft.DiLoCo
    with cls(_manager(), [model], inner, opt, SYNC_EVERY, fragment_sync_delay=delay,
             fragment_update_alpha=0.5, **({} if torchft else KW)) as d:
        for k in range(3 * SYNC_EVERY):
            _inner_step(model, inner, k)
            if k == SYNC_EVERY:
                for st in opt.state.values():
                    for n, t in list(st.items()):
                        if isinstance(t, torch.Tensor) and t.dim() > 1:
                            st[n] = t.reshape(-1)  # (the same elements, another shape)
        if not torchft:
            d.wait_for_sync()


@pytest.mark.parametrize(("outer", "delay"), [("sgd", 0), ("adamw", 1)])
def test_a_reshaped_outer_state_raises_as_torchfts(outer: str, delay: int) -> None:
    """The native outer step took a state tensor of the parameter's element count in
    any shape, and stepped on where torchft's (torch's) step raises."""
    for torchft in (True, False):
        with pytest.raises(RuntimeError, match="must match the size"):
            _reshaped(torchft, outer, delay)
