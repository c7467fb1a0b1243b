"""A simulated CUDA device: asynchronous streams, CUDA's event ordering, and an access checker.

Installed with :func:`pipeoff.testing.simulated_cuda`, it sits *under*
:class:`pipeoff._accel.Cuda`: :class:`~pipeoff.testing._simruntime.SimRuntime`
fakes the few torch and CUDA runtime entry points that class calls, so that
pipeoff's real ``Cuda`` code, its CUDA backend, and every CUDA path of the
optimizers, LocalSGD and state transfers run in tests and fail when a
synchronization is missing.

**Memory.** Tensors are CPU tensors. Host memory is what the device allocates
as host memory (``host_empty``, and ``cudaHostRegister``: pipeoff's pinned
pools and state) and what host work makes; everything else is device memory
(also a tensor made from Python data, such as AdamW's ``step``, which on CUDA
would be a CPU tensor). The device is ``torch.device("cpu")``.

**Streams** are FIFO queues, each drained by a worker thread: ``ev.record``,
``wait_event``, ``sleep`` and ``launch`` (a kernel) return at once and take
effect later, in order. An in-place operation that a host thread issues on
device memory (and a ``non_blocking`` copy to or from pinned memory) is
enqueued on its current stream, to run later on the worker, as a kernel runs
after its launch; autograd sees it at its issue, as on CUDA. Any other
operation on device memory runs at once on the issuing thread, after its
stream has drained (an allocation does not wait); a blocking or pageable copy
between host and device memory synchronizes the host with the stream
afterwards.

**Ordering** is tracked with vector clocks, as torch's CUDA sanitizer does
(``torch/cuda/_sanitizer.py``): every stream, and every host thread, has a
clock; an event captures its stream's clock when its record executes;
``wait_event`` merges it into the waiting stream's clock, ``synchronize`` into
the calling thread's; work a thread enqueues inherits that thread's clock.
Between host threads, the order comes from :mod:`pipeoff._happens` (the
device is its observer): a task's finish before its waiters, a gate's settle
before its readers, a lane's queue, a staging pool's release before its next
acquire.

**Checking.** A ``TorchDispatchMode``, active on the simulated streams' workers,
on pipeoff's threads and on the thread that entered the device, records every
read and write of a byte range of a storage with its actor (a stream, or a
host thread) and clock. An access that conflicts with an earlier one by
another actor (one of them a write) that does not happen before it raises
:class:`DataRaceError`, naming the tensor and both accesses. So a missing
``wait_event``, a reused staging block without a fence, or a host read of a
copy's result before a synchronization fails deterministically, whatever the
threads' timing. A device storage freed while a stream other than the one that
made it may still use it (no ``record_stream``, no event) is reported when the
device exits: that is the caching allocator's stream-ordered reuse. An error
found on a stream's worker is raised at the host's next synchronization, as
CUDA reports an asynchronous error. A failure is reported once (later races
until the test synchronizes the device are its echoes); one that never reached
the test is raised when the device exits.

What it cannot model is listed in ``docs/concepts.md``.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import itertools
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only

__all__ = ["DataRaceError", "SimulatedCuda"]



class _Host:
    """A host thread as an actor of the checker: its clock, and its accesses' epochs."""

    __slots__ = ("name", "vc")

    def __init__(self, name: str) -> None:
        self.name = name
        self.vc: dict[Any, int] = {}

    def __repr__(self) -> str:
        return f"<host thread {self.name!r}>"


def _is_host(actor: Any) -> bool:
    return type(actor) is _Host
