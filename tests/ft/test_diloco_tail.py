"""The part of a DiLoCo sync after its decision (the outer step and the writes) runs
under the next forward: each wait that orders its readers after it is needed, and a
failure reaches the caller once, reported to torchft.

Each test forces the interleaving it checks: the sync's writes (or outer step) are
held until the training thread blocks in the wait under test, or, with that wait
switched off, until the reader has run (and read what the sync had not written).
The reference is torchft's own DiLoCo on the same model and data.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from unittest.mock import create_autospec

import pytest
import torch
from torch import nn, optim
from torchft.local_sgd import DiLoCo as TorchftDiLoCo
from torchft.manager import Manager

import pipeoff
import pipeoff.ft
import pipeoff.testing
from pipeoff import StepFailedError
from pipeoff.ft._outer import WaitingState
from tests._stacks import install, release_when_waiting, stack_of, waiting_in
from tests.ft._diloco_replicas import make_model, sgd_nesterov

PIPELINED = {"offload_to_cpu": True, "bucket_bytes": 64, "device_budget_bytes": 128}
SYNC_EVERY = 2


class _Done:
    def wait(self, timeout: Any = None) -> bool:
        return True


def _manager() -> Any:
    """One replica that commits every sync (the all-reduce of one replica leaves the
    pseudo-gradients as they are)."""
    manager = create_autospec(Manager)
    manager._use_async_quorum = False
    manager.errored.return_value = None
    step = [0]

    def should_commit(*_: Any, **__: Any) -> bool:
        step[0] += 1
        return manager.report_error.call_count == 0

    manager.current_step.side_effect = lambda: step[0]
    manager.should_commit.side_effect = should_commit
    manager.allreduce.side_effect = lambda t, should_quantize=False: _Done()
    return manager


def _x() -> torch.Tensor:
    return torch.randn(4, 12, generator=torch.Generator().manual_seed(5))


def _inner_step(model: nn.Module, inner: optim.Optimizer) -> None:
    inner.zero_grad()
    model(torch.ones(2, 12)).pow(2).mean().backward()
    inner.step()


@contextmanager
def _diloco(torchft: bool = False, model: nn.Module | None = None,
            **kwargs: Any) -> Iterator[tuple[nn.Module, optim.Optimizer, Any, Any]]:
    """A model, its inner SGD and a DiLoCo (torchft's or pipeoff's pipelined one)
    syncing every ``SYNC_EVERY`` steps with an outer Nesterov SGD, alpha 0.5."""
    model = make_model(0) if model is None else model
    manager = _manager()
    inner = optim.SGD(model.parameters(), lr=0.1)
    outer = sgd_nesterov(model.parameters())
    cls = TorchftDiLoCo if torchft else pipeoff.ft.DiLoCo
    extra = {} if torchft else {**PIPELINED, **kwargs}
    with cls(manager, [model], inner, outer, SYNC_EVERY, fragment_update_alpha=0.5,
             **extra) as d:
        yield model, inner, d, manager


def _reference(after: Callable[..., Any]) -> Any:
    """torchft's DiLoCo: one sync, then ``after(model, inner, diloco)``."""
    with _diloco(torchft=True) as (model, inner, d, _):
        for _ in range(SYNC_EVERY):
            _inner_step(model, inner)
        return after(model, inner, d)


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


# -- the forward waits ------------------------------------------------------------------
def _forward_after_a_held_sync(switch: str | None) -> torch.Tensor:
    """One sync whose writes are held until the next forward blocks in a module's wait
    (with the wait switched off: until the forward has run); that forward's output."""
    with _diloco() as (model, inner, d, _), \
            pipeoff.testing.disable(switch) if switch else _nothing():
        _inner_step(model, inner)
        with pipeoff.testing.hold_task(r"write:b.*") as release:
            _inner_step(model, inner)  # the sync: returns with every write held
            assert d._tail.in_flight
            watcher = release_when_waiting(release, "on_module", "wait_for")
            try:
                out = model(_x())
            finally:
                release.set()
                watcher.join()
        return out.detach()


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def test_the_next_forward_waits_for_the_merge() -> None:
    """step() returns once the quorum has decided; the next forward's modules wait for
    the writes of the parameters they read, and its output is torchft's bit for bit."""
    want = _reference(lambda model, inner, d: model(_x()).detach())
    assert torch.equal(_forward_after_a_held_sync(None), want)


def test_without_the_forward_waits_the_forward_reads_unmerged_parameters() -> None:
    """Hazard: the next forward reading parameters that the merge has not written. With
    the forward waits switched off the held writes land after the forward."""
    want = _reference(lambda model, inner, d: model(_x()).detach())
    assert not torch.equal(_forward_after_a_held_sync("diloco_forward_wait"), want)


