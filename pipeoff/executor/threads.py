"""The threads backend: one worker thread per lane, FIFO per lane, events across lanes.

It is pipeoff's CPU stand-in for CUDA streams: ``execute`` returns at once,
each lane runs its tasks in issue order, and a task waits for its cross-lane
dependencies the way a stream waits on an event. Torch ops release the GIL, so
copies and compute on different lanes really run at the same time.

**Lanes are shared per process, never between executions in flight.** Each
launch holds one *instance* of every lane it uses (a worker thread) until its
last task has finished. A launch that finds an instance of a lane held by
another unfinished execution takes (or creates) another instance. Two
executions therefore never queue behind each other: a task waiting for its
dependencies (a write-back waiting for a quorum's commit) or blocked inside
its work (a collective waiting for a peer replica) holds only its own
execution's lane. Executions run one after the other, the common case, reuse
the first instance of each lane.
"""

from __future__ import annotations

import queue
import threading
import time
import warnings
from typing import Any

from pipeoff import _accel, _happens
from pipeoff._errors import ConfigError
from pipeoff.executor import _exit
from pipeoff.executor._backend import HostBackend
from pipeoff.executor._run import Run

# Queued behind everything else on a lane: the worker returns when it gets here.
_STOP = object()
# The lane worker that the current thread is, if it is one.
_current = threading.local()


def current_lane() -> str | None:
    """The lane the calling thread works for, or ``None`` if it is not a lane worker."""
    w: _LaneWorker | None = getattr(_current, "worker", None)
    return None if w is None else w.lane


def current_holder() -> Run | None:
    """The execution holding the lane instance that the calling thread works for."""
    w: _LaneWorker | None = getattr(_current, "worker", None)
    return None if w is None else w.holder


class _LaneWorker:
    """A daemon thread draining a FIFO of ``(run, index)`` items, or callables, until stopped."""

    def __init__(self, lane: str, instance: int) -> None:
        self.lane = lane
        self.instance = instance
        self.holder: Run | None = None
        """The execution whose tasks this instance runs, until its last one has finished."""
        self.idle_since = time.monotonic()
        """When the last execution holding it released it."""
        # Hazard: a Ctrl-C in the main thread inside a submission. A Condition's
        # enter/exit and notify() are Python frames, where CPython runs the handler:
        # one landing there left the lock held (every lane blocked on it) or the
        # items queued with the lane asleep (they ran only at the next submission,
        # or never). SimpleQueue.put is one C call: the batch is queued and the
        # lane woken, or neither.
        self._q: queue.SimpleQueue[list[Any]] = queue.SimpleQueue()
        name = f"pipeoff-{lane}" if instance == 0 else f"pipeoff-{lane}#{instance}"
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        _exit.ensure_registered()
        self._thread.start()

    def submit(self, items: list[Any]) -> None:
        """Queue ``items`` behind what is queued, as one batch (see the hazard above)."""
        _happens.release(self)  # what the submitter did comes before the items run
        self._q.put(list(items))

    def _loop(self) -> None:
        _current.worker = self
        while True:
            batch = self._q.get()
            _happens.acquire(self)
            item: Any = None
            stop = False
            for item in batch:
                if item is _STOP:
                    stop = True
                    break
                self._run_item(item)
            # Hazard: an idle lane must not hold its last items. Through them it kept
            # their execution alive, its graph's work and all that closes over, a
            # process group among them: ``destroy_process_group()`` then left gloo's
            # threads running into interpreter finalization, where one of them, still
            # dropping a finished collective, aborted the process (issue 37).
            del batch, item
            if stop:
                return

    def _run_item(self, item: Any) -> None:
        """Run one item (its references die with this frame, see :meth:`_loop`)."""
        # The accelerator's per-thread set-up (the simulated device checks
        # this thread's accesses too); a no-op on CUDA.
        try:
            with _accel.current().host_thread():
                if callable(item):
                    item()
                else:
                    run, i = item
                    run.run_task(i, self.lane)
        except BaseException as err:  # noqa: BLE001 - the lane must outlive it
            # Items record their own failures on their execution; this is a
            # failure outside that (a bug): report it, keep the lane alive.
            warnings.warn(f"pipeoff: lane {self.lane!r} caught {err!r} outside a "
                          "task; the lane goes on", RuntimeWarning, stacklevel=1)


