"""The threads backend: one worker thread per lane, FIFO per lane, events across lanes.

It is pipeoff's CPU stand-in for CUDA streams: ``execute`` returns at once,
each lane runs its tasks in issue order, and a task waits for its cross-lane
dependencies the way a stream waits on an event. Torch ops release the GIL, so
copies and compute on different lanes really run at the same time.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from pipeoff.executor import _exit
from pipeoff.executor._backend import HostBackend
from pipeoff.executor._run import Run

# Queued behind everything else on a lane: the worker returns when it gets here.
_STOP = object()
# The lane whose worker is the current thread, if it is one.
_current = threading.local()


def current_lane() -> str | None:
    """The lane the calling thread works for, or ``None`` if it is not a lane worker."""
    return getattr(_current, "lane", None)


class _LaneWorker:
    """A daemon thread draining a FIFO of ``(run, index)`` items or callables until stopped."""

    def __init__(self, lane: str, thread_name: str | None = None) -> None:
        self.lane = lane
        self._q: deque[Any] = deque()
        self._cond = threading.Condition(threading.Lock())
        self._thread = threading.Thread(target=self._loop, name=thread_name or f"pipeoff-{lane}",
                                        daemon=True)
        _exit.ensure_registered()
        self._thread.start()

    def submit(self, items: list[Any]) -> None:
        with self._cond:
            self._q.extend(items)
            self._cond.notify()

    def _loop(self) -> None:
        lane = self.lane
        _current.lane = lane or None  # the dispatcher ("") is not a lane
        q = self._q
        while True:
            with self._cond:
                while not q:
                    self._cond.wait()
                batch = list(q)
                q.clear()
            for item in batch:
                if item is _STOP:
                    return
                if callable(item):
                    item()
                else:
                    run, i = item
                    run.run_task(i, lane)


_workers: dict[str, _LaneWorker] = {}
_workers_lock = threading.Lock()
# Held while one execution enqueues onto several lanes, so that executions
# launched concurrently never interleave on lanes in different orders (which
# could make each wait on the other: a deadlock).
_dispatch_lock = threading.Lock()
# The windowed dispatcher's own worker, kept apart from the lane workers so
# that no user lane name can collide with it.
_dispatcher: _LaneWorker | None = None


def _worker(lane: str) -> _LaneWorker:
    w = _workers.get(lane)
    if w is None:
        with _workers_lock:
            w = _workers.get(lane)
            if w is None:
                w = _workers[lane] = _LaneWorker(lane)
    return w


def _dispatch_worker() -> _LaneWorker:
    global _dispatcher
    with _workers_lock:
        if _dispatcher is None:
            _dispatcher = _LaneWorker("", thread_name="pipeoff-dispatcher")
        return _dispatcher


def stop_lanes(deadline: float) -> list[str]:
    """Stop every lane worker once its queue drains (at exit); the names of those still running.

    A worker asked for afterwards starts afresh.
    """
    global _dispatcher
    stuck = []
    # The dispatcher first: until its windowed dispatches finish, they are
    # still feeding the lanes, and a stopped lane would strand their tasks.
    with _workers_lock:
        dispatch, _dispatcher = _dispatcher, None
    if dispatch is not None:
        dispatch.submit([_STOP])
        if not _exit.join_until(dispatch._thread, deadline):
            stuck.append(dispatch._thread.name)
    with _workers_lock:
        workers = list(_workers.values())
        _workers.clear()
    for w in workers:
        w.submit([_STOP])
    for w in workers:
        if not _exit.join_until(w._thread, deadline):
            stuck.append(w._thread.name)
    return stuck


def lane_threads() -> dict[str, threading.Thread]:
    """The lane threads started so far, by lane (they are created once per process)."""
    return {lane: w._thread for lane, w in _workers.items()}


class ThreadsBackend(HostBackend):
    """Runs each lane on its own thread; ``launch`` returns without waiting."""

    name = "threads"

    def launch(self, run: Run) -> None:
        lookahead = run.plan.schedule.lookahead
        if lookahead is None or lookahead >= run.n:
            self._launch_all(run)
        else:
            _dispatch_worker().submit([self._windowed(run, lookahead)])

    def _launch_all(self, run: Run) -> None:
        lanes = run.plan.lanes
        groups: dict[str, list[Any]] = {}
        for i, lane in enumerate(lanes):
            groups.setdefault(lane, []).append((run, i))
        workers = {lane: _worker(lane) for lane in groups}
        now = time.perf_counter_ns() - run.origin_ns
        run.enqueue_ns = [now] * run.n
        with _dispatch_lock:
            for lane, items in groups.items():
                workers[lane].submit(items)

    def _windowed(self, run: Run, lookahead: int) -> Callable[[], None]:
        def dispatch() -> None:
            lanes = run.plan.lanes
            for i in range(run.n):
                if i >= lookahead:
                    # Flow control, not a dependency: keep at most `lookahead`
                    # tasks issued ahead of the oldest unfinished one.
                    run.wait_terminal(i - lookahead)
                if run.error is not None:
                    # Hand the rest to their lanes without the window: each one
                    # waits for its dependencies there, then sees the error and
                    # cancels. Cancelling here instead would release staging
                    # that a task still running on another lane is writing.
                    rest: dict[str, list[Any]] = {}
                    for j in range(i, run.n):
                        rest.setdefault(lanes[j], []).append((run, j))
                    with _dispatch_lock:
                        for lane, items in rest.items():
                            _worker(lane).submit(items)
                    return
                run.enqueue_ns[i] = time.perf_counter_ns() - run.origin_ns
                w = _worker(lanes[i])
                with _dispatch_lock:
                    w.submit([(run, i)])

        return dispatch
