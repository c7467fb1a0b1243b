"""A Ctrl-C inside the main thread's calls into a lane or a gate leaves them usable.

CPython runs a signal's handler at the next eval-breaker check of whatever
Python frame runs then. A ``threading.Condition`` enters and exits its lock
from Python frames (``Condition.__enter__``/``__exit__``), so a Ctrl-C landing
between such a frame's start and its lock's release raised out of the
``with`` with the lock still held: every lane then blocked on it for good.
These tests raise ``KeyboardInterrupt`` at each Python frame's call and return
inside the main thread's call, one at a time (as a signal landing there
would), and check that a later submission or gate still goes through.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from pipeoff.executor import threads
from pipeoff.executor._gates import GateStates

_GENEROUS_S = 30.0  # only a lock left held makes these waits run out


def _interrupted_at(k: int, call: Callable[[], Any]) -> bool:
    """Run ``call`` with a ``KeyboardInterrupt`` raised at its ``k``-th frame
    event (a Python frame's call or return); ``True`` if it was raised."""
    seen = [0]
    fired = [False]

    def trace(frame: Any, event: str, arg: Any) -> Any:
        if event in ("call", "return") and not fired[0]:
            seen[0] += 1
            if seen[0] == k:
                fired[0] = True
                raise KeyboardInterrupt
        return trace

    sys.settrace(trace)
    try:
        call()
    except KeyboardInterrupt:
        assert fired[0]
    finally:
        sys.settrace(None)
    return fired[0]


def _completes(call: Callable[[], Any]) -> bool:
    """Whether ``call``, run on another thread, returns (a lock left held blocks it)."""
    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(_GENEROUS_S)
    return not t.is_alive()


def _sweep() -> Iterator[int]:
    yield from range(1, 200)


def test_a_ctrl_c_inside_a_lane_submission_leaves_the_lane_running() -> None:
    worker = threads._LaneWorker("test-interrupted-submit", 0)
    try:
        ran = []
        for k in _sweep():
            if not _interrupted_at(k, lambda: worker.submit([lambda: ran.append(1)])):
                break  # k is past the last frame event of a submission
            done = threading.Event()
            assert _completes(lambda: worker.submit([done.set])), f"lane blocked (event {k})"
            assert done.wait(_GENEROUS_S), f"lane stopped running items (event {k})"
        assert k > 1
    finally:
        _completes(lambda: worker.submit([threads._STOP]))  # (a held lock: a failure, no hang)


def test_a_ctrl_c_inside_a_gates_opening_leaves_the_gates_working() -> None:
    for k in _sweep():
        gates = GateStates(["a", "b"], 0, on_fail=lambda name, err: None)
        if not _interrupted_at(k, lambda: gates.open(0, None, None)):
            break
        assert _completes(lambda: gates.open(1, None, None)), f"gates blocked (event {k})"
        assert _completes(lambda: gates.wait([1])), f"a lane's wait blocked (event {k})"
    assert k > 1


def _queued(worker: threads._LaneWorker) -> int:
    """How many batches (or items) wait in the lane's queue."""
    q: Any = worker._q
    return q.qsize() if hasattr(q, "qsize") else len(q)


def test_a_ctrl_c_inside_a_lane_submission_never_strands_what_it_queued() -> None:
    """A submission cut by Ctrl-C queued its items and woke the lane, or queued
    nothing: never the items queued with the lane asleep (they would wait for the
    next submission, which may never come). The old notify() woke a waiter from
    Python frames; a lane that was not parked yet masked it, so each event is cut
    with the lane parked from the last round in all but a rare run."""
    worker = threads._LaneWorker("test-interrupted-wakeup", 0)
    try:
        for k in _sweep():
            ran = threading.Event()
            if not _interrupted_at(k, lambda: worker.submit([ran.set])):
                break
            if ran.is_set() or _queued(worker):
                assert ran.wait(_GENEROUS_S), f"queued, lane asleep (event {k})"
        assert k > 1
    finally:
        _completes(lambda: worker.submit([threads._STOP]))


def test_a_ctrl_c_inside_a_gates_opening_never_strands_a_parked_lane() -> None:
    """A gate opened by a call that Ctrl-C cut inside its wake-up (notify_all runs
    Python frames) still releases the lane parked on it."""
    for k in _sweep():
        gates = GateStates(["a"], 0, on_fail=lambda name, err: None)
        waiter = threading.Thread(target=lambda: gates.wait([0]), daemon=True)
        waiter.start()
        while not gates._cond._waiters:  # type: ignore[attr-defined]  # parked on the gate
            time.sleep(0.001)
        if not _interrupted_at(k, lambda: gates.open(0, None, None)):
            break
        if gates.state_name(0) == "pending":
            gates.open(0, None, None)  # cut before it settled: the caller opens it again
        waiter.join(_GENEROUS_S)
        assert not waiter.is_alive(), f"the gate is open, the lane sleeps (event {k})"
    assert k > 1


def test_the_sweep_reaches_a_conditions_frames_without_the_fix() -> None:
    """The sweep raises where a signal would leave a Condition's lock held: at
    ``Condition.__exit__``'s start (so these tests fail on the old code)."""
    cond = threading.Condition(threading.Lock())

    def old_submit() -> None:
        with cond:
            cond.notify()

    leaked = False
    for k in _sweep():
        if not _interrupted_at(k, old_submit):
            break
        if not cond._lock.acquire(blocking=False):  # type: ignore[attr-defined]
            leaked = True
            break
        cond._lock.release()  # type: ignore[attr-defined]
    assert leaked