_lanes: dict[str, list[_LaneWorker]] = {}
_lanes_lock = threading.Lock()


def acquire(lanes: list[str], run: Run) -> dict[str, _LaneWorker]:
    """An instance of each of ``lanes`` that no other execution in flight holds."""
    out: dict[str, _LaneWorker] = {}
    with _lanes_lock:
        for lane in lanes:
            instances = _lanes.setdefault(lane, [])
            w = next((w for w in instances if w.holder is None), None)
            if w is None:
                w = _LaneWorker(lane, len(instances))
                instances.append(w)
            w.holder = run
            out[lane] = w
    return out


def release(workers: list[_LaneWorker], run: Run) -> None:
    now = time.monotonic()
    with _lanes_lock:
        for w in workers:
            if w.holder is run:
                w.holder = None
                w.idle_since = now
    reap_idle(LANE_IDLE_S)


LANE_IDLE_S = 60.0
"""A lane worker idle this long (seconds) is stopped at the next release: lanes
made for one burst of concurrency, or named by one graph, do not stay forever."""


def reap_idle(max_idle_s: float) -> list[str]:
    """Stop the lane workers no execution has held for ``max_idle_s`` seconds; their
    names. A lane asked for again gets a new worker."""
    now = time.monotonic()
    stopped = []
    with _lanes_lock:
        for lane in list(_lanes):
            keep = []
            for w in _lanes[lane]:
                if w.holder is None and now - w.idle_since >= max_idle_s:
                    w.submit([_STOP])
                    stopped.append(w._thread.name)
                else:
                    keep.append(w)
            if keep:
                _lanes[lane] = keep
            else:
                del _lanes[lane]
    return stopped


def stop_lanes(deadline: float) -> list[str]:
    """Stop every lane worker once its queue drains (at exit); the names of those still running.

    A worker asked for afterwards starts afresh.
    """
    with _lanes_lock:
        workers = [w for ws in _lanes.values() for w in ws]
        _lanes.clear()
    for w in workers:
        w.submit([_STOP])
    return [w._thread.name for w in workers if not _exit.join_until(w._thread, deadline)]


def lane_threads() -> dict[str, threading.Thread]:
    """The first instance's thread of each lane started so far (created once per process)."""
    with _lanes_lock:
        return {lane: ws[0]._thread for lane, ws in _lanes.items() if ws}


def lane_instances() -> dict[str, int]:
    """How many instances of each lane exist (more than one only under concurrency)."""
    with _lanes_lock:
        return {lane: len(ws) for lane, ws in _lanes.items()}


def refuse_wait_on_own_lane(run: Run, i: int | None) -> None:
    """A task waiting for a task of its own execution queued behind it on its own
    lane could never see it run: refuse that (``ConfigError``) instead of hanging."""
    lane = current_lane()
    if lane is None or current_holder() is not run:
        return  # another execution's lane instance: it can run meanwhile
    mine = [j for j in (range(run.n) if i is None else (i,))
            if run.plan.lanes[j] == lane and not run.terminal(j)]
    if mine:
        raise ConfigError(
            f"wait() called from a task on lane {lane!r} for {run.tasks[mine[0]].name!r}, "
            f"which is queued on that same lane behind the caller: it could never run. "
            "Give the inner graph's tasks other lanes, or run it with "
            "Schedule.synchronous() (inline, on the calling thread)"
        )


class ThreadsBackend(HostBackend):
    """Runs each lane on its own thread; ``launch`` returns without waiting."""

    name = "threads"

    def check_wait(self, run: Run, i: int | None) -> None:
        refuse_wait_on_own_lane(run, i)

    def launch(self, run: Run) -> None:
        lanes = run.plan.lanes
        groups: dict[str, list[Any]] = {}
        for i, lane in enumerate(lanes):
            groups.setdefault(lane, []).append((run, i))
        workers = acquire(list(groups), run)
        held = list(workers.values())
        now = time.perf_counter_ns() - run.origin_ns
        run.enqueue_ns = [now] * run.n
        run.on_complete(lambda: release(held, run))
        for lane, items in groups.items():
            workers[lane].submit(items)
