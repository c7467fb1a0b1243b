"""Forward waits of an overlap step: nothing reads a parameter before the chunk that writes it.

An overlap ``step()`` returns while its chunks still write the parameters. Two
mechanisms make every reader wait, each only for the chunks it reads:

* **Module hooks** (installed by ``attach()``; :mod:`pipeoff.optim._hooks`) run
  before the forward of each module that owns parameters, and of the root.
  They are opaque to Dynamo (``torch.compiler.disable``), so they run at every
  call even inside a compiled model: they are the waits that compiled code
  gets. A hook waits for:

  - its module's own parameters;
  - the parameters of modules that do not run: a hooked module whose hook has
    never fired since ``attach()`` has its parameters read, if at all, by an
    ancestor's forward (``F.embedding(idx, self.emb.weight)``,
    ``nn.MultiheadAttention`` reading ``out_proj.weight``), so the nearest
    hooked ancestor that runs waits for them. Before any forward has run, that
    is the root, for every parameter;
  - the parameters the read guard caught being read after this hook ran
    (*learned* reads).

  On CUDA they make streams wait, never the host.
* **The read guard**, a ``TorchFunctionMode`` pushed by ``step()`` on the thread
  that called it and removed once nothing is pending. In eager code it sees
  every torch function that takes a parameter still being written, or a tensor
  sharing its storage (a functional read, a loss reading a head's weight, a
  view cached before the step, ``p.data``, evaluation, a model never attached)
  and waits for that parameter's chunks first; a hook then learns the read.
  Under Dynamo the guard is a pass-through (a compiled graph cannot wait):
  compiled code of an attached model relies on the hooks, and compiled code of
  an unattached model waits for the whole step, with a warning.

Gradients that are views into a larger buffer (DDP's ``gradient_as_bucket_view``)
are written in place by the next backward, for modules that ran or not: a
backward waits first for the chunks reading them (the guard sees the
``backward()`` call; an attached root's forward hook waits at a forward's end).

What neither sees: a read on another thread, and in compiled code a functional
read of a parameter whose own module runs later in the same forward.
``pipeoff.optim.check_overlap`` finds those.
"""

from __future__ import annotations

import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.overrides import TorchFunctionMode

from pipeoff import _accel, _compat, _faults
from pipeoff._errors import ConfigError
from pipeoff._lowlevel import record_hook_wait

if TYPE_CHECKING:
    from pipeoff._contract import StepWrites

__all__ = ["ForwardWaits"]

# Reading these says nothing about a tensor's elements: no wait for them.
_META_ATTRS = frozenset({
    "shape", "dtype", "device", "requires_grad", "is_leaf", "grad", "grad_fn", "ndim",
    "layout", "names", "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized",
    "is_mkldnn", "is_nested", "itemsize", "nbytes", "_backward_hooks",
    "_post_accumulate_grad_hooks",
    "__class__", "__dict__", "name", "retains_grad", "_version", "output_nr", "_base",
})
_META_METHODS = frozenset({
    "size", "dim", "numel", "nelement", "stride", "is_contiguous", "element_size",
    "is_floating_point", "is_complex", "get_device", "storage_offset", "__len__",
    "register_hook", "register_post_accumulate_grad_hook", "requires_grad_", "retain_grad",
    "_is_view", "is_shared", "is_pinned", "is_inference", "__sizeof__",
})


class _ReadGuard(TorchFunctionMode):
    """Waits before any eager torch function that takes a parameter still being written."""

    def __init__(self, waits: ForwardWaits) -> None:
        super().__init__()
        self.waits = waits

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if kwargs is None:
            kwargs = {}
        waits = self.waits
        if torch.compiler.is_compiling():
            # Dynamo is tracing: a graph cannot wait on a chunk, so compiled code
            # relies on the module hooks, which need attach().
            if waits.pending and not waits.attached:
                _compat.dynamo_disable(_compiled_read)(waits)
        elif waits.pending:
            waits.on_read(func, args, kwargs)
        return func(*args, **kwargs)

    @property
    def inert(self) -> bool:
        """Nothing left to guard: it may come off the stack."""
        return not self.waits.pending


