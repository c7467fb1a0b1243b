"""OffloadOptimizer on the patterns real training code uses (issue 9).

Each numbered input of the issue is a test here whose right value is plain
torch's result, plus sibling cases of the same kind. Overlap runs hold the
optimizer lane back (``delay_lane("compute", ...)``), so a missing wait is a
wrong number, not luck.
"""

from __future__ import annotations

import contextlib
import copy
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pipeoff
import pipeoff.testing
from pipeoff.optim import OffloadOptimizer
from tests._interrupts import no_collection

DELAY = 0.01
CHUNKED = ["chunked", "overlap"]


def run(model: nn.Module, opt: torch.optim.Optimizer, batches: list[Any],
        loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
        fwd: Callable[[Any], Any] | None = None,
        between: Callable[[int], None] | None = None) -> list[torch.Tensor]:
    """Train; overlap steps run with the optimizer lane held back. Returns the losses."""
    call = fwd if fwd is not None else model
    losses = []
    delayed = isinstance(opt, OffloadOptimizer) and opt.mode == "overlap"
    with pipeoff.testing.delay_lane("compute", DELAY) if delayed else contextlib.nullcontext():
        for t, x in enumerate(batches):
            if between is not None:
                between(t)
            loss = loss_fn(model, x) if loss_fn else call(x).float().pow(2).mean()
            losses.append(loss.detach().clone())
            loss.backward()
            opt.step()
            opt.zero_grad()
        if isinstance(opt, OffloadOptimizer):
            opt.wait_for_step()
    return losses


def assert_same(ref: nn.Module, ref_opt: torch.optim.Optimizer, mod: nn.Module,
                opt: OffloadOptimizer, ref_losses: list[torch.Tensor] | None = None,
                losses: list[torch.Tensor] | None = None) -> None:
    if ref_losses is not None:
        assert losses is not None
        for k, (a, b) in enumerate(zip(ref_losses, losses)):
            assert torch.equal(a, b), f"loss of step {k}"
    for (name, p), q in zip(ref.named_parameters(), mod.parameters()):
        assert torch.equal(p, q), name
        assert p.stride() == q.stride(), name
        state = opt.state[q]
        assert set(ref_opt.state[p]) == set(state), name
        for k, v in ref_opt.state[p].items():
            assert torch.equal(v, state[k]), (name, k)
            assert v.shape == state[k].shape, (name, k)


def batches(n: int, shape: tuple[int, ...] = (6, 8)) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(*shape, generator=g) for _ in range(n)]


def token_batches(n: int, vocab: int = 16) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (4, 5), generator=g) for _ in range(n)]


# -- 1. zero-element parameters and zero-byte chunks ---------------------------------------


class WithEmpties(nn.Module):
    """A Linear(4, 4) and zero-element parameters, placed by ``where``."""

    def __init__(self, where: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.e1 = nn.Parameter(torch.zeros(0, 4))
        self.e2 = nn.Parameter(torch.zeros(0))
        self.where = where

    def params(self) -> list[nn.Parameter]:
        lin, empties = list(self.lin.parameters()), [self.e1, self.e2]
        if self.where == "last":
            return lin + empties
        if self.where == "first":
            return empties + lin
        return [lin[0], self.e1, lin[1], self.e2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The empties take part (their grads are zero-element tensors).
        return self.lin(x[:, :4]) + self.e1.sum() + self.e2.sum()


EMPTY_OPTIMS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "adamw_amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
}


@pytest.mark.parametrize("mode", CHUNKED)
def test_zero_element_parameters_in_a_zero_byte_chunk(mode: str) -> None:
    """Issue 9, input 1: the Linear fills chunk 0 (160 bytes) exactly; the empties
    make a 0-byte chunk 1. Plain AdamW trains normally, and so must this."""
    ref, mod = WithEmpties("last"), WithEmpties("last")
    ref_opt = torch.optim.AdamW(ref.params(), lr=1e-2)
    opt = OffloadOptimizer(torch.optim.AdamW(mod.params(), lr=1e-2), mode=mode,  # type: ignore[arg-type]
                           chunk_bytes=160)
    assert [c.nbytes for c in opt.plan.chunks] == [160, 0]
    xs = batches(3)
    assert_same(ref, ref_opt, mod, opt, run(ref, ref_opt, xs), run(mod, opt, xs))


@pytest.mark.parametrize("optim", list(EMPTY_OPTIMS))
@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("chunk_bytes", [1, 96, 160, None])
@pytest.mark.parametrize("mode", CHUNKED)
def test_zero_element_parameters_wherever_they_fall(mode: str, chunk_bytes: int | None,
                                                    where: str, optim: str) -> None:
    ref, mod = WithEmpties(where), WithEmpties(where)
    ref_opt = EMPTY_OPTIMS[optim](ref.params())
    opt = OffloadOptimizer(EMPTY_OPTIMS[optim](mod.params()), mode=mode,  # type: ignore[arg-type]
                           chunk_bytes=chunk_bytes)
    xs = batches(3)
    assert_same(ref, ref_opt, mod, opt, run(ref, ref_opt, xs), run(mod, opt, xs))
    assert opt.state_dict()["state"].keys() == ref_opt.state_dict()["state"].keys()


# -- 2. the same parameter listed twice -------------------------------------------------------


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(16, 8)
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.emb(idx))))


@pytest.mark.parametrize("mode", CHUNKED)
def test_a_parameter_listed_twice_is_refused_at_construction(mode: str) -> None:
    """Issue 9, input 2: a tied weight collected from both modules. torch applies two
    updates in sequence; a chunked step would apply one, silently. Refused."""
    m = TiedLM()
    params = [*m.emb.parameters(), *m.body.parameters(), *m.head.parameters()]
    with pytest.raises(pipeoff.ConfigError, match=r"param_groups\[0\]\['params'\]\[3\].*"
                       r"also at param_groups\[0\]\['params'\]\[0\].*single_pass"):
        OffloadOptimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9), mode=mode)  # type: ignore[arg-type]


def test_a_parameter_listed_twice_matches_torch_in_single_pass() -> None:
    ref, mod = TiedLM(), TiedLM()

    def listed(m: TiedLM) -> list[nn.Parameter]:
        return [*m.emb.parameters(), *m.body.parameters(), *m.head.parameters()]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns about the duplicate
        ref_opt = torch.optim.SGD(listed(ref), lr=0.1, momentum=0.9)
        opt = OffloadOptimizer(torch.optim.SGD(listed(mod), lr=0.1, momentum=0.9),
                               mode="single_pass")
    xs = token_batches(3)
    assert_same(ref, ref_opt, mod, opt, run(ref, ref_opt, xs), run(mod, opt, xs))


