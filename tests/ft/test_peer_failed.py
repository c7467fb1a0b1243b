"""A replica group that fails a LocalSGD or DiLoCo sync still joins its all-reduces
(so that no peer waits), with values that are not its own to average: its error was
reported before the sync (torchft's ``allreduce`` is then a no-op), or its heal failed
(it was not participating, and torchft would have zeroed its values). Its healthy
peer must not commit that average: under torchft the peer's all-reduces time out and
it rejects the sync. Two real torchft replicas (threads) behind a real Lighthouse, on
gloo; the peer's parameters are compared with the values torchft's rejection leaves.

Before the vote (``pipeoff/ft/_collective.py``) the peer committed the average of
both replicas (error reported), or its own values plus the failed replica's stale ones,
summed and divided by a participant count that left the failed one out (heal failed;
a healing replica's values are now zeroed, as torchft's ``allreduce`` zeroes them).
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from torch import nn, optim
from torchft.coordination import LighthouseServer
from torchft.manager import Manager

import pipeoff.ft
import pipeoff.testing
from pipeoff import PeerSyncFailedError
from pipeoff.optim import FullOffloadOptimizer
from tests.ft._managers import replica_manager
from tests.ft.test_local_sgd_peers import FailingIssue, IssuedAfter

pytestmark = pytest.mark.slow  # two torchft managers and a Lighthouse per case (~3 s)

_LOCK = threading.Lock()


def _model(seed: int) -> nn.Module:
    with _LOCK:  # (the global RNG, shared by the two threads)
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(16, 37), nn.ReLU(), nn.Linear(37, 5))


def _wrap(kind: str, manager: Manager, model: nn.Module, opt: optim.Optimizer) -> Any:
    if kind == "local_sgd_sync":
        return pipeoff.ft.LocalSGD(manager, model, opt, 1, offload_to_cpu=True,
                                   schedule="synchronous")
    if kind == "local_sgd_buckets":
        return pipeoff.ft.LocalSGD(manager, model, opt, 1, offload_to_cpu=True,
                                   bucket_bytes=100, device_budget_bytes=200)
    outer = optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    return pipeoff.ft.DiLoCo(manager, [model], opt, outer, 1, offload_to_cpu=True,
                             bucket_bytes=100, device_budget_bytes=200)


def _replica(i: int, lighthouse: str, kind: str, how: str,
             order: list[threading.Event] | None = None) -> dict[str, Any]:
    if how == "issue":
        assert order is not None
        return _issue_fails(i, lighthouse, order)
    model = _model(i)
    before = [p.detach().clone() for p in model.parameters()]
    opt = optim.SGD(model.parameters(), lr=0.1)
    stepped: dict[str, list[torch.Tensor]] = {}
    opt.register_step_post_hook(lambda *_: stepped.__setitem__(
        "own", [p.detach().clone() for p in model.parameters()]))
    manager, _store = replica_manager(
        f"r{i}", lighthouse, state_dict=model.state_dict,
        load_state_dict=model.load_state_dict, min_replica_size=2 - (how == "heal"),
        use_async_quorum=how == "heal" and kind != "diloco")  # (DiLoCo: synchronous only)
    if how == "heal" and i == 0:
        manager._step = 2  # ahead: replica 1 heals from it
    elif how == "heal":
        def recv(*_: Any, **__: Any) -> Any:
            raise RuntimeError("injected: the checkpoint fetch failed")

        manager._checkpoint_transport.recv_checkpoint = recv  # type: ignore[method-assign]
    elif i == 1:  # an error reported after the quorum, before the averaging
        start = manager.start_quorum

        def start_quorum(*a: Any, **k: Any) -> Any:
            out = start(*a, **k)
            manager.report_error(RuntimeError("injected: this replica failed its step"))
            return out

        manager.start_quorum = start_quorum  # type: ignore[method-assign]
    try:
        with _wrap(kind, manager, model, opt) as w:
            opt.zero_grad()
            model(torch.randn(8, 16, generator=torch.Generator().manual_seed(i))).sum().backward()
            opt.step()  # sync_every=1: syncs
            if kind == "diloco":
                w.wait_for_sync()
        return {"after": [p.detach().clone() for p in model.parameters()],
                "before": before, "own": stepped["own"], "errored": manager.errored()}
    finally:
        manager.shutdown(wait=False)


@pytest.mark.parametrize("how", ["reported", "heal"])
@pytest.mark.parametrize("kind", ["local_sgd_sync", "local_sgd_buckets", "diloco"])
def test_a_peer_that_failed_the_sync_is_never_averaged_in(kind: str, how: str) -> None:
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    try:
        with ThreadPoolExecutor(2) as pool:
            healthy, failed = pool.map(_replica, range(2), [lighthouse.address()] * 2,
                                       [kind] * 2, [how] * 2)
    finally:
        lighthouse.shutdown()
    assert failed["errored"] is not None
    # torchft's rejection: LocalSGD keeps the local (stepped) values, DiLoCo restores
    # the backup (the values before the inner step).
    kept = healthy["before"] if kind == "diloco" else healthy["own"]
    for p, want in zip(healthy["after"], kept, strict=True):
        assert torch.equal(p, want), (p - want).abs().max()
    if how == "heal" and kind != "diloco":
        # The async quorum: the heal failed inside the first all-reduce, which torchft's
        # allreduce joins with zeros (not participating), as pipeoff's does every later
        # one: the peer's average is its own values, committed.
        assert healthy["errored"] is None, healthy["errored"]
    else:
        err = getattr(healthy["errored"], "original_exception", None)  # (torchft's wrapper)
        assert isinstance(err, PeerSyncFailedError), healthy["errored"]


def _issue_fails(i: int, lighthouse: str, order: list[threading.Event]) -> dict[str, Any]:
    """DiLoCo, pipelined in buckets: replica 1's second all-reduce raises as it is
    issued (torchft's ``Manager.allreduce`` reports it and returns its dummy work),
    and so does pipeoff's join of it as a failed replica's (the group is broken).
    ``order``: replica 1 has issued its first all-reduce; it has reported the failure
    of its second. The peer issues each of its first two only after the matching one."""
    model = _model(i)
    before = [p.detach().clone() for p in model.parameters()]
    opt = optim.SGD(model.parameters(), lr=0.1)
    pg = (FailingIssue(fail_at=2, timeout_s=3, issued=order[0], fails=2) if i == 1
          else IssuedAfter(order, timeout_s=3))
    manager, _store = replica_manager(f"r{i}", lighthouse, state_dict=model.state_dict,
                                      load_state_dict=model.load_state_dict, pg=pg,
                                      timeout_s=20)
    if i == 1:
        report = manager.report_error

        def report_error(e: Exception) -> None:
            report(e)
            if "injected" in str(e):
                order[1].set()

        manager.report_error = report_error  # type: ignore[method-assign]
    try:
        with _wrap("diloco", manager, model, opt) as w:
            opt.zero_grad()
            model(torch.randn(8, 16, generator=torch.Generator().manual_seed(i))).sum().backward()
            opt.step()  # sync_every=1: syncs
            w.wait_for_sync()
        return {"after": [p.detach().clone() for p in model.parameters()],
                "before": before, "errored": manager.errored()}
    finally:
        manager.shutdown(wait=False)


@pytest.mark.timeout(120)
def test_a_diloco_all_reduce_that_could_not_be_issued_fails_the_sync_on_both() -> None:
    """DiLoCo's sync skips its later all-reduces and the vote once torchft could not
    issue one, as torchft's does: the healthy peer times out once and rejects, and both
    restore their backups. Joining the later collectives one behind the peer's made
    gloo abort the peer (LocalSGD's case: ``test_local_sgd_peers.py``)."""
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    try:
        with ThreadPoolExecutor(2) as pool:
            order = [threading.Event(), threading.Event()]
            runs = list(pool.map(_replica, range(2), [lighthouse.address()] * 2,
                                 ["diloco"] * 2, ["issue"] * 2, [order] * 2))
    finally:
        lighthouse.shutdown()
    assert "injected" in str(runs[1]["errored"])
    assert runs[0]["errored"] is not None  # the peer's all-reduce timed out
    for run in runs:
        for p, want in zip(run["after"], run["before"], strict=True):
            assert torch.equal(p, want), (p - want).abs().max()


def _leaving(i: int, lighthouse: str, cls: Any = pipeoff.ft.DiLoCo) -> dict[str, Any]:
    """DiLoCo, ``fragment_sync_delay=1``: replica 1's loop raises right after the
    preparing step (every all-reduce of the sync joined or under way) and leaves the
    DiLoCo context, never to perform the sync."""
    model = _model(i)
    opt = optim.SGD(model.parameters(), lr=0.1)
    manager, _store = replica_manager(f"r{i}", lighthouse, state_dict=model.state_dict,
                                      load_state_dict=model.load_state_dict,
                                      min_replica_size=1)
    outer = optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    raised = None
    try:
        extra = ({"offload_to_cpu": True, "bucket_bytes": 100, "device_budget_bytes": 200}
                 if cls is pipeoff.ft.DiLoCo else {})
        with cls(manager, [model], opt, outer, 2, fragment_sync_delay=1, **extra) as d:
            for step in range(2):
                opt.zero_grad()
                model(torch.randn(8, 16, generator=torch.Generator().manual_seed(i))).sum(
                    ).backward()
                opt.step()  # step 0 prepares the sync (delay 1), step 1 performs it
                if step == 0 and i == 1:
                    raise RuntimeError("injected: replica 1's data loader failed")
            getattr(d, "wait_for_sync", lambda: None)()
    except RuntimeError as err:
        raised = err
    try:
        return {"errored": manager.errored(), "step": manager.current_step(),
                "raised": raised, "params": [p.detach().clone() for p in model.parameters()]}
    finally:
        manager.shutdown(wait=False)


def test_a_replica_that_leaves_after_its_all_reduces_lets_its_peer_commit() -> None:
    """The leaving replica joined every all-reduce, as torchft's does, so torchft's peer
    commits at once. pipeoff's peer waited in the sync's vote, which the leaving
    replica never joined, until the group's timeout (60 s), and rejected: the abandoned
    sync's vote is joined when it is abandoned."""
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    try:
        with ThreadPoolExecutor(2) as pool:
            healthy, left = pool.map(_leaving, range(2), [lighthouse.address()] * 2)
    finally:
        lighthouse.shutdown()
    assert left["raised"] is not None
    assert healthy["raised"] is None and healthy["errored"] is None, healthy
    assert healthy["step"] == 1  # committed


def _leave(cls: Any) -> list[dict[str, Any]]:
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    try:
        with ThreadPoolExecutor(2) as pool:
            return list(pool.map(_leaving, range(2), [lighthouse.address()] * 2, [cls] * 2))
    finally:
        lighthouse.shutdown()


def test_a_replica_that_leaves_before_its_pseudo_gradients_are_formed_gives_them_all() -> None:
    """The leaving replica's formation had not run when its loop raised (it runs under the
    next forward, which never came; here held until the replica waits in its abandon):
    torchft's prepare_sync formed every pseudo-gradient and issued its all-reduce, so its
    peer commits the full average. pipeoff's abandon failed the decision's gate first, the
    formation never ran, and the all-reduces were joined with zeros: the peer committed
    another average, silently (a tester's find). Bitwise torchft's peer."""
    from torchft.local_sgd import DiLoCo as TorchftDiLoCo

    from tests._stacks import release_when_any_waiting

    want = _leave(TorchftDiLoCo)
    with pipeoff.testing.hold_task("pseudograd:.*") as release:
        watcher = release_when_any_waiting(release, ("abandon",))
        got = _leave(pipeoff.ft.DiLoCo)
    watcher.join()
    assert got[0]["step"] == want[0]["step"] == 1 and got[0]["errored"] is None
    for a, b in zip(got[0]["params"], want[0]["params"], strict=True):
        assert torch.equal(a, b)


def _interrupted(i: int, lighthouse: str, kind: str) -> dict[str, Any]:
    """Replica 1 gets Ctrl-C in the wait of its sync's first all-reduce (after the
    collective: the peer's values arrived), as a slow peer makes likely."""
    model = _model(i)
    opt = optim.SGD(model.parameters(), lr=0.1)
    manager, _store = replica_manager(f"r{i}", lighthouse, state_dict=model.state_dict,
                                      load_state_dict=model.load_state_dict)
    if i == 1:
        real = manager.allreduce
        hit: list[bool] = []

        class Interrupted:
            def __init__(self, work: Any) -> None:
                self.work = work

            def wait(self, *a: Any, **k: Any) -> Any:
                out = self.work.wait(*a, **k)
                if not hit:
                    hit.append(True)
                    raise KeyboardInterrupt
                return out

        manager.allreduce = lambda *a, **k: Interrupted(real(*a, **k))  # type: ignore[method-assign]
    raised = None
    try:
        with _wrap(kind, manager, model, opt) as w:
            opt.zero_grad()
            model(torch.randn(8, 16, generator=torch.Generator().manual_seed(i))).sum().backward()
            opt.step()  # sync_every=1: syncs
            if kind == "diloco":
                w.wait_for_sync()
    except KeyboardInterrupt as err:
        raised = err
    try:
        return {"errored": manager.errored(), "step": manager.current_step(), "raised": raised}
    finally:
        manager.shutdown(wait=False)


@pytest.mark.parametrize("kind", ["local_sgd_sync", "local_sgd_buckets", "diloco"])
def test_ctrl_c_in_a_sync_still_lets_the_peer_commit(kind: str) -> None:
    """torchft's interrupted replica had issued its all-reduces, so its peer commits at
    once. pipeoff's peer also waits for the interrupted replica's vote: it was skipped
    (a tester's find), and the peer waited out the group's timeout and rejected."""
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    try:
        with ThreadPoolExecutor(2) as pool:
            healthy, stopped = pool.map(_interrupted, range(2), [lighthouse.address()] * 2,
                                        [kind] * 2)
    finally:
        lighthouse.shutdown()
    assert isinstance(stopped["raised"], KeyboardInterrupt), stopped
    assert healthy["raised"] is None and healthy["errored"] is None, healthy
    assert healthy["step"] == 1  # committed


def test_ctrl_c_while_a_diloco_sync_waits_before_its_decision_lets_the_peer_commit() -> None:
    """A real SIGINT to replica 1 (on the main thread) while its perform_sync() waits for
    the averages (replica 0's all-reduce held until then). The commit gate is failed
    with the interrupt, so the wait for the all-reduces re-raised it, and the vote was
    skipped (a tester's find): the peer waited out the timeout and rejected, where
    torchft's peer commits."""
    import signal
    import time

    from tests._interrupts import no_collection
    from tests._stacks import install, stack_of, waiting_in

    main = threading.main_thread().ident
    assert main is not None and threading.current_thread() is threading.main_thread()
    go = threading.Event()

    def watch() -> None:
        deadline = time.monotonic() + 120
        while waiting_in(stack_of(main), ("perform_sync", "_settle")) is None:
            if time.monotonic() > deadline:
                go.set()
                return
            time.sleep(0.001)
        signal.pthread_kill(main, signal.SIGINT)
        go.set()  # replica 0's all-reduce goes now

    def held(i: int, lighthouse: str) -> dict[str, Any]:
        model = _model(i)
        opt = optim.SGD(model.parameters(), lr=0.1)
        manager, _store = replica_manager(f"r{i}", lighthouse, state_dict=model.state_dict,
                                          load_state_dict=model.load_state_dict)
        if i == 0:
            real = manager.allreduce

            def late(*a: Any, **k: Any) -> Any:
                assert go.wait(120)
                return real(*a, **k)

            manager.allreduce = late  # type: ignore[method-assign]
        raised = None
        try:
            with _wrap("diloco", manager, model, opt) as w:
                opt.zero_grad()
                model(torch.randn(8, 16, generator=torch.Generator().manual_seed(i))).sum(
                    ).backward()
                opt.step()  # sync_every=1: syncs
                w.wait_for_sync()
        except KeyboardInterrupt as err:
            raised = err
        try:
            return {"errored": manager.errored(), "step": manager.current_step(),
                    "raised": raised}
        finally:
            manager.shutdown(wait=False)

    install()
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    watcher = threading.Thread(target=watch, daemon=True)
    try:
        with ThreadPoolExecutor(1) as pool, no_collection():
            peer = pool.submit(held, 0, lighthouse.address())
            watcher.start()
            stopped = held(1, lighthouse.address())
            healthy = peer.result()
    finally:
        go.set()
        watcher.join()
        signal.signal(signal.SIGINT, old)
        lighthouse.shutdown()
    assert isinstance(stopped["raised"], KeyboardInterrupt), stopped
    assert healthy["raised"] is None and healthy["errored"] is None, healthy
    assert healthy["step"] == 1  # committed


@pytest.mark.parametrize(("write_back", "inner"), [
    ("lands", "sgd"), ("fails", "sgd"), ("lands", "full_offload"),
    ("lands", "full_offload_refuses")])
def test_ctrl_c_in_a_pipelined_local_sgd_sync_is_passed_on_once_the_sync_has_ended(
        write_back: str, inner: str) -> None:
    """A real SIGINT to replica 1 (on the main thread) while it waits for its pipelined
    sync, the write-back held: the sync runs on to its end (the peer commits, and so does
    this replica), then the interrupt is passed on, saying so. It came with no word,
    from a wait that only happened to end with the sync (a tester's find). A write-back
    that fails after the commit is reported to torchft as without the Ctrl-C (a review's
    find: it was not), and the note says the parameters are partly averaged. Under
    FullOffloadOptimizer the masters take the average too, as after a sync that returned
    (they kept their own, and the loop that caught the Ctrl-C trained on from them,
    1e-2 off: a tester's find); if they refuse it, the Ctrl-C is still what is raised,
    and its note says so (a review's find: the refusal replaced it)."""
    import signal
    import time

    from tests._interrupts import no_collection
    from tests._stacks import install, stack_of, waiting_in

    main = threading.main_thread().ident
    assert main is not None and threading.current_thread() is threading.main_thread()
    delivered = threading.Event()

    def on_sigint(signum: int, frame: Any) -> None:
        delivered.set()
        raise KeyboardInterrupt

    def replica(i: int, lighthouse: str) -> dict[str, Any]:
        model = _model(i)
        opt: Any = (optim.SGD(model.parameters(), lr=0.1) if inner == "sgd" else
                    FullOffloadOptimizer(model, optim.SGD, lr=0.1, overlap="none"))
        stepped: dict[str, list[torch.Tensor]] = {}
        opt.register_step_post_hook(lambda *_: stepped.__setitem__(
            "own", [p.detach().clone() for p in model.parameters()]))
        if inner == "full_offload_refuses" and i == 1:
            def refuse() -> None:
                raise RuntimeError("refresh_masters() refused")

            opt.refresh_masters = refuse
        manager, _store = replica_manager(f"r{i}", lighthouse, state_dict=model.state_dict,
                                          load_state_dict=model.load_state_dict)
        raised: BaseException | None = None
        try:
            with _wrap("local_sgd_buckets", manager, model, opt):
                opt.zero_grad()
                model(torch.randn(8, 16, generator=torch.Generator().manual_seed(i))).sum(
                    ).backward()
                opt.step()  # sync_every=1: syncs
        except (KeyboardInterrupt, RuntimeError) as err:
            raised = err
        try:
            return {"step": manager.current_step(), "raised": raised, "own": stepped["own"],
                    "errored": manager.errored(),
                    "params": [p.detach().clone() for p in model.parameters()],
                    "masters": ([opt.host_master(p).clone() for p in model.parameters()]
                                if inner != "sgd" else None)}
        finally:
            manager.shutdown(wait=False)

    def watch(release: threading.Event) -> None:
        deadline = time.monotonic() + 120
        while waiting_in(stack_of(main), ("_offloaded_sync",)) is None:
            if time.monotonic() > deadline:
                break
            time.sleep(0.001)
        signal.pthread_kill(main, signal.SIGINT)
        delivered.wait(120)  # raised in the main thread's wait: the write-back still held
        release.set()

    install()
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    old = signal.signal(signal.SIGINT, on_sigint)
    try:
        fails = (pipeoff.testing.fail_task("h2d:b0", RuntimeError("the write-back failed"))
                 if write_back == "fails" else contextlib.nullcontext())
        with pipeoff.testing.hold_task("h2d:b.*") as release, no_collection(), fails, \
                ThreadPoolExecutor(1) as pool:
            watcher = threading.Thread(target=watch, args=(release,), daemon=True)
            peer = pool.submit(replica, 0, lighthouse.address())
            watcher.start()
            stopped = replica(1, lighthouse.address())
            healthy = peer.result()
        watcher.join()
    finally:
        signal.signal(signal.SIGINT, old)
        lighthouse.shutdown()
    assert isinstance(stopped["raised"], KeyboardInterrupt), stopped
    notes = " ".join(stopped["raised"].__notes__)
    assert "ran to its end" in notes
    if write_back == "fails":  # (both replicas' first write-back fails: both told torchft)
        assert "partly averaged" in notes
        assert stopped["errored"] is not None and healthy["errored"] is not None
        assert isinstance(healthy["raised"], RuntimeError)
        return
    assert "committed: the parameters hold the average" in notes
    if inner == "full_offload_refuses":
        assert "did not take the averaged weights as its masters" in notes
        assert "refresh_masters() refused" in notes
        return
    assert healthy["raised"] is None and healthy["step"] == stopped["step"] == 1
    for a, b, x, y in zip(stopped["params"], healthy["params"], stopped["own"],
                          healthy["own"], strict=True):
        assert torch.equal(a, b)  # both hold the average, whole
        assert torch.equal(a, (x + y) / 2)
    if inner == "full_offload":  # (FP32 weights: the masters are the weights, bit for bit)
        for run in (stopped, healthy):
            assert all(torch.equal(m, p) for m, p in zip(run["masters"], run["params"],
                                                         strict=True))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["local_sgd_sync", "local_sgd_buckets", "diloco"])
def test_an_error_out_of_torchfts_allreduce_skips_the_later_collectives(kind: str) -> None:
    """An exception raised out of ``manager.allreduce`` itself (a Ctrl-C in its wait
    for the quorum, under LocalSGD's synchronous schedule; a tester's find): the later
    all-reduces of the sync were joined one behind the peer's and gloo aborted the
    process (SIGABRT: no handler, no checkpoint). Now they are skipped, as torchft's
    propagating error skips them: the replica rejects, the peer times out and rejects.
    In a process of its own (the failure aborts it)."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-m", "tests.ft.allreduce_raises_worker", kind],
                         cwd=root, capture_output=True, text=True, timeout=150,
                         env={**os.environ, "PYTHONPATH": root})
    assert out.returncode == 0, (out.returncode, out.stderr[-3000:])
    failing, peer = json.loads(out.stdout.strip().splitlines()[-1])
    # (The sync's task failed: reported to the manager, so it rejects; not raised.)
    assert "injected" in str(failing["raised"] or failing["errored"]), failing
    assert peer["errored"] is not None  # (its all-reduce timed out: it rejected)
    if kind == "diloco":  # (rejected: both back at their backups; LocalSGD keeps its own)
        assert not any(peer["moved"]) and not any(failing["moved"])