def _compiled_read(waits: ForwardWaits) -> None:
    """Compiled code of a model the optimizer is not attached to is about to run.

    It cannot say which parameters it reads, so it waits for the whole step:
    correct, but with no overlap. Warns once per optimizer.
    """
    waits.settle_if_done()
    if not waits.pending:
        return
    if not waits.warned_compiled:
        waits.warned_compiled = True
        warnings.warn(
            "pipeoff: torch.compile'd code ran while an optimizer step overlapped with the "
            "forward (OffloadOptimizer(mode='overlap'), FullOffloadOptimizer(overlap="
            "'forward')) was still writing parameters, and the optimizer is not attached to "
            "the model: "
            "compiled code cannot wait per parameter, so it waited for the whole step (no "
            "overlap). Call opt.attach(model): its forward hooks run before every module, "
            "compiled or not.",
            RuntimeWarning,
            stacklevel=2,
        )
    waits.wait_for(list(waits.pending), "compiled code")


def _pop_inert_guards() -> None:
    """Take read guards with nothing left to guard off this thread's mode stack.

    Guards sit at the bottom of the stack (see :meth:`ForwardWaits._push_guard`);
    the user's modes above them keep their order.
    """
    modes = _compat.torch_function_stack()
    if not any(isinstance(m, _ReadGuard) for m in modes):
        return
    keep = []
    for m in modes:
        if isinstance(m, _ReadGuard):
            m.waits.settle_if_done()
            if m.inert:
                continue
        keep.append(m)
    if len(keep) != len(modes):
        _compat.set_torch_function_stack(keep)


def _storage_ptr(t: torch.Tensor) -> int:
    """The address of ``t``'s storage, or 0 (no storage: a wrapper subclass, meta, empty)."""
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError, TypeError):
        return 0


def _in_a_bucket(g: torch.Tensor) -> bool:
    """Whether gradient ``g`` is a view into a larger buffer that others write."""
    if g._base is not None:
        return True
    try:
        return bool(g.untyped_storage().nbytes() > g.numel() * g.element_size())
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def _tensors_in(args: Iterable[Any], kwargs: dict[str, Any]) -> Iterator[Any]:
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    yield b
    if kwargs:
        yield from _tensors_in(kwargs.values(), {})


_IN_PLACE_DUNDERS = frozenset({
    "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
    "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
    "__imatmul__",
})


def _written_by(func: Any, name: str, args: Any, kwargs: dict[str, Any]) -> list[Any]:
    """The tensors an eager torch function writes: ``self`` (or the first list) of an
    in-place op (``add_``, ``copy_``, ``_foreach_mul_``, ``x[i] = v``, ``x += v``),
    the tensor whose ``.data`` is assigned, and ``out=``."""
    out: list[Any] = []
    in_place = (name in _IN_PLACE_DUNDERS
                or (name.endswith("_") and not name.startswith("__"))
                or (name == "__set__"
                    and getattr(getattr(func, "__self__", None), "__name__", "") == "data"))
    if in_place and args:
        first = args[0]
        out.extend(first if isinstance(first, (list, tuple)) else (first,))
    o = kwargs.get("out") if kwargs else None
    if o is not None:
        out.extend(o if isinstance(o, (list, tuple)) else (o,))
    return [t for t in out if isinstance(t, torch.Tensor)]


