"""DiLoCo's speculative outer step (``pipeoff/ft/_outer_spec.py``): with
``fragment_sync_delay`` > 0 the outer step runs before the decision into spares,
kept on a commit and dropped on a reject; bitwise torchft's, including when the
hyperparameters or the state change between the sync's preparation and its decision.

One replica on a mock Manager (its all-reduce leaves the pseudo-gradients as they
are), against torchft's DiLoCo on the same model, data and Manager behaviour; the
interleavings are forced by holding tasks until the training thread blocks.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import pickle
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import nn, optim
from torchft.local_sgd import DiLoCo as TorchftDiLoCo

import pipeoff
import pipeoff.ft
import pipeoff.testing
from pipeoff.ft import _outer
from tests._modes import PassThrough
from tests._stacks import (
    install,
    release_when_any_waiting,
    release_when_waiting,
    stack_of,
    waiting_in,
)
from tests.ft._diloco_replicas import make_model, sgd_nesterov
from tests.ft.test_diloco_tail import _manager

SYNC_EVERY = 3
DELAY = 1
KW = {"offload_to_cpu": True, "bucket_bytes": 64, "device_budget_bytes": 128}


def _inner_step(model: nn.Module, inner: optim.Optimizer, k: int) -> None:
    inner.zero_grad()
    x = torch.randn(2, 12, generator=torch.Generator().manual_seed(k))
    model(x).pow(2).mean().backward()
    inner.step()


@contextmanager
def _diloco(torchft: bool, outer_of: Callable[[Any], optim.Optimizer] = sgd_nesterov,
            commit: bool = True) -> Iterator[tuple[nn.Module, optim.Optimizer, Any, Any]]:
    model = make_model(0)
    manager = _manager()
    if not commit:
        manager.should_commit.side_effect = lambda *a, **k: False
    inner = optim.SGD(model.parameters(), lr=0.1)
    outer = outer_of(model.parameters())
    cls = TorchftDiLoCo if torchft else pipeoff.ft.DiLoCo
    with cls(manager, [model], inner, outer, SYNC_EVERY, fragment_sync_delay=DELAY,
             fragment_update_alpha=0.5, **({} if torchft else KW)) as d:
        yield model, inner, d, manager


def _loop(torchft: bool, *, between: Callable[..., None] | None = None, steps: int = 6,
          outer_of: Callable[[Any], optim.Optimizer] = sgd_nesterov,
          commit: bool = True) -> tuple[list[list[torch.Tensor]], dict[str, Any]]:
    """``steps`` inner steps; ``between(model, inner, d, manager)`` right after each
    preparing step (before the decision, DELAY steps later). The parameters after every
    step, and the outer state and backups at the end."""
    out = []
    with _diloco(torchft, outer_of, commit) as (model, inner, d, manager):
        for k in range(steps):
            _inner_step(model, inner, k)
            if between is not None and d._local_step == SYNC_EVERY - DELAY:
                between(model, inner, d, manager)
            out.append([p.detach().clone() for p in model.parameters()])
        if not torchft:
            d.wait_for_sync()
        outer = d._fragments[0]._outer_optimizer
        end = {"state": copy.deepcopy(outer.state_dict()["state"]),
               "backups": {n: t.clone() for n, t in d._fragments[0].original_parameters.items()}}
    return out, end


def _assert_same(a: Any, b: Any) -> None:
    (pa, ea), (pb, eb) = a, b
    assert len(pa) == len(pb)
    for s, (x, y) in enumerate(zip(pa, pb)):
        assert all(torch.equal(u, v) for u, v in zip(x, y)), f"step {s}"
    assert ea["backups"].keys() == eb["backups"].keys()
    assert all(torch.equal(ea["backups"][k], eb["backups"][k]) for k in ea["backups"])
    assert ea["state"].keys() == eb["state"].keys()
    for k in ea["state"]:
        for key, v in ea["state"][k].items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(eb["state"][k][key])), key


def _outer_adamw(ps: Any) -> optim.Optimizer:
    return optim.AdamW(ps, lr=0.1, betas=(0.9, 0.95), weight_decay=0.1)


@pytest.mark.parametrize("outer", ["sgd", "adamw"])
def test_speculative_syncs_are_torchfts_bits(outer: str) -> None:
    outer_of = sgd_nesterov if outer == "sgd" else _outer_adamw
    _assert_same(_loop(False, outer_of=outer_of), _loop(True, outer_of=outer_of))


def test_a_loop_that_leaves_the_outer_state_alone_keeps_the_speculative_step() -> None:
    """Any access of the outer state by the loop drops the speculative step (an edit a
    version counter may not show); pipeoff's own reads of it must not."""
    frags: list[Any] = []

    def keep(model: nn.Module, inner: optim.Optimizer, d: Any, manager: Any) -> None:
        frags.append(d._fragments[0])

    _loop(False, between=keep)
    assert frags and frags[-1]._spec.plan is not None
    assert not frags[-1]._spec.in_place


