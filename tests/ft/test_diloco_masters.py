"""Under FullOffloadOptimizer, whose FP32 host masters are the truth, an offloaded DiLoCo
sync works on the masters: pseudo-gradients ``backup - master`` on the host, the merge
computed in FP32 into the masters, the weights written as their casts, and FP32
backups (docs/diloco.md, "Under FullOffloadOptimizer")."""

from __future__ import annotations

import copy
from typing import Any
from unittest.mock import create_autospec

import pytest
import torch
from torch import nn, optim
from torchft.manager import Manager

import pipeoff
import pipeoff.ft
import pipeoff.testing
from pipeoff.optim import FullOffloadOptimizer
from tests.ft._diloco_replicas import make_model, sgd_nesterov

SYNC_EVERY = 2
ALPHA = 0.5


class _Done:
    def wait(self, timeout: Any = None) -> bool:
        return True


def _manager(commit: bool = True) -> Any:
    manager = create_autospec(Manager)
    manager._use_async_quorum = False
    manager.errored.return_value = None
    step = [0]

    def should_commit(*_: Any, **__: Any) -> bool:
        step[0] += 1
        return commit and manager.report_error.call_count == 0

    manager.current_step.side_effect = lambda: step[0]
    manager.should_commit.side_effect = should_commit
    manager.allreduce.side_effect = lambda t, should_quantize=False: _Done()
    return manager


def _bf16_model() -> nn.Module:
    model = make_model(0).to(torch.bfloat16)
    model.register_forward_pre_hook(lambda m, args: (args[0].to(torch.bfloat16),))
    return model


def _run(commit: bool = True, syncs: int = 2, **kw: Any) -> dict[str, Any]:
    """BF16 weights under FullOffloadOptimizer, one fragment, an offloaded pipelined
    DiLoCo with Nesterov SGD; per sync, the masters and backups just before it (the
    inner step done) and the masters, backups and weights after it."""
    model = _bf16_model()
    inner = FullOffloadOptimizer(model, optim.AdamW, lr=1e-2, weight_decay=0.1)
    outer = sgd_nesterov(model.parameters())
    params = list(model.parameters())
    out: dict[str, Any] = {"before": [], "after": [], "refreshed": 0}
    refresh = inner.refresh_masters

    def spy(ps: Any = None) -> None:
        out["refreshed"] += 1
        refresh(ps)

    inner.refresh_masters = spy  # type: ignore[method-assign]
    d = pipeoff.ft.DiLoCo(_manager(commit), [model], inner, outer, SYNC_EVERY,
                          fragment_update_alpha=ALPHA, offload_to_cpu=True, bucket_bytes=256,
                          **kw)
    frag = d._fragments[0]
    assert frag.on_masters

    def capture(*_: Any) -> None:  # (registered before DiLoCo's: runs first)
        if d._local_step + 1 == SYNC_EVERY:
            inner.wait_for_step()
            out["before"].append(([inner.host_master(p).clone() for p in params],
                                  [b.clone() for b in frag._backups]))

    inner.register_step_post_hook(capture)
    with d:
        for _ in range(SYNC_EVERY * syncs):
            inner.zero_grad()
            model(torch.ones(2, 12)).float().pow(2).mean().backward()
            inner.step()
            if d._local_step == 0:
                inner.wait_for_step()
                out["after"].append(([inner.host_master(p).clone() for p in params],
                                     [b.clone() for b in frag._backups],
                                     [p.detach().clone() for p in params]))
    out["outer"] = outer
    return out


def _check_merges(out: dict[str, Any], read: Any = lambda t: t) -> None:
    """Every sync of ``out``: the masters are torchft's merge computed in FP32 from the
    masters (pseudo-gradient backup - master, the outer step, lerp by alpha), bit for
    bit; the weights are their casts; the backups are FP32 and the new global model."""
    ref_backup: list[torch.Tensor] | None = None
    ref_outer: optim.Optimizer | None = None
    for (m0, b0), (m1, b1, w1) in zip(out["before"], out["after"], strict=True):
        assert all(b.dtype == torch.float32 for b in b0)
        if ref_backup is None:
            ref_backup = [b.clone() for b in b0]
            ref_outer = optim.SGD(ref_backup, lr=0.7, momentum=0.9, nesterov=True)
        assert all(torch.equal(a, b) for a, b in zip(b0, ref_backup))
        for b, m in zip(ref_backup, m0):
            b.grad = torch.sub(b, m)
        assert ref_outer is not None
        ref_outer.step()
        want = [torch.lerp(b.detach(), m, ALPHA) for b, m in zip(ref_backup, m0)]
        assert all(torch.equal(a, b) for a, b in zip(m1, want))
        assert all(torch.equal(a, b.detach()) for a, b in zip(b1, ref_backup))
        assert all(torch.equal(read(w), m.to(torch.bfloat16)) for w, m in zip(w1, m1))