@pytest.mark.timeout(60)
def test_a_module_waits_only_for_the_buckets_it_reads() -> None:
    """The last bucket's write held: the first block's forward runs (it reads other
    buckets only); a wait for every bucket would block here until the timeout."""
    with _diloco() as (model, inner, d, _):
        _inner_step(model, inner)
        n = len(d._fragments[0]._buckets)
        assert n >= 3
        with pipeoff.testing.hold_task(f"write:b{n - 1}") as release:
            _inner_step(model, inner)
            first = model[0](_x())  # reads buckets 0..k of the first Linear only
            pending = d._tail.waits[0].pending
            last = list(model.parameters())[-1]
            assert id(last) in pending  # its bucket: still held, not waited for
            release.set()
        out = model[1](first)
    want = _reference(lambda model, inner, d: model(_x()).detach())
    assert torch.equal(out.detach(), want)


def test_the_read_guard_makes_an_eager_read_wait() -> None:
    """A read outside every module's forward (a loss reading a weight, a log of its
    norm) on the training thread waits too, through the read guard."""
    with _diloco() as (model, inner, d, _):
        _inner_step(model, inner)
        with pipeoff.testing.hold_task(r"write:b.*") as release:
            _inner_step(model, inner)
            watcher = release_when_waiting(release, "on_read", "wait_for")
            try:
                got = [p.detach().clone() for p in model.parameters()]
            finally:
                release.set()
                watcher.join()
    assert all(torch.equal(a, b) for a, b in zip(got, _reference(lambda m, i, d: _params(m))))


# -- every other reader waits for all of it ---------------------------------------------
def _inner_step_after_a_held_sync(switch: str | None) -> list[torch.Tensor]:
    """One sync whose writes are held until the next inner step blocks in its pre-hook;
    no forward in between (gradients set by hand) and no read guard, so that only the
    pre-hook's wait orders the inner step after the merge."""
    with _diloco() as (model, inner, d, _), pipeoff.testing.disable("read_guard"), \
            pipeoff.testing.disable(switch) if switch else _nothing():
        _inner_step(model, inner)
        with pipeoff.testing.hold_task(r"write:b.*") as release:
            _inner_step(model, inner)
            for p in model.parameters():
                p.grad = torch.full(p.shape, 0.5)
            watcher = release_when_waiting(release, "_step_pre_hook")
            try:
                inner.step()
            finally:
                release.set()
                watcher.join()
        d.wait_for_sync()
        return _params(model)


def _inner_step_by_hand(model: nn.Module, inner: optim.Optimizer,
                        _d: Any = None) -> list[torch.Tensor]:
    for p in model.parameters():
        p.grad = torch.full(p.shape, 0.5)
    inner.step()
    return _params(model)


def test_the_inner_step_waits_for_the_merge() -> None:
    want = _reference(_inner_step_by_hand)
    got = _inner_step_after_a_held_sync(None)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_without_the_tail_wait_the_inner_step_is_overwritten() -> None:
    """Hazard: the inner step writing parameters the merge then overwrites (a compiled
    optimizer step, or one on another thread, which the read guard does not see)."""
    want = _reference(_inner_step_by_hand)
    got = _inner_step_after_a_held_sync("diloco_tail_wait")
    assert not all(torch.equal(a, b) for a, b in zip(got, want))


def _checkpoint_thread_reads(hold: str) -> dict[str, torch.Tensor]:
    """torchft's checkpoint function of the fragment (what a healing peer is sent),
    called on another thread while the sync's outer step is held; released once that
    thread blocks in its wait (with the wait gone: once it has returned)."""
    install()
    with _diloco() as (model, inner, d, manager):
        call = manager.register_state_dict_fn.call_args
        save_fn = [a for a in (*call.args, *call.kwargs.values()) if callable(a)][-1]
        _inner_step(model, inner)
        out: dict[str, Any] = {}
        with pipeoff.testing.hold_task(hold) as release:
            _inner_step(model, inner)
            t = threading.Thread(target=lambda: out.update(save_fn()), daemon=True)
            t.start()

            def watch() -> None:
                while t.is_alive() and not release.is_set():
                    if waiting_in(stack_of(t.ident or 0), ("save_fn",)) is not None:
                        break
                    threading.Event().wait(0.001)
                release.set()

            w = threading.Thread(target=watch, daemon=True)
            w.start()
            t.join(timeout=60)
            w.join(timeout=60)
        return {k: v.clone() for k, v in out["original_parameters"].items()}


