"""The simulated device's streams and events: FIFO queues drained by worker threads,
and CUDA's event ordering, with vector clocks (see ``_simcuda.py``)."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeoff.testing._simcuda import SimulatedCuda

__all__ = ["DataRaceError", "HostActor", "SimEvent", "SimStream", "is_host", "merge"]


class HostActor:
    """A host thread as an actor of the checker: its clock, and its accesses' epochs."""

    __slots__ = ("name", "vc")

    def __init__(self, name: str) -> None:
        self.name = name
        self.vc: dict[Any, int] = {}

    def __repr__(self) -> str:
        return f"<host thread {self.name!r}>"


def is_host(actor: Any) -> bool:
    return type(actor) is HostActor


class DataRaceError(BaseException):
    """Raised by the simulated CUDA device on an access that races with another.

    Its message names the tensor and both accesses (operation, actor, read or
    write, where in the code). Like ``KeyboardInterrupt`` it derives from
    ``BaseException`` only, so that an ``except Exception`` on the way (torchft
    reporting a failed sync, say) cannot swallow it.
    """


@dataclass(slots=True)
class _Gen:
    """One ``record`` of an event: done once the stream has executed it."""

    done: threading.Event = field(default_factory=threading.Event)
    vc: dict[Any, int] = field(default_factory=dict)
    t: float = 0.0


class SimEvent:
    """An event of the simulated device (torch's method names)."""

    def __init__(self, sim: SimulatedCuda, timing: bool) -> None:
        self.sim = sim
        self.timing = timing
        self._gen: _Gen | None = None

    def record(self, stream: Any = None) -> None:
        stream = self.sim.current_stream() if stream is None else stream
        gen = _Gen()
        self._gen = gen
        stream._enqueue(("record", gen))

    def wait(self, stream: Any = None) -> None:
        (self.sim.current_stream() if stream is None else stream).wait_event(self)

    def query(self) -> bool:
        gen = self._gen
        if gen is None:
            return True
        if not gen.done.is_set():
            return False
        # As on CUDA: once a query says the work is done, the host may read its results.
        self.sim.clocks.host_acquire(gen.vc)
        return True

    def synchronize(self) -> None:
        gen = self._gen
        if gen is None:
            return
        gen.done.wait()
        self.sim.clocks.host_acquire(gen.vc)
        self.sim.reports.deliver()

    def elapsed_time(self, end: SimEvent) -> float:
        if not (self.timing and end.timing):
            raise RuntimeError("elapsed_time needs events created with enable_timing=True")
        if self._gen is None or end._gen is None:
            raise RuntimeError("elapsed_time needs both events recorded")
        self._gen.done.wait()
        end._gen.done.wait()
        return (end._gen.t - self._gen.t) * 1e3