def test_the_outer_step_is_taken_before_the_decision_into_spares() -> None:
    """Right after the preparing step, before the decision: the speculative step is done
    (it waits for no gate), and the backups and the outer state, which a healing peer or
    a checkpoint reads then, are still the ones before the sync, as torchft's."""
    seen: dict[str, Any] = {}

    def look(model: nn.Module, inner: optim.Optimizer, d: Any, manager: Any) -> None:
        frag = d._fragments[0]
        if isinstance(d, pipeoff.ft.DiLoCo):
            assert frag._speculative
            frag._ex.wait("stepped", timeout=60)  # no gate: it does not wait for perform
        seen.setdefault("backups", []).append(
            {n: t.clone() for n, t in frag.original_parameters.items()})
        seen.setdefault("state", []).append(copy.deepcopy(
            frag._outer_optimizer.state_dict()["state"]))

    _loop(False, between=look)
    mine = dict(seen)
    seen.clear()
    _loop(True, between=look)
    for a, b in zip(mine["backups"], seen["backups"], strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)
    for a, b in zip(mine["state"], seen["state"], strict=True):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k]["momentum_buffer"], b[k]["momentum_buffer"]) for k in a)


def test_a_rejected_speculative_sync_drops_the_spares() -> None:
    _assert_same(_loop(False, commit=False), _loop(True, commit=False))


def _edit_lr(model: nn.Module, inner: optim.Optimizer, d: Any, manager: Any) -> None:
    for g in d._fragments[0]._outer_optimizer.param_groups:
        g["lr"] = g["lr"] * 0.5  # an outer schedule stepping between prepare and decision


def test_an_lr_edited_before_the_decision_is_the_one_stepped() -> None:
    """torchft reads the outer lr at the decision: a speculative step taken with the old
    one is dropped and the step taken again in place."""
    _assert_same(_loop(False, between=_edit_lr), _loop(True, between=_edit_lr))


def _heal(model: nn.Module, inner: optim.Optimizer, d: Any, manager: Any) -> None:
    """torchft's checkpoint loader of the fragment, called as a healing replica's quorum
    calls it (a peer's backups and outer state), between prepare and decision."""
    call = manager.register_state_dict_fn.call_args
    load_fn = [a for a in (*call.args, *call.kwargs.values()) if callable(a)][0]
    frag = d._fragments[0]
    # (The peer's state is read as pipeoff's own read: the loop's read of the outer state
    # would drop the speculative step by itself, and hide whether the load does.)
    peer = {"original_parameters": {n: t.clone() * 0.9 for n, t
                                    in frag.original_parameters.items()},
            "outer_optimizer": _outer._own_reads(lambda: copy.deepcopy(
                frag._outer_optimizer.state_dict()))()}
    load_fn(peer)


def test_a_healing_load_before_the_decision_takes_the_step_again() -> None:
    _assert_same(_loop(False, between=_heal), _loop(True, between=_heal))


def _decay_state(model: nn.Module, inner: optim.Optimizer, d: Any, manager: Any, *,
                 how: str = "in_place") -> None:
    """The loop edits the outer state before the decision (a momentum decay: in place,
    by a new tensor, or by a foreach op under a dispatch mode), after the speculative
    step copied it into the spares."""
    frag = d._fragments[0]
    if isinstance(d, pipeoff.ft.DiLoCo) and frag._speculative:
        frag._ex.wait("stepped", timeout=60)  # (the spares hold the state before the edit)
    if how == "foreach_under_a_mode":
        bufs = [v for st in frag._outer_optimizer.state.values() for v in st.values()
                if isinstance(v, torch.Tensor) and v.dim()]
        if bufs:  # (none before the first outer step)
            with PassThrough():
                torch._foreach_mul_(bufs, 0.5)
        return
    for st in frag._outer_optimizer.state.values():
        for k, v in list(st.items()):
            if isinstance(v, torch.Tensor) and v.dim():
                if how == "replaced":
                    st[k] = v * 0.5
                else:
                    v.mul_(0.5)