def test_a_checkpoint_on_another_thread_waits_for_the_outer_step() -> None:
    # torchft's backup after a commit: the new global parameters (before the merge)
    want = _reference(lambda m, i, d: {n: t.clone()
                                       for n, t in d._fragments[0].original_parameters.items()})
    got = _checkpoint_thread_reads(r"outer:c.*")
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in got)


def test_the_figures_wait_for_the_sync_they_describe() -> None:
    """last_sync_stats and the stats hooks come once the tail is done, with its bytes
    and the forward hooks' waits in exposed_ms; one call per sync."""
    seen: list[Any] = []
    with _diloco() as (model, inner, d, _):
        d.register_sync_stats_hook(seen.append)
        for _ in range(2 * SYNC_EVERY):
            _inner_step(model, inner)
        stats = d.last_sync_stats
    assert len(seen) == 2 and stats is seen[-1]
    assert stats.committed and stats.h2d_bytes > 0 and stats.exposed_ms > 0
    assert d.last_trace is not None and d.last_trace.summary().failed == 0


# -- failures ---------------------------------------------------------------------------
def test_a_failed_write_reaches_the_next_forward_once_and_is_reported() -> None:
    with _diloco() as (model, inner, d, manager):
        _inner_step(model, inner)
        with pipeoff.testing.fail_work("write:b1", lambda: RuntimeError("write broke")):
            _inner_step(model, inner)
            with pytest.raises(RuntimeError, match="write broke") as info:
                model(_x())
        assert any("partly updated" in n for n in getattr(info.value, "__notes__", []))
        assert manager.report_error.call_count == 1
        assert not d._tail.in_flight
        model(_x())  # raised once: the loop may go on until the next sync
        _inner_step(model, inner)
        # torchft's next quorum forgets the error reported: that sync would commit the
        # partly written model, never healed (a tester's find). It is refused, before
        # its quorum, every time.
        for _ in range(2):
            with pytest.raises(StepFailedError, match="failed after its decision") as refused:
                _inner_step(model, inner)
            assert refused.value.__cause__ is info.value
        manager.start_quorum.assert_called_once()  # (the failed sync's own)
        assert manager.report_error.call_count == 1
    pools = pipeoff.pools_for("cpu")
    assert pools.device.stats().live_bytes == 0


def test_a_failed_sync_stops_only_once_its_started_tasks_have_finished() -> None:
    """With ``fragment_sync_delay=1``, bucket 2's pseudo-gradient fails while bucket
    1's formed pseudo-gradient is being staged to the host: the next inner step finds
    the failure and stops the sync, waiting for every task that started, before the
    step goes on and ``perform_sync`` restores the parameters (a task left running
    would outlive the sync, its staging and its trace). Forced: the failure waits
    until the staging has started, which is held until the training thread blocks
    in the stop's wait."""
    install()
    staging = threading.Event()

    def failure() -> BaseException:
        staging.wait(timeout=60)  # (stage:b1 has started, and holds)
        return RuntimeError("pseudo-gradient broke")

    # (staging for every bucket: the held one must not keep bucket 2 from its own)
    with _diloco(fragment_sync_delay=1, device_budget_bytes=4096) as (model, inner, d, manager):
        with pipeoff.testing.hold_task("stage:b1", reached=staging) as release, \
                pipeoff.testing.fail_task("pseudograd:b2", failure):
            watcher = release_when_waiting(release, "_stop")
            try:
                _inner_step(model, inner)  # prepare_sync: the sync is launched
                _inner_step(model, inner)  # finds the failure; perform_sync rejects
                returned_while_running = not release.is_set()
            finally:
                release.set()
                watcher.join()
        assert staging.is_set()
        assert not returned_while_running, "the failed sync was left running"
        assert manager.report_error.call_count == 1
        assert not d._fragments[0].last_committed


def test_exit_waits_for_the_tail() -> None:
    """Leaving DiLoCo's block waits for the last sync's writes and removes the hooks."""
    with pipeoff.testing.hold_task(r"write:b.*") as release:
        with _diloco() as (model, inner, d, _):
            for _ in range(SYNC_EVERY):
                _inner_step(model, inner)
            watcher = release_when_waiting(release, "__exit__")
        watcher.join()
    got = _params(model)
    want = _reference(lambda m, i, d: _params(m))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert not d._tail.in_flight and not model[0][0]._forward_pre_hooks