@pytest.mark.parametrize("mode", CHUNKED)
def test_tied_weights_listed_once_are_exact(mode: str) -> None:
    ref, mod = TiedLM(), TiedLM()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = OffloadOptimizer(torch.optim.AdamW(mod.parameters(), lr=1e-2), mode=mode,  # type: ignore[arg-type]
                           chunk_bytes=128)
    opt.attach(mod)
    xs = token_batches(4)
    assert_same(ref, ref_opt, mod, opt, run(ref, ref_opt, xs), run(mod, opt, xs))


@pytest.mark.parametrize("mode", CHUNKED)
def test_a_duplicate_edited_into_the_groups_is_refused_before_anything_is_written(
        mode: str) -> None:
    ref, mod = TiedLM(), TiedLM()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = OffloadOptimizer(torch.optim.AdamW(mod.parameters(), lr=1e-2), mode=mode,  # type: ignore[arg-type]
                           chunk_bytes=128)
    xs = token_batches(3)
    run(ref, ref_opt, xs[:1])
    run(mod, opt, xs[:1])
    before = [p.detach().clone() for p in mod.parameters()]
    opt.param_groups[0]["params"].append(mod.body.weight)  # listed twice now
    mod(xs[1]).float().pow(2).mean().backward()
    with pytest.raises(pipeoff.ConfigError, match="also at"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, mod.parameters()))
    opt.param_groups[0]["params"].pop()  # fixed: the optimizer is still usable
    opt.step()
    opt.zero_grad()
    ref(xs[1]).float().pow(2).mean().backward()
    ref_opt.step()
    ref_opt.zero_grad()
    assert_same(ref, ref_opt, mod, opt, run(ref, ref_opt, xs[2:]), run(mod, opt, xs[2:]))


# -- 3. param_groups edited in place --------------------------------------------------------


class Three(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def _freeze_b(m: Three, opt: torch.optim.Optimizer) -> None:
    # A trainer freezing a layer by rewriting the group without it.
    g = opt.param_groups[0]
    g["params"] = [p for p in g["params"] if all(p is not q for q in m.b.parameters())]


def _remove_in_place(m: Three, opt: torch.optim.Optimizer) -> None:
    ps = opt.param_groups[0]["params"]
    del ps[[i for i, p in enumerate(ps) if p is m.c.bias][0]]


def _repoint(m: Three, opt: torch.optim.Optimizer) -> None:
    # A parameter replaced in the model and re-pointed in the group.
    new = nn.Parameter(m.b.weight.detach() * 0.5)
    g = opt.param_groups[0]
    g["params"][[i for i, p in enumerate(g["params"]) if p is m.b.weight][0]] = new
    m.b.weight = new


def _second_group_edit(m: Three, opt: torch.optim.Optimizer) -> None:
    # Move c into a group of its own with another learning rate, in place.
    g = opt.param_groups[0]
    cs = [p for p in g["params"] if any(p is q for q in m.c.parameters())]
    g["params"] = [p for p in g["params"] if all(p is not q for q in cs)]
    opt.param_groups.append({**{k: v for k, v in g.items() if k != "params"},
                             "params": cs, "lr": 0.05})


EDITS = {"freeze_b": _freeze_b, "remove_in_place": _remove_in_place, "repoint": _repoint,
         "new_group_in_place": _second_group_edit}


@pytest.mark.parametrize("edit", list(EDITS))
@pytest.mark.parametrize("mode", CHUNKED)
def test_param_groups_edited_in_place_are_picked_up(mode: str, edit: str) -> None:
    """Issue 9, input 3 and its siblings: the live param_groups are the truth."""
    ref, mod = Three(), Three()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = OffloadOptimizer(torch.optim.AdamW(mod.parameters(), lr=1e-2), mode=mode,  # type: ignore[arg-type]
                           chunk_bytes=256)
    opt.attach(mod)
    xs = batches(5)
    ref_losses = run(ref, ref_opt, xs[:2])
    losses = run(mod, opt, xs[:2])
    EDITS[edit](ref, ref_opt)
    EDITS[edit](mod, opt)
    ref_losses += run(ref, ref_opt, xs[2:])
    losses += run(mod, opt, xs[2:])
    assert_same(ref, ref_opt, mod, opt, ref_losses, losses)


def test_a_parameter_outside_the_attached_model_is_refused_before_anything_is_written() -> None:
    mod = Three()
    opt = OffloadOptimizer(torch.optim.AdamW(mod.parameters(), lr=1e-2), mode="overlap",
                           chunk_bytes=256)
    opt.attach(mod)
    xs = batches(2)
    run(mod, opt, xs[:1])
    stray = nn.Parameter(torch.zeros(3))
    opt.param_groups[0]["params"].append(stray)
    mod(xs[1]).pow(2).mean().backward()
    stray.grad = torch.ones(3)
    before = [p.detach().clone() for p in mod.parameters()]
    with pytest.raises(pipeoff.ConfigError, match=r"shape \(3,\).*not a parameter of the Three"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, mod.parameters()))
    assert torch.equal(stray, torch.zeros(3))


# -- 4. a parameter's layout changed after construction ------------------------------------


