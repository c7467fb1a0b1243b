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

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only

from pipeoff.testing._simclocks import Clocks
from pipeoff.testing._simmemory import MemoryMap
from pipeoff.testing._simops import ALLOCATE_ONLY as _ALLOCATE_ONLY
from pipeoff.testing._simops import HOST_VALUES as _HOST_VALUES
from pipeoff.testing._simops import METADATA_IN_PLACE as _METADATA_IN_PLACE
from pipeoff.testing._simops import METADATA_ONLY as _METADATA_ONLY
from pipeoff.testing._simops import SHAPE_FROM_DATA as _SHAPE_FROM_DATA
from pipeoff.testing._simops import HostReads as _HostReads
from pipeoff.testing._simops import host_waits as _host_waits
from pipeoff.testing._simops import on_meta as _on_meta
from pipeoff.testing._simops import ptr as _ptr
from pipeoff.testing._simops import scalar_argument as _scalar_argument
from pipeoff.testing._simops import span as _span
from pipeoff.testing._simops import where as _where
from pipeoff.testing._simops import written_first as _written_first
from pipeoff.testing._simreports import Access as _Access
from pipeoff.testing._simreports import AccessLog, Reports
from pipeoff.testing._simreports import rw as _rw
from pipeoff.testing._simstreams import DataRaceError, SimEvent, SimStream
from pipeoff.testing._simstreams import is_host as _is_host
from pipeoff.testing._simstreams import merge as _merge

__all__ = ["DataRaceError", "SimEvent", "SimStream", "SimulatedCuda"]


class _Checker(TorchDispatchMode):
    """Sees every aten operation on its thread and checks its accesses."""

    def __init__(self, sim: SimulatedCuda) -> None:
        super().__init__()
        self.sim = sim

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(_answers_itself(t) for t in types):
            # A subclass that answers operations itself (a placeholder gradient, a
            # DTensor) does, with this mode on: what it issues is checked and queued
            # in order. (In this handler it ran now, unchecked, ahead of its stream.)
            return NotImplemented
        kwargs = kwargs or {}
        deferred = self.sim._defer(func, args, kwargs)
        if deferred is not None:
            return deferred[0]
        actor = self.sim._on_op(func, args, kwargs)
        out = func(*args, **kwargs)
        self.sim._on_result(out, actor)
        return out


def _answers_itself(cls: type) -> bool:
    return getattr(cls, "__torch_dispatch__", None) is not torch.Tensor.__torch_dispatch__


