"""FullOffloadOptimizer's state as torch's code edits it between steps: keys a
hyperparameter stops using (momentum 0, amsgrad off) kept, and writes into
``opt.state`` (a reset after re-initialising a layer, a replaced tensor, a step
count) honoured, bitwise torch's."""

from __future__ import annotations

import collections
import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

from pipeoff import ConfigError
from pipeoff.optim import FullOffloadOptimizer

TOGGLES = {
    "sgd-momentum": (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9}, "momentum", 0.0),
    "rmsprop-momentum": (torch.optim.RMSprop, {"lr": 1e-2, "momentum": 0.9}, "momentum", 0.0),
    "adam-amsgrad": (torch.optim.Adam, {"lr": 1e-2, "amsgrad": True}, "amsgrad", False),
}


def _same(model: torch.nn.Module, ref: torch.nn.Module, opt: Any, ref_opt: Any) -> None:
    opt.wait_for_step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name
        got = {k: v for k, v in opt.state[p].items() if k != "master"}
        want = ref_opt.state[q]
        assert sorted(got) == sorted(want), (name, sorted(got), sorted(want))
        for k in want:
            assert torch.equal(torch.as_tensor(got[k]), torch.as_tensor(want[k])), (name, k)


def _step_both(model: torch.nn.Module, ref: torch.nn.Module, opt: Any, ref_opt: Any,
               x: torch.Tensor) -> None:
    """One training step of each, on the same batch."""
    for m, o in ((model, opt), (ref, ref_opt)):
        m(x).pow(2).mean().backward()
        o.step()
        o.zero_grad()



def twins(overlap: str, fraction: float) -> tuple[Any, Any, FullOffloadOptimizer, Any, Any]:
    """A model under FullOffloadOptimizer, its copy under torch's AdamW, and an input."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    ref = copy.deepcopy(model)
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, overlap=overlap,
                               offload_fraction=fraction)
    return model, ref, opt, torch.optim.AdamW(ref.parameters(), lr=1e-2), torch.randn(4, 8)

@pytest.mark.parametrize("fraction", [1.0, 0.3])
@pytest.mark.parametrize("overlap", ["none", "forward"])
@pytest.mark.parametrize("toggle", sorted(TOGGLES))
def test_a_state_key_a_hyperparameter_stops_using_is_kept(
        toggle: str, overlap: str, fraction: float) -> None:
    """Momentum set to 0 (amsgrad off) for a step, then back: torch keeps the buffer and
    goes on from it. The optimizer dropped it (SGD: a fresh buffer, 1e-2 off torch two
    steps later; RMSprop and Adam: KeyError, the step failed; torn with a device part),
    and its state dict lacked the key meanwhile (a tester's find)."""
    cls, kwargs, key, off = TOGGLES[toggle]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    ref = copy.deepcopy(model)
    opt = FullOffloadOptimizer(model, cls, overlap=overlap, offload_fraction=fraction,
                               **kwargs)
    ref_opt = cls(ref.parameters(), **kwargs)
    x = torch.randn(4, 8)
    for i in range(4):
        for o in (opt, ref_opt):
            o.param_groups[0][key] = off if i == 1 else kwargs[key]
        _step_both(model, ref, opt, ref_opt, x)
        _same(model, ref, opt, ref_opt)
        assert sorted(opt.state_dict()["state"][0]) == sorted([*ref_opt.state_dict()["state"][0],
                                                               "master"])


def _reset(state: Any, p: torch.Tensor) -> None:
    state[p] = {}


def _delete(state: Any, p: torch.Tensor) -> None:
    del state[p]


def _clear_entry(state: Any, p: torch.Tensor) -> None:
    state[p].clear()


def _clear_all(state: Any, p: torch.Tensor) -> None:
    state.clear()


def _pop(state: Any, p: torch.Tensor) -> None:
    state.pop(p)


def _replace(state: Any, p: torch.Tensor) -> None:
    state[p]["exp_avg"] = torch.full_like(p, 0.5)


def _step_count(state: Any, p: torch.Tensor) -> None:
    state[p]["step"] = torch.tensor(1.0)


def _update(state: Any, p: torch.Tensor) -> None:
    state[p].update(exp_avg_sq=torch.full_like(p, 0.25), step=torch.tensor(7.0))


WRITES: dict[str, Callable[[Any, torch.Tensor], None]] = {
    "reset": _reset, "del": _delete, "clear-entry": _clear_entry, "clear-all": _clear_all,
    "pop": _pop, "replace": _replace, "step": _step_count, "update": _update}


@pytest.mark.parametrize("fraction", [1.0, 0.3])
@pytest.mark.parametrize("overlap", ["none", "forward", "backward"])
@pytest.mark.parametrize("write", sorted(WRITES))
def test_a_write_into_opt_state_is_what_the_next_step_steps_from(
        write: str, overlap: str, fraction: float) -> None:
    """torch's code resets a parameter's state after re-initialising it
    (``opt.state[p] = {}``, ``del opt.state[p]``), or writes a value or the step count.
    The writes were dropped silently (the view is built at each read): 1.5e-2 off torch
    after the next step, the step count 3 where torch's is 1 (a tester's find). Written
    between steps (under ``overlap="backward"``, before the backward)."""
    model, ref, opt, ref_opt, x = twins(overlap, fraction)
    for i in range(4):
        if i == 2:
            for m, o in ((model, opt), (ref, ref_opt)):
                for p in (m[0].weight, m[1].bias):  # (a device-part one, at 0.3, and a host one)
                    WRITES[write](o.state, p)
        _step_both(model, ref, opt, ref_opt, x)
        _same(model, ref, opt, ref_opt)


def test_writing_what_is_there_changes_nothing_and_the_master_is_not_written() -> None:
    """Lightning's teardown moves every state value to a device and writes it back
    (``v[key] = moved``): the same values, nothing changes (the master included). A
    master with other values is refused, naming it; the view pickles as torch's."""
    import pickle

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    ref = copy.deepcopy(model)
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    x = torch.randn(4, 8)
    _step_both(model, ref, opt, ref_opt, x)
    state = opt.state
    for entry in state.values():
        for key, val in list(entry.items()):
            entry[key] = val.clone()  # (a move: equal values, another tensor)
    entry = state[model.weight]
    with pytest.raises(ConfigError, match="master"):
        entry["master"] = torch.zeros_like(model.weight)
    again = pickle.loads(pickle.dumps(state))  # (a plain defaultdict of plain dicts)
    assert type(again) is collections.defaultdict and len(again) == len(state) == 2
    _step_both(model, ref, opt, ref_opt, x)
    _same(model, ref, opt, ref_opt)


def test_a_write_after_the_final_backward_under_overlap_backward_is_refused() -> None:
    model = torch.nn.Linear(8, 4)
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, overlap="backward")
    x = torch.randn(4, 8)
    model(x).pow(2).mean().backward()
    opt.step()
    model(x).pow(2).mean().backward()
    with pytest.raises(ConfigError, match="after the final backward under overlap='backward'"):
        opt.state[model.weight] = {}
    opt.step()