class Convs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.c1 = nn.Conv2d(3, 4, 3)
        self.c2 = nn.Conv2d(4, 2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c2(torch.relu(self.c1(x)))


@pytest.mark.parametrize("when", ["after", "before"])
@pytest.mark.parametrize("mode", CHUNKED)
def test_channels_last_before_or_after_construction(mode: str, when: str) -> None:
    """Issue 9, input 4: model.to(memory_format=channels_last) after the optimizer was built."""
    ref, mod = Convs(), Convs()
    if when == "before":
        ref.to(memory_format=torch.channels_last)
        mod.to(memory_format=torch.channels_last)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = OffloadOptimizer(torch.optim.AdamW(mod.parameters(), lr=1e-2), mode=mode,  # type: ignore[arg-type]
                           chunk_bytes=256)
    opt.attach(mod)
    xs = batches(4, (2, 3, 8, 8))
    ref_losses = run(ref, ref_opt, xs[:1])
    losses = run(mod, opt, xs[:1])
    if when == "after":
        ref.to(memory_format=torch.channels_last)
        mod.to(memory_format=torch.channels_last)
    ref_losses += run(ref, ref_opt, xs[1:])
    losses += run(mod, opt, xs[1:])
    assert_same(ref, ref_opt, mod, opt, ref_losses, losses)
    # The host state has the parameter's layout, as torch's own state does.
    for p in mod.parameters():
        for k, v in opt.state[p].items():
            if v.dim():
                assert v.stride() == p.stride(), k


@pytest.mark.parametrize("mode", CHUNKED)
def test_a_transposed_parameter_is_stepped_in_its_memory_order(mode: str) -> None:
    ref, mod = Three(), Three()
    for m in (ref, mod):
        m.b.weight.data = m.b.weight.data.t().contiguous().t()  # dense, not contiguous
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = OffloadOptimizer(torch.optim.SGD(mod.parameters(), lr=0.1, momentum=0.9),
                           mode=mode, chunk_bytes=200)  # type: ignore[arg-type]
    xs = batches(3)
    assert_same(ref, ref_opt, mod, opt, run(ref, ref_opt, xs), run(mod, opt, xs))


@pytest.mark.parametrize("mode", CHUNKED)
def test_a_parameter_that_is_not_dense_is_refused_before_anything_is_written(mode: str) -> None:
    mod = Three()
    opt = OffloadOptimizer(torch.optim.AdamW(mod.parameters(), lr=1e-2), mode=mode,  # type: ignore[arg-type]
                           chunk_bytes=256)
    xs = batches(3)
    run(mod, opt, xs[:1])
    dense = mod.c.bias.data
    mod.c.bias.data = torch.zeros(1).expand(4)  # four elements, one address: not dense
    mod(xs[1]).pow(2).mean().backward()
    before = [p.detach().clone() for p in mod.parameters()]
    with pytest.raises(pipeoff.ConfigError, match=r"strides \(0,\).*not dense"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, mod.parameters()))
    mod.c.bias.data = dense  # fixed: the optimizer is still usable
    opt.step()
    opt.wait_for_step()


# -- 5. validate before mutating --------------------------------------------------------------


def _attached_overlap() -> tuple[Three, Three, torch.optim.Optimizer, OffloadOptimizer]:
    ref, mod = Three(), Three()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = OffloadOptimizer(torch.optim.AdamW(mod.parameters(), lr=1e-2), mode="overlap",
                           chunk_bytes=256)
    opt.attach(mod)
    return ref, mod, ref_opt, opt


BAD_GROUPS: dict[str, Callable[[Three], dict[str, Any]]] = {
    # Issue 9, input 5: a scalar parameter that is not part of the attached model.
    "not_in_model": lambda m: {"params": [nn.Parameter(torch.zeros(()))]},
    "other_device": lambda m: {"params": [nn.Parameter(torch.zeros(2, device="meta"))]},
    "already_listed": lambda m: {"params": [m.a.weight]},  # torch's own check
}


@pytest.mark.parametrize("bad", list(BAD_GROUPS))
def test_a_refused_add_param_group_changes_nothing(bad: str) -> None:
    ref, mod, ref_opt, opt = _attached_overlap()
    xs = batches(4)
    ref_losses, losses = run(ref, ref_opt, xs[:2]), run(mod, opt, xs[:2])
    groups = [dict(g) for g in opt.param_groups]
    hooks = list(opt._attach_handles)
    with pytest.raises((pipeoff.ConfigError, ValueError)):
        opt.add_param_group(BAD_GROUPS[bad](mod))
    assert len(opt.param_groups) == len(groups) == 1
    assert opt.param_groups[0]["params"] == groups[0]["params"]
    assert opt._attach_handles == hooks
    # Training goes on with every forward wait in place: bitwise.
    ref_losses += run(ref, ref_opt, xs[2:])
    losses += run(mod, opt, xs[2:])
    assert_same(ref, ref_opt, mod, opt, ref_losses, losses)


def test_a_refused_attach_keeps_the_old_hooks() -> None:
    ref, mod, ref_opt, opt = _attached_overlap()
    xs = batches(4)
    with pytest.raises(pipeoff.ConfigError, match="not a parameter of"):
        opt.attach(Three())  # another model
    with pytest.raises(pipeoff.ConfigError, match="needs a torch.nn.Module"):
        opt.attach("model")  # type: ignore[arg-type]
    with pipeoff.testing.disable("read_guard"):  # only the hooks can make this exact
        assert_same(ref, ref_opt, mod, opt, run(ref, ref_opt, xs), run(mod, opt, xs))


def test_a_refused_load_state_dict_loads_nothing() -> None:
    ref, mod, ref_opt, opt = _attached_overlap()
    xs = batches(3)
    run(ref, ref_opt, xs[:2])
    run(mod, opt, xs[:2])
    good = copy.deepcopy(opt.state_dict())
    bad = copy.deepcopy(good)
    bad["param_groups"][0]["lr"] = 123.0
    bad["state"][2]["exp_avg"] = torch.zeros(5)  # b.weight's moment, of another shape
    with pytest.raises(pipeoff.ConfigError, match=r"exp_avg.*shape \(5,\).*\(16, 16\)"):
        opt.load_state_dict(bad)
    assert opt.param_groups[0]["lr"] == 1e-2
    after = opt.state_dict()
    for k, st in good["state"].items():
        for key, v in st.items():
            assert torch.equal(v, after["state"][k][key]), (k, key)
    assert_same(ref, ref_opt, mod, opt, run(ref, ref_opt, xs[2:]), run(mod, opt, xs[2:]))


# -- 6 and 7. every way a forward, or a loss, reads a parameter ----------------------------


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.lin = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.lin(self.norm(h))