_MAX_RECORDS = 8192  # access records kept per storage (the latest per range, actor, kind)


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
        self.sim._host_acquire(gen.vc)
        return True

    def synchronize(self) -> None:
        gen = self._gen
        if gen is None:
            return
        gen.done.wait()
        self.sim._host_acquire(gen.vc)
        self.sim._deliver()

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
        # Reentrant: a storage finalizer (the free check) may enqueue onto this
        # stream from inside code that holds the lock, when a collection runs there.
        self._cond = threading.Condition(threading.RLock())
        self._busy = False
        self._stop = False
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
        if getattr(self.sim._tls, "worker", None) is None and self is self.sim.current_stream():
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
            if self._q or self._busy:
                return False
        self.sim._host_acquire(dict(self.vc))  # done: the host may read its results
        return True

    def synchronize(self) -> None:
        if getattr(self.sim._tls, "worker", None) is self:
            # Work running on this stream (a collective's wait() inside a task):
            # on CUDA it runs at issue, when everything before it on the stream
            # is all there is to wait for, and that has run here already.
            return
        self.drain()
        self.sim._host_acquire(dict(self.vc))
        self.sim._deliver()

    # -- the queue ----------------------------------------------------------------------
    def _enqueue(self, item: tuple[Any, ...], clock: dict[Any, int] | None = None) -> None:
        # Work enqueued by the host comes after everything the host did before.
        enq = self.sim._enqueuer_clock() if clock is None else clock
        if getattr(self.sim._tls, "worker", None) is self:
            # Enqueued by this stream's own work (a collective's wait() inside a
            # task): it comes right after what ran so far, before the rest of it.
            self._execute((*item, enq))
            return
        with self._cond:
            self._q.append((*item, enq))
            self._cond.notify_all()

    def drain(self) -> None:
        """Block until every item enqueued so far has executed."""
        with self._cond:
            while self._q or self._busy:
                self._cond.wait()

    def _loop(self) -> None:
        self.sim._worker_started(self)
        while True:
            with self._cond:
                while not self._q and not self._stop:
                    self._cond.wait()
                if self._stop and not self._q:
                    return
                item = self._q.popleft()
                self._busy = True
            try:
                self._execute(item)
            except BaseException as err:  # noqa: BLE001 - reported by the device
                if not isinstance(err, DataRaceError):
                    self.sim._found(err)  # a race was noted when found
                self.sim.undelivered.append(err)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _execute(self, item: tuple[Any, ...]) -> None:
        kind, *rest, enq = item
        with self.sim._lock:
            _merge(self.vc, enq)
        if kind == "record":
            (gen,) = rest
            with self.sim._lock:
                self.vc[self] = self.vc.get(self, 0) + 1
                gen.vc = dict(self.vc)
            gen.t = time.monotonic()
            gen.done.set()
        elif kind == "wait":
            (gen,) = rest
            gen.done.wait()
            with self.sim._lock:
                _merge(self.vc, gen.vc)
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


def _merge(into: dict[Any, int], other: dict[Any, int]) -> None:
    for k, v in other.items():
        if into.get(k, 0) < v:
            into[k] = v


@dataclass(slots=True)
class _Access:
    lo: int
    hi: int
    actor: Any
    epoch: int
    write: bool
    op: str
    where: str


_METADATA_ONLY = frozenset(getattr(torch.ops.aten, n) for n in (
    "new_empty", "new_empty_strided", "new_zeros", "new_ones", "new_full", "empty_like",
    "zeros_like", "ones_like", "full_like", "empty_strided",
))


class _Checker(TorchDispatchMode):
    """Sees every aten operation on its thread and checks its accesses."""

    def __init__(self, sim: SimulatedCuda) -> None:
        super().__init__()
        self.sim = sim

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        deferred = self.sim._defer(func, args, kwargs)
        if deferred is not None:
            return deferred[0]
        actor = self.sim._on_op(func, args, kwargs)
        out = func(*args, **kwargs)
        self.sim._on_result(out, actor)
        return out


class _HostReads(TorchFunctionMode):
    """On host threads: reads that bypass aten (``.tolist()``, ``.numpy()``) are checked
    like an aten read, and on device memory synchronize the host first."""

    _READS = frozenset({"tolist", "numpy", "__array__"})

    def __init__(self, sim: SimulatedCuda) -> None:
        super().__init__()
        self.sim = sim

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in self._READS and args and isinstance(args[0], torch.Tensor):
            self.sim.host_read(args[0], name)
        return func(*args, **(kwargs or {}))