class ForwardWaits:
    """The pending parameters of the overlap step in flight, and every wait for them.

    Args:
        on_failure: called (with no argument) when a waited chunk has failed;
            it raises the chunk's exception (the optimizer's ``wait_for_step``).
        writes_only: the tasks in flight *read* the parameters (a DiLoCo sync forming
            its pseudo-gradients): the read guard waits only before an eager torch
            function that writes one of them (an in-place op, ``out=``, a ``.data``
            assignment, ``__setitem__``); reads go on.
    """

    def __init__(self, on_failure: Callable[[], None], *, writes_only: bool = False,
                 waited_for: str = "the optimizer step in flight",
                 wait_call: str = "wait_for_step()") -> None:
        self._on_failure = on_failure
        self.writes_only = writes_only
        self._interrupted = (f"pipeoff: interrupted while a read waited for {waited_for}, "
                             "which goes on: it has not failed and must not be repeated. "
                             f"Call {wait_call} to wait for it.")
        """The note on a Ctrl-C in a read's wait: what it waited for, how to wait."""
        self._lock = threading.Lock()
        self.step: StepWrites | None = None
        """The step in flight: what it writes (the only thing read of an optimizer)."""
        self._waited: set[int] = set()
        """Chunks of the step in flight already waited for."""
        self._hook_waits: list[tuple[str, int, int]] = []
        """``(name, start, end)`` of each wait for the step in flight, ``perf_counter_ns``."""
        self.cuda = False
        self.device: torch.device | None = None
        self.pending: dict[int, tuple[int, ...]] = {}
        """``id()`` of each parameter (and its local tensor) not yet waited for, to its chunks."""
        self.storages: dict[int, int] = {}
        self._refs: dict[int, weakref.ref[torch.Tensor]] = {}
        """The pending tensors themselves: an ``id()`` or a storage address may be reused
        by another tensor once a pending one (a gradient) has been freed."""
        """Storage address of each pending parameter, to its ``id()``: a read through
        an alias (a view cached before the step, ``.data`` kept aside) waits too."""
        self._chunk_params: list[list[int]] = []
        self.bucket_grads: frozenset[int] = frozenset()
        """``id()`` of the pending gradients that are views into a larger buffer (DDP's
        ``gradient_as_bucket_view=True``): the next backward writes them in place."""
        self._guard = _ReadGuard(self)
        self._last_hook: weakref.ref[torch.nn.Module] | None = None
        self._learned: weakref.WeakKeyDictionary[torch.nn.Module, set[int]] = (
            weakref.WeakKeyDictionary())
        self.attached = False
        self.guard_enabled = True
        """Whether ``begin`` pushes the read guard (``OffloadOptimizer(read_guard=...)``)."""
        self.warned_compiled = False
        self.called: dict[tuple[bool, bool], set[int]] = {}
        """Per kind of forward (the root's ``training`` flag, grad mode), ``id()`` of the
        hooked modules whose hook has fired in one since ``attach()``: an evaluation
        forward may take another path than a training one."""
        self._kind: tuple[bool, bool] = (True, True)
        self.anchor: dict[int, int] = {}
        """Per hooked module (``id()``), its nearest hooked ancestor's, for every module
        but the root."""
        self.modules: dict[int, weakref.ref[torch.nn.Module]] = {}
        """The hooked modules by ``id()``."""
        self.root: int | None = None
        self._dependents: dict[int, list[int]] = {}

    # -- a step's life ----------------------------------------------------------------
    def begin(self, writes: StepWrites) -> list[tuple[str, int, int]]:
        """Start waiting for a step in flight: the parameters it writes are pending.

        Pushes the read guard on the calling thread. Returns the list that the
        step's waits are recorded in, ``(name, start, end)`` in ``perf_counter_ns``
        (it grows as reads wait).
        """
        chunk_params: list[list[int]] = [[] for _ in range(len(writes.write_tasks))]
        pending: dict[int, tuple[int, ...]] = {}
        storages: dict[int, int] = {}
        refs: dict[int, weakref.ref[torch.Tensor]] = {}
        bucket_grads: set[int] = set()
        for i in writes.written:
            p = writes.params[i]
            chunks = writes.chunks_of[i]
            loc = _compat.local_tensor(p)
            # The chunks write the parameter and read its gradient: a reader of the
            # one and a writer of the other (zero_grad(set_to_none=False) on the
            # model, p.grad.zero_()) both wait.
            tensors = [p, loc]
            g = writes.grad_of(i)
            if g is not None:
                tensors += [g, _compat.local_tensor(g)]
                if _in_a_bucket(tensors[-1]):
                    bucket_grads.update((id(g), id(tensors[-1])))
            for t in tensors:
                pending[id(t)] = chunks
                refs[id(t)] = weakref.ref(t)
                for c in chunks:
                    chunk_params[c].append(id(t))
            for t in tensors[1::2]:
                ptr = _storage_ptr(t)
                if ptr:
                    storages[ptr] = id(t)
        hook_waits: list[tuple[str, int, int]] = []
        with self._lock:
            self.step = writes
            self._waited = set()
            self._hook_waits = hook_waits
            self.cuda = _accel.current().is_device(writes.device)
            self.device = writes.device
            self.pending = pending
            self.storages = storages
            self._refs = refs
            self._chunk_params = chunk_params
            self.bucket_grads = frozenset(bucket_grads)
            self._last_hook = None
        if pending and self.guard_enabled and not _faults.disabled("read_guard"):
            self._push_guard()
        return hook_waits

    def end(self) -> None:
        """The step is over (waited for, or failed): nothing is pending any more."""
        with self._lock:
            self.step = None
            self.pending = {}
            self.storages = {}
            self._refs = {}
            self._chunk_params = []
            self.bucket_grads = frozenset()
        self._settle()

    def _settle(self) -> None:
        """Take inert guards off this thread's stack."""
        _pop_inert_guards()

    def _push_guard(self) -> None:
        """Put the read guard at the *bottom* of this thread's mode stack.

        A user's mode entered before ``step()`` (``with torch.device(...):``)
        pops the top of the stack when it exits: on top, the guard would be
        popped in its place. Below every other mode, each exits as it entered.
        """
        _pop_inert_guards()
        modes = _compat.torch_function_stack()
        if any(m is self._guard for m in modes):
            return  # still on this thread's stack from an earlier step
        _compat.set_torch_function_stack([self._guard, *modes])

    # -- waiting ----------------------------------------------------------------------
    def set_modules(self, root: torch.nn.Module, hooked: Iterable[torch.nn.Module]) -> None:
        """The hooked modules of a new ``attach()``: nothing is known to run yet."""
        hooked = list(hooked)
        ids = {id(m) for m in hooked}
        parent: dict[int, int] = {}
        for m in root.modules():
            for c in m.children():
                parent.setdefault(id(c), id(m))
        anchor: dict[int, int] = {}
        for m in hooked:
            a = parent.get(id(m))
            while a is not None and a not in ids:
                a = parent.get(a)
            if a is not None and m is not root:
                anchor[id(m)] = a
        dependents: dict[int, list[int]] = {}
        for mid, a in anchor.items():
            dependents.setdefault(a, []).append(mid)
        with self._lock:
            self.modules = {id(m): weakref.ref(m) for m in hooked}
            self.root = id(root)
            self.anchor = anchor
            self._dependents = dependents
            self.called = {}
            self._learned = weakref.WeakKeyDictionary()
            self.attached = True

    def forget(self) -> None:
        """Drop what the hooks learned (the parameters changed)."""
        self._learned = weakref.WeakKeyDictionary()

    def _silent(self, module: int) -> list[Any]:
        """Parameters of the hooked modules under ``module`` that have not run (anchored on it)."""
        out: list[Any] = []
        called = self.called.get(self._kind, ())
        todo = list(self._dependents.get(module, ()))
        while todo:
            d = todo.pop()
            if d in called:
                continue  # it waits for its own parameters when it runs
            ref = self.modules.get(d)
            m = ref() if ref is not None else None
            if m is not None:
                out.extend(m.parameters(recurse=False))
            todo.extend(self._dependents.get(d, ()))
        return out

    def learned(self, module: torch.nn.Module) -> frozenset[int]:
        """The parameter ids ``module``'s hook waits for besides its own."""
        return frozenset(self._learned.get(module, ()))

    def on_module(self, module: torch.nn.Module, params: Iterable[Any], name: str,
                  streams: tuple[Any, ...] | None = None) -> None:
        """A module's forward is about to run: wait for ``params``, for the parameters of the
        modules under it that do not run, and for what it learned to read."""
        self._last_hook = weakref.ref(module)
        key = id(module)
        if key == self.root:  # a forward starts: which kind of forward is it?
            self._kind = (module.training, torch.is_grad_enabled())
        called = self.called.get(self._kind)
        if called is None or key not in called:
            with self._lock:
                self.called.setdefault(self._kind, set()).add(key)
        if self.pending:
            ids = {id(p) for p in params}
            ids.update(self._learned.get(module, ()))
            ids.update(id(p) for p in self._silent(key))
            self.wait_for(ids, name, streams)
        self._settle()

    def on_read(self, func: Any, args: Any, kwargs: dict[str, Any]) -> None:
        """The read guard saw ``func`` called eagerly: wait for the pending parameters it takes."""
        name = getattr(func, "__name__", "")
        if name == "backward" and not self.writes_only:
            # (Tensor.backward; torch.autograd.backward where torch hands it to modes,
            # as 2.13 does: an older torch's does not come here, attach() does)
            self.before_backward()
        if self.writes_only:
            tensors: Iterable[Any] = _written_by(func, name, args, kwargs)
        elif name in ("__get__", "__set__"):
            if getattr(getattr(func, "__self__", None), "__name__", "") in _META_ATTRS:
                return
            tensors = _tensors_in(args, kwargs)
        elif name in _META_METHODS:
            return
        else:
            tensors = _tensors_in(args, kwargs)
        pending, storages, refs = self.pending, self.storages, self._refs
        hits = None
        for t in tensors:
            key = id(t)
            if key in pending:
                ref = refs.get(key)
                if ref is None or ref() is not t:
                    continue  # another tensor with a freed pending one's id
            else:
                ptr = _storage_ptr(t)
                key = storages.get(ptr, 0)
                if key not in pending:
                    continue
                ref = refs.get(key)
                owner = ref() if ref is not None else None
                if owner is None or _storage_ptr(owner) != ptr:
                    continue  # memory a freed pending tensor had
            if hits is None:
                hits = {key}
            else:
                hits.add(key)
        if hits is None:
            return
        hook = self._last_hook() if self._last_hook is not None else None
        if hook is not None:
            # Learn it: from the next step on, that hook waits for these parameters
            # before the forward reaches this read (it ran before it this time).
            self._learned.setdefault(hook, set()).update(hits)
        self.wait_for(hits, f"{'write' if self.writes_only else 'read'}:{name}")

    def before_backward(self) -> None:
        """A backward may begin: wait for the chunks reading gradients in a bucket.

        Hazard: the next backward writing, in place, a gradient the step in flight
        has not read yet. Autograd gives a gradient set to ``None`` a new tensor,
        but DDP with ``gradient_as_bucket_view=True`` keeps each gradient as a view
        of its bucket and writes the bucket: the new gradients of the parameters
        that run, and zeros over those of the parameters that do not
        (``find_unused_parameters``), whose modules' forward never waited.
        """
        if self.bucket_grads and self.pending:
            self.wait_for(self.bucket_grads, "backward")

    def settle_if_done(self) -> None:
        """If the step in flight has finished, nothing is pending any more (for its guard).

        Its failure, if any, is still raised by the optimizer's ``wait_for_step``.
        """
        st = self.step
        if st is not None and self.pending and st.execution.done():
            with self._lock:
                self.pending = {}
                self.storages = {}

    def wait_for(self, ids: Iterable[int], name: str,
                 streams: tuple[Any, ...] | None = None) -> None:
        """Wait for the chunks of the step in flight that write the parameters ``ids``.

        On CUDA the current stream (and ``streams``) wait, not the host; on host
        lanes the caller blocks until the chunks have written the parameters.
        """
        with self._lock:
            st = self.step
            if st is None:
                return
            waited, hook_waits = self._waited, self._hook_waits  # this step's
            todo = sorted({c for i in ids for c in self.pending.get(i, ())} - waited)
        if todo:
            if self.cuda and _accel.current().is_capturing():
                raise ConfigError(
                    "a forward that reads parameters an OffloadOptimizer(mode='overlap') step "
                    "is still writing is being captured into a CUDA graph: a replay would "
                    "not wait for the step (hooks run at capture only). Capture after "
                    "opt.wait_for_step(), or use mode='chunked'")
            if self.cuda and streams is None:
                streams = (_accel.current().current_stream(self.device),)
            t0 = time.perf_counter_ns()
            try:
                for comp in st.execution.events_for([st.write_tasks[c] for c in todo]):
                    if streams:
                        for s in streams:
                            if _faults.disabled("hook_stream_wait"):
                                continue
                            # Hazard: this stream (compute, or FSDP's all-gather
                            # copy-in) reading parameters the chunk is still writing.
                            comp.wait(s)
                    else:
                        comp.wait()  # host lanes: block until the chunk has written them
            except KeyboardInterrupt as err:
                err.add_note(self._interrupted)
                raise
            t1 = time.perf_counter_ns()
            with self._lock:
                waited.update(todo)
                for c in todo:
                    for pid in self._chunk_params[c] if c < len(self._chunk_params) else ():
                        chunks = self.pending.get(pid)
                        if chunks is not None and waited.issuperset(chunks):
                            del self.pending[pid]
            label = f"hook_wait:{name}" if name else "hook_wait"
            hook_waits.append((label, t0, t1))
            record_hook_wait(label, t0, t1)
        if st.execution.exception is not None:
            self._on_failure()  # raises the chunk's failure here