class FunctionalTied(nn.Module):
    """Issue 9, input 7: the top module owns no parameter and reads a child's weight
    functionally: the embedding and a tied output projection."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(16, 8)
        self.blocks = nn.Sequential(Block(), Block())

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = F.embedding(idx, self.emb.weight)
        return F.linear(self.blocks(h), self.emb.weight)


class SiblingRead(nn.Module):
    """A module whose forward reads its sibling's weight; the sibling never runs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.shared = nn.Linear(8, 8)
        self.user = _Reader(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.user(x)


class _Reader(nn.Module):
    def __init__(self, parent: SiblingRead) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.parent_ref = [parent]  # not a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.parent_ref[0].shared
        return self.proj(F.linear(x, shared.weight, shared.bias))


class CachedView(nn.Module):
    """A view of a weight cached before training and read in every forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(8, 8)
        self.out = nn.Linear(8, 8, bias=False)
        self.out_t = self.out.weight.detach().t()  # shares the weight's storage

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.first(x) @ self.out_t


class EarlyRead(nn.Module):
    """Reads ``late``'s weight functionally before ``late`` runs, in the same forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(8, 8)
        self.late = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(F.linear(x, self.late.weight))
        return self.late(self.first(x) * gate)


def _head_loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # A loss that reads a head's weight (an L2 penalty on it), after the forward.
    return m(x).float().pow(2).mean() + 1e-2 * m.blocks[1].lin.weight.pow(2).sum()


READS: dict[str, tuple[Callable[[], nn.Module], Callable[[int], list[Any]], Any]] = {
    "functional_tied": (FunctionalTied, token_batches, None),
    "sibling_read": (SiblingRead, lambda n: batches(n), None),
    "cached_view": (CachedView, lambda n: batches(n), None),
    "early_read": (EarlyRead, lambda n: batches(n), None),
    "loss_reads_head": (FunctionalTied, token_batches, _head_loss),
    "multihead_attention": (lambda: _seeded(lambda: nn.MultiheadAttention(8, 2,
                                                                            batch_first=True)),
                            lambda n: batches(n, (2, 5, 8)),
                            lambda m, x: m(x, x, x)[0].pow(2).mean()),
}


def _seeded(make: Callable[[], nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return make()


@pytest.mark.parametrize("attach", [True, False], ids=["attached", "never_attached"])
@pytest.mark.parametrize("case", list(READS))
def test_every_read_waits_for_the_chunk_that_writes_it(case: str, attach: bool) -> None:
    make, data, loss_fn = READS[case]
    ref, mod = make(), make()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = OffloadOptimizer(torch.optim.AdamW(mod.parameters(), lr=1e-2), mode="overlap",
                           chunk_bytes=96)
    if attach:
        opt.attach(mod)
    xs = data(5)
    assert_same(ref, ref_opt, mod, opt, run(ref, ref_opt, xs, loss_fn),
                run(mod, opt, xs, loss_fn))


@pytest.mark.parametrize("case", ["functional_tied", "sibling_read", "cached_view",
                                  "early_read"])
def test_what_the_hooks_cover_without_the_read_guard(case: str) -> None:
    """Modules that never run are waited for by the nearest hooked module that does, so
    the hooks alone cover a functional read of their parameters. A functional read of
    a parameter whose module runs later in the same forward needs the read guard (or
    what it learned): the control, which fails without it."""
    make, data, loss_fn = READS[case]
    ref, mod = make(), make()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = OffloadOptimizer(torch.optim.AdamW(mod.parameters(), lr=1e-2), mode="overlap",
                           chunk_bytes=96)
    opt.attach(mod)
    xs = data(4)
    ref_losses = run(ref, ref_opt, xs, loss_fn)
    # One forward makes every hooked module that runs known; from then on only what
    # the guard would catch is missing.
    with pipeoff.testing.disable("read_guard"):
        losses = run(mod, opt, xs, loss_fn)
    exact = all(torch.equal(a, b) for a, b in zip(ref_losses, losses))
    assert exact == (case != "early_read")


def test_the_read_guard_teaches_the_hooks_an_early_read() -> None:
    """After one guarded forward, the hook that ran before the read waits for it: the
    next forward is exact without the guard."""
    ref, mod = EarlyRead(), EarlyRead()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = OffloadOptimizer(torch.optim.AdamW(mod.parameters(), lr=1e-2), mode="overlap",
                           chunk_bytes=96)
    opt.attach(mod)
    xs = batches(5)
    ref_losses = run(ref, ref_opt, xs)
    losses = run(mod, opt, xs[:2])  # the second forward is guarded, and teaches the root
    assert opt._waits.learned(mod) == frozenset({id(mod.late.weight)})
    with pipeoff.testing.disable("read_guard"):
        losses += run(mod, opt, xs[2:])
    assert all(torch.equal(a, b) for a, b in zip(ref_losses, losses))


def test_a_module_that_never_runs_is_waited_for_by_the_nearest_module_that_does() -> None:
    """emb never runs as a module: the root's hook waits for it, and only for it; the
    blocks still overlap the step."""
    mod = FunctionalTied()
    opt = OffloadOptimizer(torch.optim.AdamW(mod.parameters(), lr=1e-2), mode="overlap",
                           chunk_bytes=96)
    opt.attach(mod)
    xs = token_batches(2)
    run(mod, opt, xs[:1])
    mod(xs[1]).pow(2).mean().backward()
    with pipeoff.testing.delay_lane("compute", 0.05), pipeoff.testing.disable("read_guard"):
        opt.step()
        ex = opt.last_execution
        assert ex is not None
        with torch.no_grad():
            F.embedding(xs[1], mod.emb.weight)  # what the root reads first
        mod(xs[1])
        waits = [w[0] for w in opt._last_waits]
        opt.wait_for_step()
    assert waits[0] == "hook_wait:FunctionalTied"
    assert "hook_wait:blocks.0.norm" in waits  # the blocks waited for their own chunks


COMPILES = ["compile_then_attach", "attach_then_compile", "in_place", "per_layer",
            "warm_up_then_attach", "never_attached"]


def _compiled(kind: str, m: nn.Module, opt: Any, backend: str) -> Callable[[Any], Any]:
    def att(x: nn.Module) -> None:
        if isinstance(opt, OffloadOptimizer) and kind != "never_attached":
            opt.attach(x)

    if kind == "compile_then_attach":
        fwd = torch.compile(m, backend=backend)
        att(fwd)
    elif kind in ("attach_then_compile", "never_attached"):
        att(m)
        fwd = torch.compile(m, backend=backend)
    elif kind == "in_place":
        m.compile(backend=backend)
        att(m)
        fwd = m
    elif kind == "per_layer":
        for b in m.blocks:  # type: ignore[union-attr]
            b.compile(backend=backend)
        att(m)
        fwd = m
    else:  # warm_up_then_attach: compiled code traced before the hooks existed
        fwd = torch.compile(m, backend=backend)
        with torch.no_grad():
            fwd(token_batches(1)[0])
        att(m)
    return fwd  # type: ignore[return-value]


@pytest.mark.slow  # torch.compile with aot_eager: 3-6 s each
@pytest.mark.parametrize("kind", COMPILES)
def test_torch_compile_reads_no_stale_parameter(kind: str) -> None:
    """Issue 9, input 6 and its siblings, on FunctionalTied (input 7's model), against
    plain torch compiled the same way. ``aot_eager`` runs torch's own kernels, so the
    two are bitwise comparable."""
    torch._dynamo.reset()
    ref, mod = FunctionalTied(), FunctionalTied()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = OffloadOptimizer(torch.optim.AdamW(mod.parameters(), lr=1e-2), mode="overlap",
                           chunk_bytes=96)
    ref_fwd = _compiled(kind, ref, ref_opt, "aot_eager")
    fwd = _compiled(kind, mod, opt, "aot_eager")
    xs = token_batches(5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = run(mod, opt, xs, fwd=fwd)
    ref_losses = run(ref, ref_opt, xs, fwd=ref_fwd)
    assert_same(ref, ref_opt, mod, opt, ref_losses, losses)
    whole_step = [w for w in caught if "waited for the whole step" in str(w.message)]
    assert bool(whole_step) == (kind == "never_attached")


@pytest.mark.slow
def test_inductor_overlap_is_bitwise_chunked() -> None:
    """With inductor, the reference is chunked mode with the same hooks (the hooks are
    graph breaks, which change inductor's fusion, hence its bits)."""
    torch._dynamo.reset()
    results = []
    for mode in ("chunked", "overlap"):
        m = FunctionalTied()
        opt = OffloadOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-2), mode=mode,  # type: ignore[arg-type]
                               chunk_bytes=96)
        for b in m.blocks:
            b.compile()
        opt.attach(m)
        losses = run(m, opt, token_batches(4))
        results.append((losses, [p.detach().clone() for p in m.parameters()]))
    (ref_losses, ref_params), (losses, params) = results
    assert all(torch.equal(a, b) for a, b in zip(ref_losses, losses))
    assert all(torch.equal(a, b) for a, b in zip(ref_params, params))


# -- honest failure accounting ----------------------------------------------------------------


@pytest.mark.parametrize("mode", CHUNKED)
def test_a_chunk_that_fails_before_writing_is_not_counted(mode: str) -> None:
    mod = Three()
    opt = OffloadOptimizer(torch.optim.AdamW(mod.parameters(), lr=1e-2), mode=mode,  # type: ignore[arg-type]
                           chunk_bytes=256)
    xs = batches(2)
    run(mod, opt, xs[:1])
    mod(xs[1]).pow(2).mean().backward()
    with pipeoff.testing.fail_task("opt0", RuntimeError("boom")):
        with pytest.raises(RuntimeError, match="boom") as info:
            opt.step()
            opt.wait_for_step()
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "before any chunk wrote a parameter" in notes
    opt.step()  # not torn: it can be retried
    opt.wait_for_step()


# -- the race checker -------------------------------------------------------------------------


class WorkerThreadRead(nn.Module):
    """A fault no forward wait can see: a worker thread reads ``aux``'s weight while the
    trunk runs, before ``aux`` itself runs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.aux = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(1) as pool:
            side = pool.submit(F.linear, x, self.aux.weight)
            h = self.trunk(x)
        return self.aux(h) + side.result()


@pytest.mark.parametrize(("args", "kw", "match"), [
    (("class",), {}, "make_optimizer must build the optimizer from a model .*the class AdamW"),
    (("instance",), {}, "make_optimizer must .*an instance of AdamW"),
    (("fn",), {"loss_fn": 5}, "loss_fn must be a function, got 5"),
    (("fn",), {"attach": "no"}, "attach must be True or False"),
    (("fn", None), {}, "batches must be an iterable"),
    (("fn",), {"model": 3}, "model must be a torch.nn.Module or a function"),
])
def test_check_overlap_refuses_bad_arguments_by_name(args: tuple[Any, ...], kw: dict[str, Any],
                                                     match: str) -> None:
    """(A new user's finds: an optimizer class where the factory goes, the natural slip
    since the optimizers take a class, gave torch's "can only optimize Tensors".)"""
    from pipeoff import ConfigError
    from pipeoff.optim import check_overlap

    model = kw.pop("model", torch.nn.Linear(2, 2))
    make = {"class": torch.optim.AdamW, "fn": lambda m: torch.optim.AdamW(m.parameters()),
            "instance": torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())}[args[0]]
    xs = args[1] if len(args) > 1 else [torch.randn(3, 2) for _ in range(3)]
    with pytest.raises(ConfigError, match=match):
        check_overlap(model, make, xs, **kw)


def test_check_overlap_names_the_parameter_read_too_early() -> None:
    from pipeoff.optim import check_overlap

    report = check_overlap(WorkerThreadRead(),
                           lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
                           batches(4, (8, 16)))
    assert not report.ok
    assert report.first_bad_step == 1
    assert "aux.weight" in report.parameters
    assert set(report.owners) == {"aux"}
    assert report.readers == ("aux",)  # on the training thread, only aux itself reads it
    assert "'aux.weight' (of module 'aux')" in report.format()


@pytest.mark.parametrize("case", ["functional_tied", "cached_view", "multihead_attention"])
def test_check_overlap_passes_correct_models(case: str) -> None:
    from pipeoff.optim import check_overlap

    make, data, loss_fn = READS[case]
    report = check_overlap(make, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
                           data(3), loss_fn=loss_fn)
    assert report.ok, report.format()
    assert "OK" in report.format()


def test_check_overlap_refuses_bad_input() -> None:
    from pipeoff.optim import check_overlap

    with pytest.raises(pipeoff.ConfigError, match="at least 2"):
        check_overlap(Three(), lambda m: torch.optim.AdamW(m.parameters()), batches(1))
    with pytest.raises(pipeoff.ConfigError, match="delay_s"):
        check_overlap(Three(), lambda m: torch.optim.AdamW(m.parameters()), batches(2),
                      delay_s=0)
    with pytest.raises(pipeoff.ConfigError, match="model must be"):
        check_overlap(3, lambda m: torch.optim.AdamW(m.parameters()), batches(2))  # type: ignore[arg-type]


def test_the_checker_output_in_the_docs_is_what_it_prints(capsys: pytest.CaptureFixture[str]
                                                          ) -> None:
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "optimizer.md").read_text()
    section = text[text.index("## What overlap mode needs from your model"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)  # type: ignore[union-attr]
    shown = re.search(r"It prints:\n\n```text\n(.*?)```", section, re.S).group(1)  # type: ignore[union-attr]
    exec(compile(code, "optimizer.md", "exec"), {"__name__": "doc_check_overlap"})
    assert capsys.readouterr().out == shown


# -- found by a review that tried to break it -------------------------------------------------


@pytest.mark.parametrize("mode", CHUNKED)
def test_a_compiled_optimizer_step_runs_eagerly_inside_the_compiled_code(mode: str) -> None:
    """torch's "compile the optimizer step" recipe: Dynamo must not trace the launch."""
    torch._dynamo.reset()
    ref, mod = Three(), Three()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = OffloadOptimizer(torch.optim.AdamW(mod.parameters(), lr=1e-2), mode=mode,  # type: ignore[arg-type]
                           chunk_bytes=256)
    opt.attach(mod)
    compiled_step = torch.compile(opt.step, backend="eager")
    xs = batches(4)
    losses = []
    with pipeoff.testing.delay_lane("compute", DELAY if mode == "overlap" else 0.0):
        for x in xs:
            loss = mod(x).pow(2).mean()
            losses.append(loss.detach().clone())
            loss.backward()
            compiled_step()
            assert opt.last_execution is not None
            opt.zero_grad()
        opt.wait_for_step()
    assert_same(ref, ref_opt, mod, opt, run(ref, ref_opt, xs), losses)
    assert all(float(st["step"]) == 4 for st in opt.state.values())


ZEROING: dict[str, Callable[[nn.Module], None]] = {
    "module_zero_grad_in_place": lambda m: m.zero_grad(set_to_none=False),
    "grad_zero_": lambda m: [p.grad.zero_() for p in m.parameters() if p.grad is not None],
    "foreach_zero_": lambda m: torch._foreach_zero_(
        [p.grad for p in m.parameters() if p.grad is not None]),
}


@pytest.mark.parametrize("how", list(ZEROING))
def test_writing_the_grads_in_place_waits_for_the_step_reading_them(how: str) -> None:
    ref, mod = Three(), Three()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = OffloadOptimizer(torch.optim.AdamW(mod.parameters(), lr=1e-2), mode="overlap",
                           chunk_bytes=256)
    xs = batches(3)
    for m, o in ((ref, ref_opt), (mod, opt)):
        with pipeoff.testing.delay_lane("compute", DELAY if o is opt else 0.0):
            for x in xs:
                m(x).pow(2).mean().backward()
                o.step()
                ZEROING[how](m)  # the step in flight still reads these grads
        if o is opt:
            opt.wait_for_step()
    assert_same(ref, ref_opt, mod, opt)


def test_a_users_mode_around_the_step_keeps_the_read_guard() -> None:
    """``with torch.device(...)`` (a TorchFunctionMode) entered before step() pops the top
    of the mode stack when it exits: that must be itself, not pipeoff's guard."""
    ref, mod = EarlyRead(), EarlyRead()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = OffloadOptimizer(torch.optim.AdamW(mod.parameters(), lr=1e-2), mode="overlap",
                           chunk_bytes=96)
    xs = batches(4)
    depth = torch._C._len_torch_function_stack()
    losses = []
    with pipeoff.testing.delay_lane("compute", DELAY):
        for x in xs:
            loss = mod(x).pow(2).mean()
            losses.append(loss.detach().clone())
            with torch.device("cpu"):
                loss.backward()
                opt.step()
            opt.zero_grad()
        opt.wait_for_step()
    assert_same(ref, ref_opt, mod, opt, run(ref, ref_opt, xs), losses)
    assert torch._C._len_torch_function_stack() == depth  # nothing leaked


class EvalPath(nn.Module):
    """In training ``norm`` runs as a module; in evaluation its weight is read
    functionally (``norm`` never runs there)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        if self.training:
            return self.norm(h)
        return F.layer_norm(h, (32,), self.norm.weight, self.norm.bias)


def test_a_module_that_runs_in_training_but_not_in_evaluation_is_waited_for_there() -> None:
    """Which modules run is learned per kind of forward (training or not, grad mode): the
    evaluation forward's hooks wait for norm's parameters at the root. Hooks only (no
    read guard), as compiled code gets."""
    results = []
    for mode in ("chunked", "overlap"):
        m = EvalPath()
        opt = OffloadOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-2), mode=mode,  # type: ignore[arg-type]
                               chunk_bytes=128, read_guard=False)
        opt.attach(m)
        g = torch.Generator().manual_seed(3)
        evals = []
        with pipeoff.testing.delay_lane("compute", DELAY if mode == "overlap" else 0.0):
            for _ in range(4):
                m.train()
                m(torch.randn(4, 16, generator=g)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
                m.eval()
                with torch.no_grad():
                    evals.append(m(torch.randn(4, 16, generator=g)))
            opt.wait_for_step()
        results.append(evals)
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.parametrize("mode", CHUNKED)
def test_state_of_another_dtype_than_its_parameter_is_refused_before_anything_is_written(
        mode: str) -> None:
    """model.to(dtype) after the optimizer made state: torch mixes dtypes or refuses,
    by optimizer; a chunk stages state in the parameter's dtype, so it refuses."""
    mod = Three()
    opt = OffloadOptimizer(torch.optim.SGD(mod.parameters(), lr=0.1, momentum=0.9),
                           mode=mode, chunk_bytes=256)  # type: ignore[arg-type]
    xs = batches(3)
    run(mod, opt, xs[:1])
    mod.to(torch.float64)
    mod(xs[1].double()).pow(2).mean().backward()
    before = [p.detach().clone() for p in mod.parameters()]
    with pytest.raises(pipeoff.ConfigError, match="momentum_buffer.*float32.*float64"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, mod.parameters()))
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # casts the state, as torch does
    opt.step()
    opt.wait_for_step()


BF16_OPTIMS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam_maximize_wd": lambda ps: torch.optim.Adam(ps, lr=1e-2, maximize=True,
                                                    weight_decay=0.1),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5),
}