@pytest.mark.parametrize("how", ["add_param_group", "extend_group"])
@pytest.mark.parametrize("fraction", [1.0, 0.3])
@pytest.mark.parametrize("overlap", ["none", "forward", "backward"])
def test_a_module_added_to_the_model_after_construction_is_stepped(
        overlap: str, fraction: float, how: str) -> None:
    """A new head appended to the model, then given to the optimizer
    (``add_param_group``, or the group's params extended): refused as "not in the
    model" (the names were the model's at construction; a tester's find). Now named
    from the model and stepped bitwise torch's, its weights waited for."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    ref = copy.deepcopy(model)
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, overlap=overlap,
                               offload_fraction=fraction)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    x = torch.randn(4, 8)
    for i in range(4):
        if i == 1:
            head = torch.nn.Linear(4, 4)
            for m, o in ((model, opt), (ref, ref_opt)):
                m.append(copy.deepcopy(head))
                if how == "add_param_group":
                    o.add_param_group({"params": list(m[3].parameters())})
                else:
                    o.param_groups[0]["params"].extend(m[3].parameters())
        _step_both(model, ref, opt, ref_opt, x)
        _same(model, ref, opt, ref_opt)


def test_a_write_through_a_view_kept_across_a_step_waits_for_that_step() -> None:
    """A view of ``opt.state`` read before ``step()`` and written while that step is in
    flight (``overlap="forward"``): the write waits for the step, then resets; else the
    step's chunks wrote the state after the reset."""
    from pipeoff import testing as pt
    from tests._stacks import release_when_waiting

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    ref = copy.deepcopy(model)
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, overlap="forward")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    x = torch.randn(4, 8)
    for i in range(3):
        for m in (model, ref):
            m(x).pow(2).mean().backward()
        if i == 1:
            view = opt.state
            with pt.hold_task(r"step:.*") as release:
                opt.step()
                watcher = release_when_waiting(release, "_write_state", "wait_step")
                view[model.weight] = {}  # waits for the step, then resets
                release.set()  # (without the wait: the step writes after the reset)
                watcher.join()
            ref_opt.step()
            ref_opt.state[ref.weight] = {}
        else:
            opt.step()
            ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        _same(model, ref, opt, ref_opt)


@pytest.mark.parametrize("fraction", [1.0, 0.3])
@pytest.mark.parametrize("overlap", ["none", "forward"])
@pytest.mark.parametrize("how", ["kept-view", "pop-restore"])
def test_a_kept_view_and_a_popped_entry_behave_as_torchs(
        how: str, overlap: str, fraction: float) -> None:
    """A tester's finds. ``kept-view``: a view read after the first step, one key written
    through it two steps later, sent back the whole entry as read, its step count 1
    (torch's 3). ``pop-restore``: an entry popped, a step, then written back: the
    popped tensors were the host state's, and the step in between started the new
    state in them (torch's popped buffers stay as they were)."""
    model, ref, opt, ref_opt, x = twins(overlap, fraction)
    views: list[Any] = []
    saved: list[dict[str, Any]] = []
    for i in range(5):
        _step_both(model, ref, opt, ref_opt, x)
        for m, o in ((model, opt), (ref, ref_opt)):
            p = m[1].weight  # (in the host part at both fractions)
            if how == "kept-view":
                if i == 0:
                    views.append(o.state)
                elif i == 2:
                    views.pop(0)[p]["exp_avg"] = torch.full_like(p, 0.5)
            elif i == 1:
                saved.append({k: v for k, v in o.state.pop(p).items() if k != "master"})
            elif i == 3:
                want = saved.pop(0)
                o.state[p] = want
        _same(model, ref, opt, ref_opt)