class SimulatedCuda:
    """A CUDA device simulated on the CPU (see the module docstring).

    Use it through :func:`pipeoff.testing.simulated_cuda`.
    """


    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.device = torch.device("cpu")
        self._hosts: list[_Host] = []
        self._sync: weakref.WeakKeyDictionary[Any, dict[Any, dict[Any, int]]] = (
            weakref.WeakKeyDictionary())
        """Per object and key, the clock that :meth:`release` published there."""
        self.errors: list[BaseException] = []
        """Every data race found, raised where it happened."""
        self.undelivered: list[BaseException] = []
        """Problems found off any caller's path (a storage freed too early, an error
        inside a stream's worker): raised when the device exits."""
        self._host: list[tuple[int, int, bool]] = []  # (start, end, pinned), sorted
        self._acc: dict[int, dict[tuple[int, int, Any, bool], _Access]] = {}
        """Per storage base, the latest access of each (byte range, actor, write): an
        actor's earlier access to the same range is ordered before its later one, so
        it needs no record of its own."""
        self._made_by: dict[int, Any] = {}  # device storage -> the actor that first used it
        self._fences: dict[int, set[Any]] = {}  # storage -> streams recorded on it
        self._watched: set[int] = set()
        self._tls = threading.local()
        self._checker = _Checker(self)
        self._host_reads = _HostReads(self)
        self._closed = False
        self.owner = threading.current_thread()
        """The thread that entered the device (a test's)."""
        self.muted = False
        """A race (or a stream's error) reached :attr:`owner`, which has not synchronized
        the device since: later ones are its echoes, not reported again."""
        self.runtime: Any = None
        """The fake torch.cuda that pipeoff's :class:`~pipeoff._accel.Cuda` calls (set by
        :func:`pipeoff.testing.simulated_cuda`)."""
        self.accelerator: Any = None
        """The :class:`~pipeoff._accel.Cuda` over :attr:`runtime` that pipeoff uses."""
        self.default = SimStream(self, "default")
        self.streams: list[SimStream] = [self.default]

    # -- the device (what SimRuntime fakes torch.cuda with) -----------------------------
    def on_device(self, t: torch.Tensor) -> bool:
        return self._host_range(_ptr(t)) is None

    def host_empty(self, shape: Any, dtype: torch.dtype, *, pinned: bool) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype)
        self._register_host(t.untyped_storage(), pinned)
        return t

    def _register_host(self, storage: Any, pinned: bool) -> None:
        start, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes:
            self._register_range(start, nbytes, pinned)
            weakref.finalize(storage, self._host_freed, start, start + nbytes, pinned)

    def _register_range(self, start: int, nbytes: int, pinned: bool) -> None:
        with self._lock:
            bisect.insort(self._host, (start, start + nbytes, pinned))
            self._acc.pop(start, None)  # memory a freed device tensor had

    def is_pinned(self, t: torch.Tensor) -> bool:
        r = self._host_range(_ptr(t))
        return r is not None and r[2]

    def new_stream(self, device: torch.device, priority: int = 0,
                   name: str = "") -> SimStream:
        with self._lock:
            s = SimStream(self, name or f"stream{len(self.streams)}", priority)
            self.streams.append(s)
        return s

    def current_stream(self, device: torch.device | None = None) -> SimStream:
        s: SimStream | None = getattr(self._tls, "stream", None)
        if s is None:
            s = getattr(self._tls, "worker", None)  # work launched on a stream
        return self.default if s is None else s

    @contextlib.contextmanager
    def use_stream(self, stream: SimStream) -> Iterator[SimStream]:
        prior = getattr(self._tls, "stream", None)
        self._tls.stream = stream
        try:
            yield stream
        finally:
            self._tls.stream = prior

    def new_event(self, timing: bool = False) -> SimEvent:
        return SimEvent(self, timing)

    def launch(self, stream: SimStream, fn: Callable[[], None]) -> None:
        stream._enqueue(("launch", fn))

    def sleep(self, stream: SimStream, seconds: float) -> None:
        stream._enqueue(("sleep", seconds))

    def record_stream(self, t: torch.Tensor, stream: SimStream) -> None:
        ptr = _ptr(t)
        if ptr:
            with self._lock:
                self._fences.setdefault(ptr, set()).add(stream)

    def synchronize(self, device: torch.device | None = None) -> None:
        # From a stream's own work, its stream is skipped (see SimStream.synchronize);
        # another stream waiting for an event this one records later would hang
        # here, where CUDA (issuing the work first) would not.
        try:
            for s in list(self.streams):
                s.synchronize()
        finally:
            if threading.current_thread() is self.owner and self.muted:
                # The test synchronized after a reported race: what came of it
                # has run; a race found from now on is news.
                for s in list(self.streams):
                    s.drain()
                with self._lock:
                    for e in self.undelivered:
                        self._seen(e)
                    self.errors.extend(self.undelivered)
                    self.undelivered.clear()
                    self.muted = False

    capturing = False
    """Set by a test to act as if a CUDA graph were being captured."""

    @contextlib.contextmanager
    def host_thread(self) -> Iterator[None]:
        if getattr(self._tls, "checking", False):
            yield
            return
        self._tls.checking = True
        try:
            with self._checker, self._host_reads:
                yield
        finally:
            self._tls.checking = False

    # -- clocks -------------------------------------------------------------------------
    def _worker_started(self, stream: SimStream) -> None:
        self._tls.worker = stream
        self._tls.checking = True
        self._checker.__enter__()

    def _enqueuer_clock(self) -> dict[Any, int]:
        worker: SimStream | None = getattr(self._tls, "worker", None)
        with self._lock:
            return dict(worker.vc if worker is not None else self.host_vc)

    @property
    def host_vc(self) -> dict[Any, int]:
        """The calling host thread's clock."""
        return self._host_actor().vc

    def _host_actor(self) -> _Host:
        host: _Host | None = getattr(self._tls, "host", None)
        if host is None:
            host = self._tls.host = _Host(threading.current_thread().name)
            with self._lock:
                self._hosts.append(host)
        return host

    def _hosts_vc(self) -> dict[Any, int]:
        """What some host thread knows (the host as one: for frees, which the
        garbage collector runs on any thread)."""
        out: dict[Any, int] = {}
        with self._lock:
            for h in self._hosts:
                _merge(out, h.vc)
        return out

    # -- happens-before between host threads (pipeoff._happens) -------------------------
    def release(self, obj: Any, key: Any = None) -> None:
        if getattr(self._tls, "worker", None) is not None:
            return
        vc = self.host_vc
        with self._lock:
            _merge(self._sync.setdefault(obj, {}).setdefault(key, {}), vc)

    def acquire(self, obj: Any, key: Any = None) -> None:
        if getattr(self._tls, "worker", None) is not None:
            return
        vc = self.host_vc
        with self._lock:
            published = self._sync.get(obj, {}).get(key)
            if published:
                _merge(vc, published)

    def _deliver(self) -> None:
        """Raise on the host, at a synchronization, the first error that stream work
        raised (as CUDA reports an asynchronous kernel error at the next one)."""
        if self.undelivered and getattr(self._tls, "worker", None) is None:
            with self._lock:
                err = next((e for e in self.undelivered if not _seen(e)), None)
                self.errors.extend(self.undelivered)
                self.undelivered.clear()
            if err is not None:
                self._seen(err)
                raise err

    def _found(self, err: BaseException) -> None:
        """Note an error as it is found: while an earlier one has been reported and the
        test has not synchronized the device since, it is that failure's echo (a
        sticky CUDA error: one report)."""
        if self.muted or threading.current_thread() is self.owner:
            self._seen(err)  # an echo, or it propagates to the caller from here

    def _later(self, err: BaseException) -> None:
        """Report ``err`` (found off any caller's path: a free) at the next
        synchronization, unless it is the echo of a failure already reported."""
        if self.muted:
            err.pipeoff_seen = True  # type: ignore[attr-defined]
        self.undelivered.append(err)

    def _seen(self, err: BaseException) -> None:
        # What was found before it is of the same episode (found on other threads
        # before this one reached the caller): reported with it.
        with self._lock:
            for e in (err, *self.errors, *self.undelivered):
                e.pipeoff_seen = True  # type: ignore[attr-defined]
            self.muted = True

    def report(self, err: BaseException) -> None:
        """pipeoff re-raised ``err`` (a task's failure) to its caller."""
        if isinstance(err, DataRaceError):
            self._seen(err)

    def unreported(self) -> BaseException | None:
        """The first race or stream error found that never reached the thread that
        entered the device (a race after a test's last wait, one in an execution
        nobody waited for): raised when the device exits."""
        return next((e for e in (*self.undelivered, *self.errors) if not _seen(e)), None)

    def _host_acquire(self, vc: dict[Any, int]) -> None:
        if getattr(self._tls, "worker", None) is not None:
            return  # a stream worker blocking on an event learns nothing for the host
        with self._lock:
            _merge(self.host_vc, vc)

    # -- memory -------------------------------------------------------------------------
    def _host_range(self, ptr: int) -> tuple[int, int, bool] | None:
        if not ptr:
            return None
        with self._lock:
            k = bisect.bisect_right(self._host, (ptr, float("inf"), True)) - 1
            if k >= 0 and self._host[k][0] <= ptr < self._host[k][1]:
                return self._host[k]
        return None

    def _host_freed(self, start: int, end: int, pinned: bool) -> None:
        known = self._hosts_vc()
        with self._lock:
            try:
                self._host.remove((start, end, pinned))
            except ValueError:
                pass
            for acc in self._acc.pop(start, {}).values():
                if not _is_host(acc.actor) and known.get(acc.actor, 0) < acc.epoch:
                    self._later(DataRaceError(
                        f"host memory freed while {acc.actor!r} may still {_rw(acc)} it "
                        f"({acc.op}, at {acc.where}): the host never synchronized with it"))

    def _device_freed(self, ptr: int) -> None:
        with self._lock:
            made_by = self._made_by.pop(ptr, None)
            fences = self._fences.pop(ptr, set())
            self._watched.discard(ptr)
            accesses = list(self._acc.pop(ptr, {}).values())
        if made_by is None or _is_host(made_by) or self._closed:
            return
        # The allocator hands the block to the next allocation on `made_by`, which
        # runs after everything enqueued there so far (waits included, even those
        # not yet run): check at that point of its queue.
        # The free itself orders nothing: on CUDA the host drops the last reference
        # when it issues work, whichever stream's work (here, thread) dropped it.
        host = self._hosts_vc()
        made_by._enqueue(("launch", functools.partial(
            self._check_free, made_by, fences, accesses)), clock=host)

    def _check_free(self, made_by: SimStream, fences: set[Any],
                    accesses: list[_Access]) -> None:
        with self._lock:
            known = dict(made_by.vc)
            for acc in accesses:
                if acc.actor is made_by or _is_host(acc.actor) or acc.actor in fences:
                    continue
                # Safe if the allocation stream's next work (enqueued by the host
                # from now on) is ordered after this access: the host or the
                # allocation stream already waited for it.
                if known.get(acc.actor, 0) < acc.epoch:
                    self._later(DataRaceError(
                        f"device memory made on {made_by!r} was freed while {acc.actor!r} may "
                        f"still {_rw(acc)} it ({acc.op}, at {acc.where}): the caching allocator "
                        f"can hand it to the next allocation on {made_by!r} at once. Call "
                        f"record_stream({acc.actor!r}) on it, or make {made_by!r} wait for "
                        "that work before the tensor is dropped"))

    # -- the access checker ---------------------------------------------------------------
    def _on_result(self, out: Any, op: tuple[Any, int, frozenset[int]] | None) -> None:
        """Note the outputs: new storages are host memory if host work made them (CPU
        ops make CPU tensors), else device memory and the stream that allocated them;
        and every new output is written by the operation's actor (an output that is
        an input, ``copy_``'s, was recorded with the inputs)."""
        if self._closed or op is None:
            return
        actor, epoch, inputs = op
        where = ""
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            ptr = _ptr(t)
            span = _span(t)
            if not ptr or _ptr(t) in inputs:
                continue
            if ptr not in self._watched and self._host_range(ptr) is None:
                if _is_host(actor):
                    self._register_host(t.untyped_storage(), pinned=False)
                else:
                    with self._lock:
                        self._watch(t, ptr, actor)
            if span is None:
                continue
            where = where or _where()
            name = "output"
            with self._lock:
                base = self._base(ptr)
                lo, hi = span[0] + ptr - base, span[1] + ptr - base
                vc = actor.vc
                self._check(base, lo, hi, True, actor, vc, name, t)
                self._record(base, lo, hi, actor, epoch, True, name, where)

    def _actor(self, device: bool, fresh: bool = False) -> Any:
        """Who runs an operation issued by this thread: its stream worker, the current
        stream (an operation on device memory), or the host. ``fresh``: the operation
        only allocates (its output is new memory, no input's data is read)."""
        worker: SimStream | None = getattr(self._tls, "worker", None)
        if worker is not None:
            return worker
        if not device:
            return self._host_actor()
        stream = self.current_stream()
        if fresh:
            # An allocation does not wait for the stream (nor does cudaMalloc from
            # the caching allocator): nothing it reads is written there.
            return stream
        # The device runs this after everything enqueued on the stream so far;
        # the host thread issuing it waits for that here.
        stream.drain()
        with self._lock:
            _merge(stream.vc, self.host_vc)
        return stream

    def _tick(self, actor: Any) -> int:
        with self._lock:
            vc: dict[Any, int] = actor.vc
            epoch = vc.get(actor, 0) + 1
            vc[actor] = epoch
        return epoch

    def _on_op(self, func: Any, args: Any,
               kwargs: dict[str, Any]) -> tuple[Any, int, frozenset[int]] | None:
        """Check and record the accesses of one operation; returns its actor, its epoch
        and its inputs' storages."""
        if (self._closed or getattr(func, "is_view", False)
                or func.overloadpacket in _METADATA_IN_PLACE):
            return None  # no data touched (t_(), set_(), a storage resized)
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if not tensors and not any(str(r.type) == "Tensor" for r in func._schema.returns):
            return None  # no memory touched (the profiler's record_function)
        if func.overloadpacket in _METADATA_ONLY or not tensors:
            # new_empty(t) / zeros_like(t) read t's shape, not its memory; a factory
            # reads nothing. The result is where t is (host memory for a host
            # tensor); a factory's is device memory, written on the current stream
            # (a fill, in its order: after what is queued there; an allocation
            # alone does not wait).
            src = tensors[0] if tensors else None
            host = src is not None and self._host_range(_ptr(src)) is not None
            actor = self._actor(device=not host,
                                fresh=func.overloadpacket in _ALLOCATE_ONLY)
            return actor, self._tick(actor), frozenset(_ptr(t) for t in tensors)
        schema = func._schema
        written: set[int] = set()
        if func.namespace == "c10d":
            # A collective writes its tensors (the schemas do not say so).
            written.update(id(t) for t in tensors)
        for i, a in enumerate(schema.arguments):
            v = args[i] if i < len(args) else kwargs.get(a.name)
            if a.alias_info is not None and a.alias_info.is_write:
                for t in tree_flatten(v)[0]:
                    if isinstance(t, torch.Tensor):
                        written.add(id(t))
        kinds = [self._host_range(_ptr(t)) for t in tensors]
        touches_device = any(k is None and _ptr(t) for k, t in zip(kinds, tensors))
        actor = self._actor(device=touches_device)
        sync_after: SimStream | None = None
        if not _is_host(actor) and getattr(self._tls, "worker", None) is None:
            if _host_waits(func, args, kwargs, tensors, kinds):
                sync_after = actor
            if (any(str(r.type) in _HOST_VALUES for r in schema.returns)
                    or func.overloadpacket in _SHAPE_FROM_DATA):
                # .item(), torch.equal, nonzero(): the host waits for a value (or a
                # shape that depends on the data).
                sync_after = actor
        op = str(func).replace("aten::", "").replace(".default", "")
        where = getattr(self._tls, "where", None) or _where()
        epoch = self._tick(actor)
        with self._lock:
            vc = actor.vc
            for t in tensors:
                ptr = _ptr(t)
                span = _span(t)
                if not ptr or span is None:
                    continue
                base = self._base(ptr)
                lo, hi = span[0] + ptr - base, span[1] + ptr - base
                write = id(t) in written
                self._check(base, lo, hi, write, actor, vc, op, t)
                self._record(base, lo, hi, actor, epoch, write, op, where)
                if base not in self._watched and self._host_range(base) is None:
                    self._watch(t, base, actor)
        if sync_after is not None:
            with self._lock:
                _merge(self.host_vc, sync_after.vc)
            self._deliver()
        return actor, epoch, frozenset(_ptr(t) for t in tensors)

    def _defer(self, func: Any, args: Any, kwargs: dict[str, Any]) -> tuple[Any] | None:
        """Enqueue an in-place device operation that a host thread issues on its current
        stream, to run later on the stream's worker, as a kernel runs after its launch;
        returns ``(its result,)``, or ``None`` to run it now (it returns a new tensor or
        a host value, or it synchronizes the host).

        So issue is asynchronous: a lane's dispatcher goes on (and releases its
        staging) while the stream is still late, as on a GPU.
        """
        if self._closed or getattr(self._tls, "worker", None) is not None:
            return None
        if (getattr(func, "is_view", False) or func.overloadpacket in _SHAPE_FROM_DATA
                or func.overloadpacket in _METADATA_IN_PLACE):
            return None
        schema = func._schema
        returns = schema.returns
        if returns:
            first = schema.arguments[0].alias_info if schema.arguments else None
            ret = returns[0].alias_info
            if not (len(returns) == 1 and ret is not None and ret.is_write and first is not None
                    and first.is_write and first.before_set == ret.before_set):
                return None  # a new tensor, or a value for the host
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if not tensors:
            return None
        kinds = [self._host_range(_ptr(t)) for t in tensors]
        if not any(k is None and _ptr(t) for k, t in zip(kinds, tensors)):
            return None  # host work
        if _host_waits(func, args, kwargs, tensors, kinds):
            return None  # a blocking or pageable copy: run it now
        # Checked at issue, as a launch checks shapes and dtypes: an error is
        # raised here, not at a later synchronization.
        meta_args, meta_kwargs = tree_map_only(torch.Tensor, _on_meta, (args, kwargs))
        try:
            func(*meta_args, **meta_kwargs)
        except NotImplementedError:
            return None  # no meta kernel: run it now
        # What the kernel will touch is fixed now: the tensors' storages and strides
        # at issue (a later `p.data = new` or swap_tensors must not redirect it),
        # and a 0-dim host tensor's value (a scalar argument, read at the launch).
        fixed = tree_map_only(torch.Tensor, self._as_issued, (args, kwargs))
        stream = self.current_stream()
        stream._enqueue(("launch", functools.partial(
            self._run_deferred, func, fixed[0], fixed[1], _where())))
        return (args[0] if returns else None,)

    def _as_issued(self, t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0 and self._host_range(_ptr(t)) is not None:
            return t.clone()
        return t.as_strided(t.size(), t.stride(), t.storage_offset())

    def _run_deferred(self, func: Any, args: Any, kwargs: dict[str, Any], where: str) -> None:
        self._tls.where = where  # name the issuing code, not the worker, in a race
        try:
            # Autograd saw the operation at its issue (version counters, leaf
            # checks); here only the kernel runs.
            with torch._C._AutoDispatchBelowADInplaceOrView():
                func(*args, **kwargs)
        finally:
            self._tls.where = None

    def host_read(self, t: torch.Tensor, op: str) -> None:
        """The host reads ``t`` outside aten (``.tolist()``, ``.numpy()``): on device
        memory that synchronizes the host with the current stream first, as on CUDA."""
        if self._closed or getattr(self._tls, "worker", None) is not None:
            return
        ptr = _ptr(t)
        span = _span(t)
        if not ptr or span is None:
            return
        if self._host_range(ptr) is None:
            stream = self._actor(device=True)
            with self._lock:
                _merge(self.host_vc, stream.vc)
            self._deliver()
        host = self._host_actor()
        epoch = self._tick(host)
        with self._lock:
            base = self._base(ptr)
            lo, hi = span[0] + ptr - base, span[1] + ptr - base
            self._check(base, lo, hi, False, host, host.vc, op, t)
            self._record(base, lo, hi, host, epoch, False, op, _where())

    def native_access(self, op: str, reads: Sequence[torch.Tensor],
                      writes: Sequence[torch.Tensor]) -> None:
        """Native code on a host thread reads ``reads`` and writes ``writes`` through
        their pointers (``pipeoff._happens.native_access``): checked and recorded like
        the same accesses by an aten op on this thread. Only host memory: native
        code cannot touch device memory."""
        if self._closed or getattr(self._tls, "worker", None) is not None:
            return
        host = self._host_actor()
        epoch = self._tick(host)
        where = _where()
        with self._lock:
            for write, tensors in ((False, reads), (True, writes)):
                for t in tensors:
                    ptr = _ptr(t)
                    span = _span(t)
                    if not ptr or span is None:
                        continue
                    if self._host_range(ptr) is None:
                        raise AssertionError(f"{op}: native code given device memory "
                                             f"({_describe(t, self)})")
                    base = self._base(ptr)
                    lo, hi = span[0] + ptr - base, span[1] + ptr - base
                    self._check(base, lo, hi, write, host, host.vc, op, t)
                    self._record(base, lo, hi, host, epoch, write, op, where)

    def _base(self, ptr: int) -> int:
        r = self._host_range(ptr)
        return r[0] if r is not None else ptr

    def _watch(self, t: torch.Tensor, base: int, actor: Any) -> None:
        self._watched.add(base)
        self._made_by.setdefault(base, actor)
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        weakref.finalize(storage, self._device_freed, base)

    def _record(self, base: int, lo: int, hi: int, actor: Any, epoch: int, write: bool,
                op: str, where: str) -> None:
        recs = self._acc.setdefault(base, {})
        key = (lo, hi, actor, write)
        recs.pop(key, None)  # re-inserted last: the dict stays in access order
        recs[key] = _Access(lo, hi, actor, epoch, write, op, where)
        if len(recs) > _MAX_RECORDS:
            del recs[next(iter(recs))]

    def _check(self, base: int, lo: int, hi: int, write: bool, actor: Any,
               vc: dict[Any, int], op: str, t: torch.Tensor) -> None:
        for acc in list(self._acc.get(base, {}).values()):
            if acc.actor == actor or acc.hi <= lo or hi <= acc.lo:
                continue
            if not (write or acc.write):
                continue
            if vc.get(acc.actor, 0) >= acc.epoch:
                continue
            here = getattr(self._tls, "where", None) or _where()
            err = DataRaceError(
                f"data race on a {_describe(t, self)}: {actor!r} {'writes' if write else 'reads'}"
                f" it ({op}, at {here}) while {acc.actor!r} may still {_rw(acc)} it "
                f"({acc.op}, at {acc.where}); nothing orders the second after the first (a "
                "missing wait_event, event fence or synchronize)")
            self.errors.append(err)
            self._found(err)
            raise err

    # -- life ---------------------------------------------------------------------------
    def close(self) -> None:
        """Drain and stop every stream (the device's exit)."""
        for s in list(self.streams):
            s.drain()
        self._closed = True
        for s in list(self.streams):
            s.stop()


def _host_waits(func: Any, args: Any, kwargs: dict[str, Any], tensors: list[torch.Tensor],
                kinds: list[tuple[int, int, bool] | None]) -> bool:
    """Whether a device operation on these tensors is a copy the host waits for: it
    touches host memory, and is not a ``non_blocking`` copy of pinned memory only.
    A 0-dim host tensor is a scalar argument, read by the host at the launch: no
    copy, no synchronization."""
    if not any(k is not None and t.dim() > 0 for k, t in zip(kinds, tensors)):
        return False
    non_blocking = kwargs.get("non_blocking")
    for i, a in enumerate(func._schema.arguments):
        if a.name == "non_blocking" and i < len(args):
            non_blocking = args[i]  # copy_(src, True): positional
    return not (bool(non_blocking) and all(k is None or k[2] for k in kinds))


def _on_meta(t: torch.Tensor) -> torch.Tensor:
    return t.to("meta")


def _ptr(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError, TypeError):
        return 0


def _span(t: torch.Tensor) -> tuple[int, int] | None:
    """Byte range ``[lo, hi)`` of ``t`` inside its storage, or ``None`` if empty."""
    if t.numel() == 0:
        return None
    size = t.element_size()
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 1)
    lo = int(t.storage_offset()) * size
    return lo, lo + int(last + 1) * size