@pytest.mark.parametrize("optim", list(BF16_OPTIMS))
@pytest.mark.parametrize("chunk_bytes", [100, 1000])
def test_bf16_parameters_split_across_chunks_are_bitwise(chunk_bytes: int, optim: str) -> None:
    """CPU kernels round a bf16 tensor's vectorized body and its scalar tail differently,
    so bf16 parameters are split only where the whole tensor's vector lanes start."""

    def make() -> list[nn.Parameter]:
        g = torch.Generator().manual_seed(0)
        return [nn.Parameter(torch.randn(shape, generator=g).to(torch.bfloat16))
                for shape in ((300,), (37, 29), (5,))]

    ref, mine = make(), make()
    ref_opt = BF16_OPTIMS[optim](ref)
    opt = OffloadOptimizer(BF16_OPTIMS[optim](mine), mode="chunked", chunk_bytes=chunk_bytes)
    assert any(s.lo > 0 for c in opt.plan.chunks for s in c.segments)  # a parameter is split
    for step in range(3):
        g = torch.Generator().manual_seed(10 + step)
        for a, b in zip(ref, mine):
            grad = torch.randn(a.shape, generator=g).to(a.dtype)
            a.grad, b.grad = grad.clone(), grad.clone()
        ref_opt.step()
        opt.step()
    for a, b in zip(ref, mine):
        assert torch.equal(a, b)