@pytest.mark.parametrize("how", ["in_place", "replaced", "foreach_under_a_mode"])
@pytest.mark.parametrize("outer", ["sgd", "adamw"])
def test_state_edited_in_place_before_the_decision_is_the_state_stepped(outer: str,
                                                                        how: str) -> None:
    """torchft steps the outer state as it is at the decision: a speculative step whose
    copy of the state predates an edit is dropped (a state tensor's version counter
    moved, another tensor took its place, or the loop accessed the state: a foreach op
    under a dispatch mode bumps no version) and the step taken again in place. Without
    the check, the edit is lost (the last case: a tester's find)."""
    outer_of = sgd_nesterov if outer == "sgd" else _outer_adamw

    def edit(*args: Any) -> None:
        _decay_state(*args, how=how)

    _assert_same(_loop(False, between=edit, outer_of=outer_of),
                 _loop(True, between=edit, outer_of=outer_of))


@pytest.mark.parametrize("how", ["in_place", "foreach_under_a_mode", "loaded_then_foreach"])
@pytest.mark.parametrize("inner_of", ["sgd", "full_offload"])
def test_a_state_edit_before_the_decision_is_the_state_stepped(inner_of: str, how: str) -> None:
    """The loop edits the outer state between a preparation and its decision: bitwise
    torchft's. Tester's finds, each lost the edit (a foreach op under a dispatch mode):
    over FullOffloadOptimizer (no sync tail) the state was shown as a plain dict; after
    the loop's ``load_state_dict()`` before the preparation (``loaded_then_foreach``),
    the torch loader's plain dict was shown until the next sync's end."""
    from pipeoff.optim import FullOffloadOptimizer

    sync, delay = 3, 1

    def run(torchft: bool) -> tuple[list[list[torch.Tensor]], dict[str, Any]]:
        model = make_model(0)
        inner: Any = (FullOffloadOptimizer(model, optim.SGD, lr=0.1) if inner_of == "full_offload"
                      else optim.SGD(model.parameters(), lr=0.1))
        outer = sgd_nesterov(model.parameters())
        cls = TorchftDiLoCo if torchft else pipeoff.ft.DiLoCo
        kw = {} if torchft else {"offload_to_cpu": True, "bucket_bytes": 64,
                                 "device_budget_bytes": 128}
        out = []
        with cls(_manager(), [model], inner, outer, sync, fragment_sync_delay=delay,
                 fragment_update_alpha=0.5, **kw) as d:
            for k in range(9):
                inner.zero_grad()
                x = torch.randn(2, 12, generator=torch.Generator().manual_seed(k))
                model(x).pow(2).mean().backward()
                inner.step()
                if how == "loaded_then_foreach" and k == 6:  # (after a sync, before the next)
                    outer.load_state_dict(copy.deepcopy(outer.state_dict()))
                if d._local_step == sync - delay and k > 2:  # prepared; decided next step
                    frag = d._fragments[0]
                    if not torchft and frag._speculative:
                        frag._ex.wait("stepped", timeout=60)  # (the spares: before the edit)
                    bufs = [v for st in outer.state.values() for v in st.values()
                            if isinstance(v, torch.Tensor) and v.dim()]
                    with PassThrough() if how != "in_place" else contextlib.nullcontext():
                        torch._foreach_mul_(bufs, 0.5)
                out.append([p.detach().clone() for p in model.parameters()])
            if not torchft:
                d.wait_for_sync()
            end = {"state": copy.deepcopy(outer.state_dict()["state"]),
                   "backups": {n: t.clone()
                               for n, t in d._fragments[0].original_parameters.items()}}
        return out, end

    _assert_same(run(False), run(True))


def _all_but_first(ps: Any) -> optim.Optimizer:
    return sgd_nesterov(list(ps)[1:])


def test_an_outer_optimizer_over_some_of_the_fragment_is_torchfts() -> None:
    """A fragment parameter left out of the outer optimizer (a frozen one, the usual
    ``[p for p in model.parameters() if p.requires_grad]``) is not stepped, its backup
    kept, as torchft does (the speculative step asked its plan of every backup: a bare
    KeyError)."""
    _assert_same(_loop(False, outer_of=_all_but_first), _loop(True, outer_of=_all_but_first))