def _seen(err: BaseException) -> bool:
    return getattr(err, "pipeoff_seen", False)


def _rw(acc: _Access) -> str:
    return "write" if acc.write else "read"


def _describe(t: torch.Tensor, sim: SimulatedCuda) -> str:
    r = sim._host_range(_ptr(t))
    kind = "device" if r is None else ("pinned host" if r[2] else "pageable host")
    return f"{kind} tensor of shape {tuple(t.shape)} and dtype {t.dtype}"


_HOST_VALUES = frozenset({"Scalar", "bool", "int", "float", "SymInt", "SymBool"})
_ALLOCATE_ONLY = frozenset(getattr(torch.ops.aten, n) for n in (
    "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided",
))
"""Factories that only allocate: nothing is written, so they wait for nothing."""
_METADATA_IN_PLACE = frozenset(getattr(torch.ops.aten, n) for n in (
    "resize_", "resize_as_", "set_", "as_strided_", "squeeze_", "unsqueeze_", "transpose_",
    "t_", "swapdims_", "swapaxes_", "detach_", "_resize_output_", "_coalesced_",
))
"""In-place in the schema, but they change the tensor itself (its size, its storage):
they run when issued, as on CUDA, where they launch no kernel."""
_SHAPE_FROM_DATA = frozenset(getattr(torch.ops.aten, n) for n in (
    "nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive",
))
_OWN = ("_simcuda.py", "_python_dispatch.py", "_ops.py", "_pytree.py", "contextlib.py",
        "threading.py", "overrides.py", "_tensor.py", "functional.py", "__init__.py")


def _where() -> str:
    """The innermost frame outside the device, torch and pipeoff's executor machinery."""
    frame: Any = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.endswith(_OWN) and "/torch/" not in name:
            return f"{name.rsplit('/', 1)[-1]}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


_ids = itertools.count()