def test_the_read_guard_can_be_turned_off_for_inference_fast_paths() -> None:
    """torch skips nn.TransformerEncoderLayer's inference fast path under any
    TorchFunctionMode. With read_guard=False (hooks only; check_overlap first), an
    evaluation that overlaps a step takes it, as without pipeoff."""

    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, batch_first=True)

    from pipeoff.optim import check_overlap

    report = check_overlap(make, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
                           batches(3, (2, 5, 16)), read_guard=False)
    assert report.ok, report.format()
    ref, mod = make(), make()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = OffloadOptimizer(torch.optim.AdamW(mod.parameters(), lr=1e-2), mode="overlap",
                           chunk_bytes=512, read_guard=False)
    opt.attach(mod)
    xs = batches(3, (2, 5, 16))
    outs = []
    for m, o in ((ref, ref_opt), (mod, opt)):
        evals = []
        torch.manual_seed(1)  # the same dropout masks in both runs
        with pipeoff.testing.delay_lane("compute", DELAY if o is opt else 0.0):
            for x in xs:
                m.train()
                m(x).pow(2).mean().backward()
                o.step()
                o.zero_grad()
                m.eval()
                with torch.no_grad():
                    evals.append(m(x))
        outs.append(evals)
    opt.wait_for_step()
    assert all(torch.equal(a, b) for a, b in zip(*outs))