# -- the waits of keeping the spares -----------------------------------------------------
def _held(pattern: str, *where: str) -> tuple[list[list[torch.Tensor]], dict[str, Any]]:
    """The loop with tasks matching ``pattern`` held until the training thread blocks in
    a wait called from ``where``."""
    with pipeoff.testing.hold_task(pattern) as release:
        watcher = release_when_waiting(release, *where)
        try:
            return _loop(False, steps=SYNC_EVERY + 1)
        finally:
            release.set()
            watcher.join()


def test_keeping_the_spares_waits_for_the_speculative_step() -> None:
    """The speculative step held until the training thread waits for the sync's writes
    (its read of the parameters after the syncing step): keep swaps the spares in only
    once they are written."""
    want = _loop(True, steps=SYNC_EVERY + 1)
    _assert_same(_held(r"outer:c\d+", "wait_for"), want)


def test_the_writes_wait_for_the_spares_to_be_kept() -> None:
    """keep held until the training thread waits for the sync and, unless the writes
    wait for keep, until they have run: the merges read the new global model only once
    it is kept (a write that ran first read the old one)."""
    want = _loop(True, steps=SYNC_EVERY + 1)
    syncs: list[Any] = []  # the sync's execution, taken when it is prepared
    main = threading.main_thread().ident or 0
    install()
    with pipeoff.testing.hold_task("keep") as release:

        def watch() -> None:  # (the state is read, never a clock)
            while not release.is_set():
                if syncs and waiting_in(stack_of(main), ()) is not None:
                    run = syncs[0]._run
                    writes = [i for i, t in enumerate(run.tasks) if t.name.startswith("write:")]
                    if all("keep" in run.tasks[i].deps for i in writes) or all(
                            run.terminal(i) for i in writes):
                        release.set()
                threading.Event().wait(0.001)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            got = _loop(False, steps=SYNC_EVERY + 1,
                        between=lambda m, i, d, mgr: syncs.append(d._fragments[0]._ex))
        finally:
            release.set()
            watcher.join()
    _assert_same(got, want)


# -- the user's outer state right after step() ---------------------------------------------
def _edit_after_every_step(torchft: bool, delay: int) -> tuple[list[list[torch.Tensor]],
                                                                dict[str, Any]]:
    """Right after every inner ``step()`` the loop halves the outer momentum in place
    (torchft's outer step ran before ``step()`` returned; pipeoff's runs under the next
    forward)."""
    model = make_model(0)
    inner = optim.SGD(model.parameters(), lr=0.1)
    outer = sgd_nesterov(model.parameters())
    cls = TorchftDiLoCo if torchft else pipeoff.ft.DiLoCo
    out = []
    copies: list[Any] = []
    with cls(_manager(), [model], inner, outer, SYNC_EVERY, fragment_sync_delay=delay,
             fragment_update_alpha=0.5, **({} if torchft else KW)) as d:
        for k in range(2 * SYNC_EVERY):
            _inner_step(model, inner, k)
            copies.append(pickle.loads(pickle.dumps(outer.state)))  # (torch.save's path)
            for st in outer.state.values():
                st["momentum_buffer"].mul_(0.5)
            out.append([p.detach().clone() for p in model.parameters()])
        if not torchft:
            d.wait_for_sync()
        end = {"state": copy.deepcopy(outer.state_dict()["state"]),
               "backups": {n: t.clone() for n, t in d._fragments[0].original_parameters.items()},
               "copies": [sorted(torch.cat([v.flatten() for st in c.values() for v in st.values()]
                                           ).tolist()) if c else [] for c in copies]}
    assert type(outer.state) is collections.defaultdict  # (DiLoCo's view is gone)
    return out, end


@pytest.mark.parametrize("delay", [0, 1])
def test_the_outer_state_edited_right_after_step_is_the_stepped_one(delay: int) -> None:
    """The sync's outer step (delay 0) or the keep of its spares (delay 1) held until
    the training thread blocks: the edit's access to ``outer_optimizer.state`` waits
    for it (or, without that wait, the read of the parameters that follows releases it,
    too late: the edit found no state yet, or was swapped out with the old storage)."""
    want = _edit_after_every_step(True, delay)
    held = r"outer:c\d+" if delay == 0 else "keep"
    install()
    with pipeoff.testing.hold_task(held) as release:
        watcher = release_when_any_waiting(release, ("_before_outer_state",), ("on_read",),
                                           ("wait_for_sync",))
        try:
            got = _edit_after_every_step(False, delay)
        finally:
            release.set()
            watcher.join()
    assert got[1].pop("copies") == want[1].pop("copies")  # a pickle waits too
    _assert_same(got, want)