class SimStream:
    """A stream of the simulated device: a FIFO drained by a worker thread."""

    def __init__(self, sim: SimulatedCuda, name: str, priority: int = 0) -> None:
        self.sim = sim
        self.name = name
        self.priority = priority
        self.vc: dict[Any, int] = {}
        self._q: deque[tuple[Any, ...]] = deque()
        self._orphans: deque[tuple[Any, ...]] = deque()
        """Items a storage finalizer could not enqueue (see :meth:`enqueue_freed`)."""
        # Reentrant: a storage finalizer (the free check) may enqueue onto this
        # stream from inside code that holds the lock, when a collection runs there.
        self._cond = threading.Condition(threading.RLock())
        self._busy = False
        self._stop = False
        self._exited = False
        """The worker has stopped (the device closed): later items run at once."""
        self._thread = threading.Thread(target=self._loop, name=f"simcuda-{name}", daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        return f"<simulated stream {self.name!r}>"

    # -- torch's Stream surface --------------------------------------------------------
    def wait_event(self, event: SimEvent) -> None:
        gen = event._gen
        if gen is None:
            return  # as CUDA: waiting on an event never recorded is a no-op
        self._enqueue(("wait", gen))
        if self.sim.clocks.worker() is None and self is self.sim.current_stream():
            # A host thread made its own stream wait: its next operation on the
            # device waits for that anyway (see "Streams"), so wait now. On CUDA
            # the awaited work's host-side effects (autograd's version counters)
            # happened when it was issued; here they happen when it runs, and an
            # autograd node saves its inputs' versions before the operation reaches
            # the device. This gives the host no ordering: the clocks are unchanged.
            self.drain()

    def wait_stream(self, other: SimStream) -> None:
        ev = SimEvent(self.sim, timing=False)
        ev.record(other)
        self.wait_event(ev)

    def record_event(self, event: SimEvent | None = None) -> SimEvent:
        event = SimEvent(self.sim, timing=False) if event is None else event
        event.record(self)
        return event

    def query(self) -> bool:
        with self._cond:
            if self._q or self._busy or self._orphans:
                return False
        self.sim.clocks.host_acquire(dict(self.vc))  # done: the host may read its results
        return True

    def synchronize(self) -> None:
        if self.sim.clocks.worker() is self:
            # Work running on this stream (a collective's wait() inside a task):
            # on CUDA it runs at issue, when everything before it on the stream
            # is all there is to wait for, and that has run here already.
            return
        self.drain()
        self.sim.clocks.host_acquire(dict(self.vc))
        self.sim.reports.deliver()

    # -- the queue ----------------------------------------------------------------------
    def _enqueue(self, item: tuple[Any, ...], clock: dict[Any, int] | None = None) -> None:
        # Work enqueued by the host comes after everything the host did before.
        enq = self.sim.clocks.enqueuer_clock() if clock is None else clock
        if self.sim.clocks.worker() is self:
            # Enqueued by this stream's own work (a collective's wait() inside a
            # task): it comes right after what ran so far, before the rest of it.
            self._execute((*item, enq))
            return
        with self._cond:
            if not self._exited:
                self._q.append((*item, enq))
                self._cond.notify_all()
                return
        # Hazard: work enqueued after the device closed (an execution the block left
        # in flight) never running, and whoever waits for it hanging. The stream is
        # empty and stopped: the item runs now, in order (nothing is checked any more).
        self._execute((*item, enq))

    def enqueue_freed(self, item: tuple[Any, ...], clock: dict[Any, int]) -> None:
        """:meth:`_enqueue` for a storage finalizer, which runs wherever a collection
        does: perhaps holding the device's lock, while this stream's worker holds this
        stream's lock and its own finalizer waits for the device's (a deadlock, found
        under load). So it never waits here: a taken lock leaves the item to the
        worker, which looks for such items at least every 50 ms."""
        if self._exited:
            return  # (the device closed: nothing is checked any more)
        if not self._cond.acquire(blocking=False):
            self._orphans.append((*item, clock))
            return
        try:
            self._q.append((*item, clock))
            self._cond.notify_all()
        finally:
            self._cond.release()

    def drain(self) -> None:
        """Block until every item enqueued so far has executed."""
        with self._cond:
            while (self._q or self._busy or self._orphans) and not self._exited:
                self._cond.wait(0.05)

    def _loop(self) -> None:
        self.sim.worker_started(self)
        while True:
            with self._cond:
                while not self._q and not self._orphans and not self._stop:
                    self._cond.wait(0.05)  # (an orphan comes without a notify)
                while self._orphans:
                    self._q.append(self._orphans.popleft())
                if self._stop and not self._q:
                    self._exited = True
                    return
                item = self._q.popleft()
                self._busy = True
            try:
                self._execute(item)
            except BaseException as err:  # noqa: BLE001 - reported by the device
                if not isinstance(err, DataRaceError):
                    self.sim.reports.found(err)  # a race was noted when found
                self.sim.reports.undelivered.append(err)
            finally:
                # Its tensors are let go here, not under this stream's lock: their
                # finalizers take the device's lock.
                del item
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _execute(self, item: tuple[Any, ...]) -> None:
        kind, *rest, enq = item
        with self.sim.lock:
            merge(self.vc, enq)
        if kind == "record":
            (gen,) = rest
            with self.sim.lock:
                self.vc[self] = self.vc.get(self, 0) + 1
                gen.vc = dict(self.vc)
            gen.t = time.monotonic()
            gen.done.set()
        elif kind == "wait":
            (gen,) = rest
            gen.done.wait()
            with self.sim.lock:
                merge(self.vc, gen.vc)
        elif kind == "sleep":
            time.sleep(rest[0])
        elif kind == "launch":
            (fn,) = rest
            fn()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(10)


def merge(into: dict[Any, int], other: dict[Any, int]) -> None:
    for k, v in other.items():
        if into.get(k, 0) < v:
            into[k] = v