TOGGLES: dict[str, Callable[[torch.optim.Optimizer], Callable[[], None]]] = {
    # Each returns how to undo it. torch raises in step()'s set-up and writes nothing.
    "amsgrad_on": lambda o: (o.param_groups[0].__setitem__("amsgrad", True),
                             lambda: o.param_groups[0].__setitem__("amsgrad", False))[1],
    "tensor_lr_foreach": lambda o: (
        o.param_groups[0].update(lr=torch.tensor(1e-2), foreach=True),
        lambda: o.param_groups[0].update(lr=1e-2, foreach=None))[1],
}


@pytest.mark.parametrize("toggle", list(TOGGLES))
@pytest.mark.parametrize("mode", CHUNKED)
def test_an_error_the_optimizer_raises_while_it_sets_up_is_not_a_torn_step(
        mode: str, toggle: str) -> None:
    ref, mod = Three(), Three()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    opt = OffloadOptimizer(torch.optim.Adam(mod.parameters(), lr=1e-2), mode=mode,  # type: ignore[arg-type]
                           chunk_bytes=256)
    xs = batches(4)
    ref_losses, losses = run(ref, ref_opt, xs[:2]), run(mod, opt, xs[:2])
    for m, o in ((ref, ref_opt), (mod, opt)):
        undo = TOGGLES[toggle](o)
        m(xs[2]).pow(2).mean().backward()
        with pytest.raises(Exception) as info:  # noqa: B017 - torch's own error
            o.step()
            if isinstance(o, OffloadOptimizer):
                o.wait_for_step()
        if o is opt:
            notes = "\n".join(getattr(info.value, "__notes__", []))
            assert "no parameter was written" in notes
        undo()
        o.step()  # the retry, as in torch
        o.zero_grad()
    ref_losses += run(ref, ref_opt, xs[3:])
    losses += run(mod, opt, xs[3:])
    assert_same(ref, ref_opt, mod, opt)


@pytest.mark.parametrize("mode", CHUNKED)
def test_ctrl_c_while_waiting_neither_fails_nor_repeats_the_step(mode: str) -> None:
    """overlap: the interrupted wait leaves the step in flight; chunked: step() finishes
    the step, then passes the interrupt on. Either way nothing is torn or repeated."""
    import os
    import signal

    ref, mod = Three(), Three()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = OffloadOptimizer(torch.optim.AdamW(mod.parameters(), lr=1e-2), mode=mode,  # type: ignore[arg-type]
                           chunk_bytes=256)
    xs = batches(3)
    ref_losses = run(ref, ref_opt, xs)
    losses = run(mod, opt, xs[:1])
    real_wait = pipeoff.Execution.wait
    interrupted: list[bool] = []

    def wait(self: pipeoff.Execution, *args: Any, **kwargs: Any) -> None:
        if not interrupted:
            interrupted.append(True)
            # Ctrl-C, delivered while the caller is inside the wait (a real
            # SIGINT: the handler raises at the next bytecode, in here).
            os.kill(os.getpid(), signal.SIGINT)
        return real_wait(self, *args, **kwargs)

    last = f"opt{len(opt.plan.chunks) - 1}"
    # overlap: the last chunk is held, so the step is still in flight after the
    # interrupt; chunked: step() waits for it again before passing the interrupt on.
    hold = (pipeoff.testing.hold_task(last) if mode == "overlap"
            else contextlib.nullcontext(threading.Event()))
    with pipeoff.testing.delay_lane("compute", 0.005), hold as release:
        loss = mod(xs[1]).pow(2).mean()
        losses.append(loss.detach().clone())
        loss.backward()
        pipeoff.Execution.wait = wait  # type: ignore[method-assign]
        try:
            with no_collection(), pytest.raises(KeyboardInterrupt) as info:
                opt.step()
                opt.wait_for_step()
        finally:
            pipeoff.Execution.wait = real_wait  # type: ignore[method-assign]
        notes = " ".join(getattr(info.value, "__notes__", []))
        assert "must not be repeated" in notes or "do not step again" in notes
        assert opt.last_execution is not None
        assert opt.last_execution.done() == (mode == "chunked")
        release.set()
        opt.zero_grad()
    losses += run(mod, opt, xs[2:])  # no StepFailedError: nothing failed
    assert_same(ref, ref_opt, mod, opt, ref_losses, losses)