def test_the_users_outer_optimizer_state_dict_waits_for_the_outer_step() -> None:
    """``outer.state_dict()`` (a checkpoint of the user's outer optimizer) right after a
    sync shows the state its outer step creates: it waits for the held step."""
    with _diloco() as (model, inner, d, _):
        outer = d._fragments[0]._outer_optimizer
        _inner_step(model, inner)
        with pipeoff.testing.hold_task(r"outer:c.*") as release:
            _inner_step(model, inner)
            watcher = release_when_waiting(release, "_before_outer_read")
            try:
                state = outer.state_dict()["state"]
            finally:
                release.set()
                watcher.join()
    want = _reference(lambda m, i, d: d._fragments[0]._outer_optimizer.state_dict()["state"])
    assert sorted(state) == sorted(want) == list(range(6))
    assert all(torch.equal(state[k]["momentum_buffer"], want[k]["momentum_buffer"])
               for k in want)


def test_the_tails_waits_add_no_hook_at_the_forwards_end() -> None:
    """The tail writes weights and never reads gradients: its forward waits are pre-hooks
    only (a hook at the root forward's end is a graph break under torch.compile)."""
    with _diloco() as (model, inner, d, _):
        assert model[0][0]._forward_pre_hooks
        assert not any(m._forward_hooks for m in model.modules())


def test_a_failed_enter_leaves_nothing_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """``__enter__`` raising after the forward waits, the outer state's wrapping and the
    inner optimizer's first step hook were installed takes every one of them off again:
    the model and the optimizers are left as they were given."""
    model = make_model(0)
    inner = optim.SGD(model.parameters(), lr=0.1)
    outer = sgd_nesterov(model.parameters())
    d = pipeoff.ft.DiLoCo(_manager(), [model], inner, outer, SYNC_EVERY,
                          fragment_update_alpha=0.5, **PIPELINED)

    def refuse(*_: Any) -> Any:
        raise RuntimeError("hook refused")

    monkeypatch.setattr(inner, "register_step_post_hook", refuse)
    with pytest.raises(RuntimeError, match="hook refused"):
        d.__enter__()
    assert not any(m._forward_pre_hooks for m in model.modules())
    assert type(outer.state) is not WaitingState
    assert not outer._optimizer_state_dict_pre_hooks
    assert not inner._optimizer_step_pre_hooks



def _interrupt_then_release(main: int, where: str, release: threading.Event
                            ) -> threading.Thread:
    """A thread that sends SIGINT to ``main`` once it waits in ``where``, then sets
    ``release`` (held tasks go on after the interrupt: ordered by events)."""
    def run() -> None:
        install()
        while waiting_in(stack_of(main), (where,)) is None:
            time.sleep(0.001)
        signal.pthread_kill(main, signal.SIGINT)
        release.set()

    t = threading.Thread(target=run)
    t.start()
    return t


def test_a_ctrl_c_in_a_forwards_wait_for_the_tail_names_the_sync() -> None:
    """A Ctrl-C while a forward waits for the parameters the tail still writes: its note
    named "the optimizer step in flight" and wait_for_step(), which DiLoCo has not (a
    tester's find); it names the sync and wait_for_sync()."""
    main = threading.main_thread().ident
    assert main is not None
    with _diloco() as (model, inner, d, _manager):
        with pipeoff.testing.hold_task("write:b.*") as release:
            _inner_step(model, inner)
            _inner_step(model, inner)  # the sync: its tail in flight, its writes held

            t = _interrupt_then_release(main, "wait_for", release)
            with pytest.raises(KeyboardInterrupt) as info:
                model(torch.ones(2, 12))
            t.join()
        notes = " ".join(getattr(info.value, "__notes__", []))
        assert "DiLoCo's sync in flight" in notes and "wait_for_sync()" in notes, notes
        assert "wait_for_step" not in notes
        d.wait_for_sync()


def test_a_ctrl_c_in_the_tail_wait_keeps_a_failure_that_comes_after_it() -> None:
    """A Ctrl-C while the loop waits for the tail, whose write then fails: the wait let
    the tail end and dropped its failure, unreported, and later syncs committed the
    partly written model (a tester's find). The failure is reported, noted on the
    interrupt, and later syncs are refused."""
    main = threading.main_thread().ident
    assert main is not None
    with _diloco() as (model, inner, d, manager):
        with pipeoff.testing.hold_task("write:b1") as release, \
                pipeoff.testing.fail_work("write:b1", lambda: RuntimeError("write broke")):
            _inner_step(model, inner)
            _inner_step(model, inner)  # the sync: its tail in flight, write:b1 held
            assert d._tail.in_flight

            t = _interrupt_then_release(main, "wait_for_sync", release)
            with pytest.raises(KeyboardInterrupt) as info:
                d.wait_for_sync()
            t.join()
        assert any("tail failed meanwhile" in n for n in getattr(info.value, "__notes__", []))
        assert manager.report_error.call_count == 1
        _inner_step(model, inner)
        with pytest.raises(StepFailedError, match="failed after its decision"):
            _inner_step(model, inner)