class SimulatedCuda:
    """A CUDA device simulated on the CPU (see the module docstring).

    Use it through :func:`pipeoff.testing.simulated_cuda`.
    """


    def __init__(self) -> None:
        self.lock = threading.RLock()
        """The device's lock: clocks, records and memory map are read and written under it."""
        self.device = torch.device("cpu")
        self.clocks = Clocks(self.lock)
        """The host threads' clocks and happens-before between them."""
        self.reports = Reports(self.lock, self.clocks)
        """What was found, and whether it reached the test."""
        self.errors = self.reports.errors
        """Every data race found, raised where it happened (:attr:`reports`' list)."""
        self.accesses = AccessLog()
        """The latest accesses of each storage, a race is checked against."""
        self.memory = MemoryMap(self.lock)
        """Which byte ranges are host memory."""
        self._made_by: dict[int, Any] = {}  # device storage -> the actor that first used it
        self._fences: dict[int, set[Any]] = {}  # storage -> streams recorded on it
        self._watched: set[int] = set()
        self._checker = _Checker(self)
        self._host_reads = _HostReads(self)
        self._closed = False
        self.runtime: Any = None
        """The fake torch.cuda that pipeoff's :class:`~pipeoff._accel.Cuda` calls (set by
        :func:`pipeoff.testing.simulated_cuda`)."""
        self.accelerator: Any = None
        """The :class:`~pipeoff._accel.Cuda` over :attr:`runtime` that pipeoff uses."""
        self.default = SimStream(self, "default")
        self.streams: list[SimStream] = [self.default]

    # -- the device (what SimRuntime fakes torch.cuda with) -----------------------------
    def host_empty(self, shape: Any, dtype: torch.dtype, *, pinned: bool) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype)
        self._register_host(t.untyped_storage(), pinned)
        return t

    def _register_host(self, storage: Any, pinned: bool) -> None:
        start, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes:
            self.register_range(start, nbytes, pinned)
            weakref.finalize(storage, self.host_freed, start, start + nbytes, pinned)

    def register_range(self, start: int, nbytes: int, pinned: bool) -> None:
        """``[start, start + nbytes)`` is host memory (``cudaHostRegister``)."""
        with self.lock:
            self.memory.add(start, nbytes, pinned)
            self.accesses.pop(start)  # memory a freed device tensor had

    def new_stream(self, device: torch.device, priority: int = 0,
                   name: str = "") -> SimStream:
        with self.lock:
            name = name or f"stream{len(self.streams)}"
        # Started outside the lock: the new worker thread can run a finalizer
        # (_device_freed, which takes the lock) before it signals that it started,
        # which the thread starting it waits for: a deadlock under the lock.
        s = SimStream(self, name, priority)
        with self.lock:
            self.streams.append(s)
        return s

    def current_stream(self, device: torch.device | None = None) -> SimStream:
        s: SimStream | None = getattr(self.clocks.tls, "stream", None)
        if s is None:
            s = self.clocks.worker()  # work launched on a stream
        return self.default if s is None else s

    @contextlib.contextmanager
    def use_stream(self, stream: SimStream) -> Iterator[SimStream]:
        prior = getattr(self.clocks.tls, "stream", None)
        self.clocks.tls.stream = stream
        try:
            yield stream
        finally:
            self.clocks.tls.stream = prior

    def new_event(self, timing: bool = False) -> SimEvent:
        return SimEvent(self, timing)

    def launch(self, stream: SimStream, fn: Callable[[], None]) -> None:
        stream._enqueue(("launch", fn))

    def sleep(self, stream: SimStream, seconds: float) -> None:
        stream._enqueue(("sleep", seconds))

    def record_stream(self, t: torch.Tensor, stream: SimStream) -> None:
        ptr = _ptr(t)
        if ptr:
            with self.lock:
                self._fences.setdefault(ptr, set()).add(stream)

    def synchronize(self, device: torch.device | None = None) -> None:
        # From a stream's own work, its stream is skipped (see SimStream.synchronize);
        # another stream waiting for an event this one records later would hang
        # here, where CUDA (issuing the work first) would not.
        try:
            for s in list(self.streams):
                s.synchronize()
        finally:
            reports = self.reports
            if threading.current_thread() is reports.owner and reports.muted:
                # The test synchronized after a reported race: what came of it
                # has run; a race found from now on is news.
                for s in list(self.streams):
                    s.drain()
                reports.synchronized()

    capturing = False
    """Set by a test to act as if a CUDA graph were being captured."""

    @contextlib.contextmanager
    def host_thread(self) -> Iterator[None]:
        if getattr(self.clocks.tls, "checking", False):
            yield
            return
        self.clocks.tls.checking = True
        try:
            with self._checker, self._host_reads:
                yield
        finally:
            self.clocks.tls.checking = False

    # -- clocks -------------------------------------------------------------------------
    def worker_started(self, stream: SimStream) -> None:
        """``stream``'s worker thread begins: its accesses are checked as the stream's."""
        self.clocks.tls.worker = stream
        self.clocks.tls.checking = True
        self._checker.__enter__()

    # -- the observer of pipeoff._happens ---------------------------------------------
    def release(self, obj: Any, key: Any = None) -> None:
        self.clocks.release(obj, key)

    def acquire(self, obj: Any, key: Any = None) -> None:
        self.clocks.acquire(obj, key)

    def report(self, err: BaseException) -> None:
        """pipeoff re-raised ``err`` (a task's failure) to its caller."""
        if isinstance(err, DataRaceError):
            self.reports.seen(err)

    # -- memory -------------------------------------------------------------------------
    def host_freed(self, start: int, end: int, pinned: bool) -> None:
        """Host memory ``[start, end)`` was freed: no stream may still use it."""
        known = self.clocks.hosts_vc()
        with self.lock:
            self.memory.remove(start, end, pinned)
            for acc in self.accesses.pop(start):
                if not _is_host(acc.actor) and known.get(acc.actor, 0) < acc.epoch:
                    self.reports.later(DataRaceError(
                        f"host memory freed while {acc.actor!r} may still {_rw(acc)} it "
                        f"({acc.op}, at {acc.where}): the host never synchronized with it"))

    def _device_freed(self, ptr: int) -> None:
        with self.lock:
            made_by = self._made_by.pop(ptr, None)
            fences = self._fences.pop(ptr, set())
            self._watched.discard(ptr)
            accesses = self.accesses.pop(ptr)
        if made_by is None or _is_host(made_by) or self._closed:
            return
        # The allocator hands the block to the next allocation on `made_by`, which
        # runs after everything enqueued there so far (waits included, even those
        # not yet run): check at that point of its queue.
        # The free itself orders nothing: on CUDA the host drops the last reference
        # when it issues work, whichever stream's work (here, thread) dropped it.
        host = self.clocks.hosts_vc()
        made_by.enqueue_freed(("launch", functools.partial(
            self._check_free, made_by, fences, accesses)), clock=host)

    def _check_free(self, made_by: SimStream, fences: set[Any],
                    accesses: list[_Access]) -> None:
        with self.lock:
            known = dict(made_by.vc)
            for acc in accesses:
                if acc.actor is made_by or _is_host(acc.actor) or acc.actor in fences:
                    continue
                # Safe if the allocation stream's next work (enqueued by the host
                # from now on) is ordered after this access: the host or the
                # allocation stream already waited for it.
                if known.get(acc.actor, 0) < acc.epoch:
                    self.reports.later(DataRaceError(
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
            if ptr not in self._watched and self.memory.host_range(ptr) is None:
                if _is_host(actor):
                    self._register_host(t.untyped_storage(), pinned=False)
                else:
                    with self.lock:
                        self._watch(t, ptr, actor)
            if span is None:
                continue
            where = where or _where()
            name = "output"
            with self.lock:
                base = self.memory.base(ptr)
                lo, hi = span[0] + ptr - base, span[1] + ptr - base
                vc = actor.vc
                self._check(base, lo, hi, True, actor, vc, name, t)
                self.accesses.record(base, lo, hi, actor, epoch, True, name, where)

    def _actor(self, device: bool, fresh: bool = False) -> Any:
        """Who runs an operation issued by this thread: its stream worker, the current
        stream (an operation on device memory), or the host. ``fresh``: the operation
        only allocates (its output is new memory, no input's data is read)."""
        worker: SimStream | None = self.clocks.worker()
        if worker is not None:
            return worker
        if not device:
            return self.clocks.host_actor()
        stream = self.current_stream()
        if fresh:
            # An allocation does not wait for the stream (nor does cudaMalloc from
            # the caching allocator): nothing it reads is written there.
            return stream
        # The device runs this after everything enqueued on the stream so far;
        # the host thread issuing it waits for that here.
        stream.drain()
        with self.lock:
            _merge(stream.vc, self.clocks.host_vc)
        return stream

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
            host = (src is not None and self.memory.host_range(_ptr(src)) is not None
                    and "device" not in kwargs)  # (device=: the device's, as a factory's)
            actor = self._actor(device=not host,
                                fresh=func.overloadpacket in _ALLOCATE_ONLY)
            return actor, self.clocks.tick(actor), frozenset(_ptr(t) for t in tensors)
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
        kinds = [self.memory.host_range(_ptr(t)) for t in tensors]
        touches_device = any(k is None and _ptr(t) for k, t in zip(kinds, tensors))
        actor = self._actor(device=touches_device)
        sync_after: SimStream | None = None
        if not _is_host(actor) and self.clocks.worker() is None:
            if _host_waits(func, args, kwargs, tensors, kinds):
                sync_after = actor
            if (any(str(r.type) in _HOST_VALUES for r in schema.returns)
                    or func.overloadpacket in _SHAPE_FROM_DATA):
                # .item(), torch.equal, nonzero(): the host waits for a value (or a
                # shape that depends on the data).
                sync_after = actor
        op = str(func).replace("aten::", "").replace(".default", "")
        where = getattr(self.clocks.tls, "where", None) or _where()
        epoch = self.clocks.tick(actor)
        # A scalar argument is read by the host at the launch, not by the stream
        # (a tester's find: freeing it before a synchronization was called a race).
        on_device = not _is_host(actor) and self.clocks.worker() is None
        scalars = {id(t) for t, k in zip(tensors, kinds)
                   if on_device and _scalar_argument(func, t, k, id(t) in written)}
        reader = self.clocks.host_actor() if scalars else actor
        read_at = self.clocks.tick(reader) if scalars else epoch
        with self.lock:
            for t in tensors:
                ptr = _ptr(t)
                span = _span(t)
                if not ptr or span is None:
                    continue
                base = self.memory.base(ptr)
                lo, hi = span[0] + ptr - base, span[1] + ptr - base
                write = id(t) in written
                who, at = (reader, read_at) if id(t) in scalars else (actor, epoch)
                self._check(base, lo, hi, write, who, who.vc, op, t)
                self.accesses.record(base, lo, hi, who, at, write, op, where)
                if base not in self._watched and self.memory.host_range(base) is None:
                    self._watch(t, base, actor)
        if sync_after is not None:
            with self.lock:
                _merge(self.clocks.host_vc, sync_after.vc)
            self.reports.deliver()
        return actor, epoch, frozenset(_ptr(t) for t in tensors)

    def _defer(self, func: Any, args: Any, kwargs: dict[str, Any]) -> tuple[Any] | None:
        """Enqueue an in-place device operation that a host thread issues on its current
        stream, to run later on the stream's worker, as a kernel runs after its launch;
        returns ``(its result,)``, or ``None`` to run it now (it returns a new tensor or
        a host value, or it synchronizes the host).

        So issue is asynchronous: a lane's dispatcher goes on (and releases its
        staging) while the stream is still late, as on a GPU.
        """
        if self._closed or self.clocks.worker() is not None:
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
        kinds = [self.memory.host_range(_ptr(t)) for t in tensors]
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
        if torch.Tag.nondeterministic_seeded in func.tags and len(tensors) == 1:
            # CUDA fixes a random kernel's draws at its launch (Philox offsets taken
            # from the generator in issue order): drawing on the worker would
            # interleave with the host's later seeding and draws (a seeded model
            # built twice came out different). Draw now, into scratch memory the
            # kernel then copies from.
            target = args[0]
            scratch = torch.empty_strided(target.size(), target.stride(), dtype=target.dtype)
            func(scratch, *args[1:], **kwargs)
            func, args, kwargs = torch.ops.aten.copy_.default, (target, scratch), {}
        # What the kernel will touch is fixed now: the tensors' storages and strides
        # at issue (a later `p.data = new` or swap_tensors must not redirect it),
        # and a 0-dim host tensor's value (a scalar argument, read at the launch).
        out = _written_first(func, args)
        fixed = tree_map_only(torch.Tensor, self.memory.issued_by(func, out), (args, kwargs))
        for t, k in zip(tensors, kinds):  # (a tester's find: this read was never checked)
            if _scalar_argument(func, t, k, t is out):
                self.host_read(t, str(func))  # the host reads a scalar argument now
        stream = self.current_stream()
        stream._enqueue(("launch", functools.partial(
            self._run_deferred, func, fixed[0], fixed[1], _where())))
        return (args[0] if returns else None,)

    def _run_deferred(self, func: Any, args: Any, kwargs: dict[str, Any], where: str) -> None:
        self.clocks.tls.where = where  # name the issuing code, not the worker, in a race
        try:
            # Autograd saw the operation at its issue (version counters, leaf
            # checks); here only the kernel runs.
            with torch._C._AutoDispatchBelowADInplaceOrView():
                func(*args, **kwargs)
        finally:
            self.clocks.tls.where = None

    def host_read(self, t: torch.Tensor, op: str) -> None:
        """The host reads ``t`` outside aten (``.tolist()``, ``.numpy()``): on device
        memory that synchronizes the host with the current stream first, as on CUDA."""
        if self._closed or self.clocks.worker() is not None:
            return
        ptr = _ptr(t)
        span = _span(t)
        if not ptr or span is None:
            return
        if self.memory.host_range(ptr) is None:
            stream = self._actor(device=True)
            with self.lock:
                _merge(self.clocks.host_vc, stream.vc)
            self.reports.deliver()
        host = self.clocks.host_actor()
        epoch = self.clocks.tick(host)
        with self.lock:
            base = self.memory.base(ptr)
            lo, hi = span[0] + ptr - base, span[1] + ptr - base
            self._check(base, lo, hi, False, host, host.vc, op, t)
            self.accesses.record(base, lo, hi, host, epoch, False, op, _where())

    def native_access(self, op: str, reads: Sequence[torch.Tensor],
                      writes: Sequence[torch.Tensor]) -> None:
        """Native code on a host thread reads ``reads`` and writes ``writes`` through
        their pointers (``pipeoff._happens.native_access``): checked and recorded like
        the same accesses by an aten op on this thread. Only host memory: native
        code cannot touch device memory."""
        if self._closed or self.clocks.worker() is not None:
            return
        host = self.clocks.host_actor()
        epoch = self.clocks.tick(host)
        where = _where()
        with self.lock:
            for write, tensors in ((False, reads), (True, writes)):
                for t in tensors:
                    ptr = _ptr(t)
                    span = _span(t)
                    if not ptr or span is None:
                        continue
                    if self.memory.host_range(ptr) is None:
                        raise AssertionError(f"{op}: native code given device memory "
                                             f"({_describe(t, self)})")
                    base = self.memory.base(ptr)
                    lo, hi = span[0] + ptr - base, span[1] + ptr - base
                    self._check(base, lo, hi, write, host, host.vc, op, t)
                    self.accesses.record(base, lo, hi, host, epoch, write, op, where)

    def _watch(self, t: torch.Tensor, base: int, actor: Any) -> None:
        self._watched.add(base)
        self._made_by.setdefault(base, actor)
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        weakref.finalize(storage, self._device_freed, base)

    def _check(self, base: int, lo: int, hi: int, write: bool, actor: Any,
               vc: dict[Any, int], op: str, t: torch.Tensor) -> None:
        acc = self.accesses.conflict(base, lo, hi, write, actor, vc)
        if acc is not None:
            here = getattr(self.clocks.tls, "where", None) or _where()
            err = DataRaceError(
                f"data race on a {_describe(t, self)}: {actor!r} {'writes' if write else 'reads'}"
                f" it ({op}, at {here}) while {acc.actor!r} may still {_rw(acc)} it "
                f"({acc.op}, at {acc.where}); nothing orders the second after the first (a "
                "missing wait_event, event fence or synchronize)")
            self.reports.race(err)
            raise err

    # -- life ---------------------------------------------------------------------------
    def close(self) -> None:
        """Drain and stop every stream (the device's exit)."""
        for s in list(self.streams):
            s.drain()
        self._closed = True
        for s in list(self.streams):
            s.stop()


def _describe(t: torch.Tensor, sim: SimulatedCuda) -> str:
    r = sim.memory.host_range(_ptr(t))
    kind = "device" if r is None else ("pinned host" if r[2] else "pageable host")
    return f"{kind} tensor of shape {tuple(t.shape)} and dtype {t.dtype}"