def test_check_overlap_passes_a_model_with_dropout() -> None:
    from pipeoff.optim import check_overlap

    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 4))

    report = check_overlap(make, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
                           batches(3))
    assert report.ok, report.format()


def test_a_model_with_forward_waits_pickles_and_copies_with_inert_hooks() -> None:
    import io

    mod = Three()
    opt = OffloadOptimizer(torch.optim.AdamW(mod.parameters(), lr=1e-2), mode="overlap",
                           chunk_bytes=256)
    opt.attach(mod)
    buf = io.BytesIO()
    torch.save(mod, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    twin = copy.deepcopy(mod)
    for m in (back, twin):
        assert all(type(h).__name__ == "InertHook" for h in m.a._forward_pre_hooks.values())
        m(batches(1)[0])  # the inert hooks do nothing
    opt.detach()


@pytest.mark.parametrize(("module", "name"), [
    ("pipeoff.optim._hooks", "_inert_hook"), ("pipeoff.optim._hooks", "_Inert"),
    ("pipeoff.recording._train", "_inert"), ("pipeoff.recording._train", "_Inert"),
    ("pipeoff.optim._full_offload._intake", "_inert_probe"),
    ("pipeoff.optim._full_offload._intake", "_InertProbe")])
def test_a_model_pickled_with_older_inert_hooks_loads(module: str, name: str) -> None:
    """Models pickled before the hooks shared one InertHook name the older constructors
    (a hook's ``__reduce__``) and classes (a loaded model's inert hook pickled again):
    both still load (a reviewer's find: the classes' names were dropped)."""
    import importlib
    import pickle

    from pipeoff._inert import InertHook

    mod = importlib.import_module(module)
    ours = getattr(mod, name)

    class Old:
        def __call__(self, *args: Any) -> None:
            return None

    def old() -> Old:
        return Old()

    class Hook:  # a live hook, pickled by the old code through its constructor
        def __reduce__(self) -> Any:
            return (old, ())

    stand_in: Any = Old if name[1].isupper() else old
    stand_in.__module__, stand_in.__qualname__, stand_in.__name__ = module, name, name
    setattr(mod, name, stand_in)
    try:
        data = pickle.dumps(Old() if stand_in is Old else Hook())
    finally:
        setattr(mod, name, ours)
    assert isinstance(pickle.loads(data), InertHook)


def test_a_fullgraph_region_with_forward_waits_names_them() -> None:
    torch._dynamo.reset()
    mod = Three()
    opt = OffloadOptimizer(torch.optim.AdamW(mod.parameters(), lr=1e-2), mode="overlap",
                           chunk_bytes=256)
    opt.attach(mod)
    compiled = torch.compile(mod, backend="eager", fullgraph=True)
    with pytest.raises(Exception, match="pipeoff_OffloadOptimizer_forward_wait"):
        compiled(batches(1)[0])
    torch._dynamo.reset()


def test_check_overlap_takes_a_transformers_model_and_its_dict_batches() -> None:
    """A newcomer's first call: an HF causal LM and tokenizer-style dict batches with
    labels. The default loss is the output's ``.loss``."""
    transformers = pytest.importorskip("transformers")
    from pipeoff.optim import check_overlap

    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, max_position_embeddings=16)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(1)
    data = []
    for _ in range(3):
        ids = torch.randint(0, 32, (2, 8), generator=g)
        data.append({"input_ids": ids, "labels": ids.clone()})
    report = check_overlap(model, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), data)
    assert report.ok, report.format()


def test_check_overlap_says_to_pass_a_loss_fn_for_outputs_it_cannot_use() -> None:
    from pipeoff.optim import check_overlap

    class Strings(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> str:
            return "not a tensor"

    with pytest.raises(pipeoff.ConfigError, match="pass loss_fn="):
        check_overlap(Strings(), lambda m: torch.optim.AdamW(m.parameters()),
                      [torch.ones(1, 4)] * 2)


def test_the_compile_session_guard_is_in_before_the_first_step() -> None:
    """``OffloadOptimizer(mode="overlap")`` guards torch.compile's session (so that no
    chunk's math runs while ``is_compiling()`` is set) from its construction: installed
    lazily at the first chunk, a compile session that began before it (the next
    forward's recompile, another compiled module called while the step is in flight)
    was unguarded, and a chunk took torch.optim's compiled-code branch (other bits;
    found with a compiled model and no attach()). A fresh interpreter: in this one an
    earlier test has installed it already."""
    code = (
        "import torch\n"
        "original = torch.compiler._compile_session_context\n"
        "from pipeoff.optim import OffloadOptimizer\n"
        "assert torch.compiler._compile_session_context is original\n"
        "p = torch.nn.Parameter(torch.ones(4))\n"
        "OffloadOptimizer(torch.optim.AdamW([p]), mode='overlap')\n"
        "assert torch.compiler._compile_session_context is not original, 'no guard'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.slow  # torch.compile with aot_eager
def test_a_torch_nn_root_compiled_before_attach_runs_with_the_hooks() -> None:
    """An ``nn.Sequential`` (a ``torch.nn.*`` class) compiled and run before ``attach()``:
    torch.compile runs such a root in ``wrap_inline``'s frame, whose code was compiled
    without hook guards and kept running without attach()'s waits, so with
    ``read_guard=False`` the forward read weights the step was still writing (8e-2 off,
    or autograd's in-place error)."""
    torch._dynamo.reset()
    # As in a fresh process: no attach() yet has turned Dynamo's hook guards on. (Not
    # monkeypatch: its undo deletes a config module's attribute, for the whole session.)
    prior = torch._dynamo.config.skip_nnmodule_hook_guards
    torch._dynamo.config.skip_nnmodule_hook_guards = True
    try:
        _compiled_before_attach()
    finally:
        torch._dynamo.config.skip_nnmodule_hook_guards = prior


def _compiled_before_attach() -> None:
    def net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 4))

    xs = [torch.randn(8, 64, generator=torch.Generator().manual_seed(s)) for s in range(4)]
    m, ref = net(), net()
    opt = OffloadOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-2), mode="overlap",
                           chunk_bytes=8192, read_guard=False)
    fwd = torch.compile(m, backend="aot_eager")
    fwd(xs[0]).sum()  # the warm-up (grad mode on, as in training), before attach()
    opt.attach(m)
    with pipeoff.testing.delay_lane("compute", 0.02):  # (the step still in flight)
        for x in xs:
            fwd(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    opt.wait_for_step()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for x in xs:
        ref(x).pow(2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), ref.parameters(), strict=True))