def test_the_sync_merges_the_fp32_masters() -> None:
    """The masters keep bits below BF16's after every sync (refresh_masters, which
    adopts the BF16 weights, is not called)."""
    out = _run()
    _check_merges(out)
    assert all(any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in m1)
               for m1, _, _ in out["after"])
    assert out["refreshed"] == 0


def test_a_rejected_sync_restores_the_masters_from_the_fp32_backup() -> None:
    out = _run(commit=False, syncs=1)
    (_, b0), (m1, b1, w1) = out["before"][0], out["after"][0]
    assert all(torch.equal(m, b) for m, b in zip(m1, b0))  # restored: the backup itself
    assert all(torch.equal(a, b) for a, b in zip(b1, b0))  # backup unchanged
    assert all(torch.equal(w, m.to(torch.bfloat16)) for w, m in zip(w1, m1))


def test_a_failure_before_the_decision_restores_the_masters() -> None:
    """torchft's failure path restores the parameters from the backup; on the masters,
    the masters too (with the weights their casts), not the widened weights."""
    with pipeoff.testing.fail_work("pseudograd:b0", lambda: RuntimeError("injected")):
        out = _run(syncs=1)
    (_, b0), (m1, _, w1) = out["before"][0], out["after"][0]
    assert all(torch.equal(m, b) for m, b in zip(m1, b0))
    assert all(torch.equal(w, m.to(torch.bfloat16)) for w, m in zip(w1, m1))


def test_the_outer_state_is_fp32_in_the_users_optimizer_and_checkpoints() -> None:
    out = _run(syncs=1)
    state = out["outer"].state_dict()["state"]
    assert state and all(s["momentum_buffer"].dtype == torch.float32 for s in state.values())
    copy.deepcopy(out["outer"].state_dict())  # (a checkpoint of it works)


def test_a_parameter_the_inner_optimizer_does_not_hold_keeps_the_weights_path() -> None:
    """Masters only if the inner optimizer holds every fragment parameter."""
    model = _bf16_model()
    inner = FullOffloadOptimizer(list(model.parameters())[:2], optim.AdamW, lr=1e-2)
    d = pipeoff.ft.DiLoCo(_manager(), [model], inner, sgd_nesterov(model.parameters()),
                          SYNC_EVERY, offload_to_cpu=True)
    assert not d._fragments[0].on_masters
    assert all(b.dtype == torch.bfloat16 for b in d._fragments[0]._backups)


@pytest.mark.timeout(120)
def test_two_replicas_of_fp32_weights_are_torchfts_bits() -> None:
    """With FP32 weights the masters are the weights: two real replicas behind a
    Lighthouse are torchft's (with plain AdamW) bit for bit, the sync on the masters."""
    from tests.ft.test_diloco import reference, run

    def inner(model: nn.Module) -> optim.Optimizer:
        return FullOffloadOptimizer(model, optim.AdamW, lr=1e-2, weight_decay=0.1)

    from tests.ft._diloco_replicas import assert_bitwise

    cfg = {"sync_every": 4, "fragment_sync_delay": 1, "fragment_update_alpha": 0.5}
    runs = run("pipelined", **cfg, inner=inner)
    assert_bitwise(runs, reference(**cfg))


def _reject_then_heal(replica: int, step: int, diloco: Any) -> None:
    if replica == 0 and step == 3:  # this replica rejects the sync, then heals from its peer
        diloco._manager.report_error(RuntimeError("injected"))


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("fragments", "delay"), [(2, 1), (1, 2)])
def test_a_healed_replica_syncs_from_the_healed_weights(fragments: int, delay: int) -> None:
    """torchft's heal writes the weights (the Manager's ``load_state_dict``) right before
    the next sync forms its pseudo-gradients: on the masters those weights are adopted
    first. Without it the healed replica averaged ``backup - stale master`` into both
    replicas (from the sync after the heal on, 4e-2 off at delay 1)."""
    from tests.ft._diloco_replicas import assert_bitwise
    from tests.ft.test_diloco import reference, run

    def inner(model: nn.Module) -> optim.Optimizer:
        return FullOffloadOptimizer(model, optim.AdamW, lr=1e-2, weight_decay=0.1)

    cfg = {"sync_every": 4, "fragment_sync_delay": delay, "steps": 12,
           "n_fragments": fragments, "on_step": _reject_then_heal}
    runs = run("pipelined", **cfg, inner=inner)
    assert any("injected" in str(e) for e in runs[0].errors_reported)
    assert_bitwise(runs, reference(**cfg))


def test_on_the_simulated_device_the_masters_path_is_race_free(gpu: Any) -> None:
    """The model on the (simulated) device, its lanes delayed: no access race (the host
    pseudo-gradients uploaded for the all-reduce, the masters' casts copied into the
    weights on the copy stream), and the same merges."""
    with pipeoff.testing.delay_lane("h2d", 0.002), pipeoff.testing.delay_lane("comm", 0.002):
        out = _run(syncs=2)
    gpu.synchronize()
    _check_merges(out, gpu.read)
