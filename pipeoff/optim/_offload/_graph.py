"""The task graph of one offload-optimizer step: per chunk H2D -> update -> D2H; the single pass.

Graph builders read a :class:`~pipeoff.optim._offload._layout.Layout` and the wrapped
optimizer's public surface (its ``state`` and ``param_groups``), never the
``OffloadOptimizer`` itself.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pipeoff import _accel, _compat, _faults
from pipeoff._compat import local_tensor as _local
from pipeoff._errors import ConfigError
from pipeoff.execution import Execution
from pipeoff.executor import execute
from pipeoff.graph import TaskContext, TaskGraph, TaskKind
from pipeoff.optim import _update
from pipeoff.optim._offload._graph_shape import ChunkTasks, offload_step
from pipeoff.optim._offload._layout import Layout
from pipeoff.optim._tensors import describe as _describe
from pipeoff.optim._tensors import flat, flat_like, host_alloc
from pipeoff.optim._tensors import snapshot as _snapshot
from pipeoff.optim._tensors import wrap_like as _wrap_like
from pipeoff.schedule import Schedule

__all__ = ["Step", "launch", "single_pass"]


@dataclass(eq=False, slots=True)
class Step:
    """One launched step and what it must keep alive until it has run."""

    execution: Execution
    opt_tasks: tuple[str, ...]
    """Per chunk, the task that writes its parameters."""
    grads: dict[int, torch.Tensor]
    """The captured local gradients (flat, in memory order), by parameter index
    (dropped as chunks finish)."""
    restore: dict[int, tuple[torch.Tensor, torch.Tensor]]
    """(param, grad) of the parameters not yet updated, to give grads back on failure."""
    grad_refs: dict[int, weakref.ref[torch.Tensor]] = field(default_factory=dict)
    """The captured ``.grad`` of each updated parameter, weakly (for the forward waits:
    ``restore`` shrinks once a chunk is issued, while on CUDA its kernels still read)."""
    scalars: dict[int, dict[str, Any]] = field(default_factory=dict)
    """Per parameter, the scalar state its last chunk produced, until committed."""
    written: set[int] = field(default_factory=set)
    """Chunks that have written parameters (a failure after that is torn)."""
    updated: tuple[int, ...] = ()
    """The parameters (indices) the step updates, fixed at launch (``grads``
    shrinks on the lanes as chunks finish)."""
    host_state: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    """Per updated parameter, the local host tensor of each per-element state key as
    the step writes it (new state included, before it is committed)."""
    device_params: int = 0
    """Parameters the device part stepped (on the caller's stream)."""
    device_written: bool = False
    """Whether the device part wrote parameters (a failure after that is torn)."""

    def grad_of(self, i: int) -> torch.Tensor | None:
        """Parameter ``i``'s captured ``.grad``, while alive (:attr:`grad_refs`)."""
        ref = self.grad_refs.get(i)
        return None if ref is None else ref()


def capture_grads(layout: Layout) -> tuple[dict[int, torch.Tensor],
                                           dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """The local gradients of the host part's parameters that have one, flat in their
    memory order (the device part's are checked, not captured: torch's step reads them).

    Raises:
        ConfigError: a sparse gradient, or a gradient on another device.
    """
    grads: dict[int, torch.Tensor] = {}
    restore = {}
    for i, p in enumerate(layout.params):
        g = p.grad
        if g is None:
            continue
        if g.is_sparse or getattr(g, "layout", torch.strided) != torch.strided:
            raise ConfigError(f"{_describe(i, p)} has a sparse gradient; OffloadOptimizer "
                              "supports dense gradients only")
        lg = _local(g)
        if lg.device != layout.device:
            raise ConfigError(f"the gradient of {_describe(i, p)} is on {lg.device}, "
                              f"not on the parameters' device {layout.device}")
        if lg.shape != _local(p).shape:
            raise ConfigError(f"the gradient of {_describe(i, p)} has local shape "
                              f"{tuple(lg.shape)}, not the parameter's {tuple(_local(p).shape)}")
        if i in layout.split.on_device:
            continue
        grads[i] = flat_like(lg, layout.orders[i])
        restore[i] = (p, g)
    return grads, restore


def launch(layout: Layout, inner: torch.optim.Optimizer, *, pin_memory: bool,
           prefetch: int | None, budget: int | None = None,
           reserved: Callable[[torch.Tensor, str], torch.Tensor | None] | None = None) -> Step:
    """Capture grads, hyperparameters and state of ``inner``, build the step's graph, launch it.

    Per chunk: ``h2d{k}`` stages the existing state slices, ``opt{k}`` updates the
    parameter slices (:func:`~pipeoff.optim._update.step_chunk`), ``d2h{k}`` copies
    the state back and, at a parameter's last chunk, commits its new state.
    Device staging is bounded by ``budget``, or else by ``(prefetch + 1)`` chunks.
    State that does not exist yet goes into the host tensor ``reserved(param, key)`` hands out, if
    any, else into a new host allocation.

    Returns:
        The launched :class:`Step` (its execution may still be running).

    Raises:
        ConfigError: a sparse gradient, or a gradient on another device.
    """
    plan = layout.plan
    assert plan is not None, "launch() needs a chunked layout"
    params, keys = layout.params, layout.keys
    for g in inner.param_groups:  # (checked at each step: groups are edited in place)
        if g.get("differentiable"):
            raise ConfigError(
                "differentiable=True: the chunks step the parameters outside autograd, so "
                "no graph would record the step (torch's own step refuses it for leaf "
                "parameters); use mode='single_pass', which runs torch's step")
    # Capture everything the chunks read, so that zero_grad(), a scheduler's
    # step() or the next backward cannot change this step's math.
    grads, restore = capture_grads(layout)
    hyper = [{k: _snapshot(v) for k, v in g.items() if k != "params"}
             for g in inner.param_groups]
    present: dict[int, tuple[str, ...]] = {}
    scalars: dict[int, dict[str, Any]] = {}
    hosts: dict[int, dict[str, torch.Tensor]] = {}
    missing: list[tuple[int, str]] = []
    for i in grads:
        p = params[i]
        st = inner.state.get(p, {})
        present[i] = tuple(k for k in keys[i] if st.get(k) is not None)
        scalars[i] = {k: v for k, v in st.items() if k not in keys[i]}
        hosts[i] = {k: flat(_local(st[k]), layout.orders[i]) for k in present[i]}
        missing += [(i, k) for k in keys[i] if k not in present[i]]
    taken = [reserved(params[i], key) if reserved is not None else None for i, key in missing]
    fresh = iter(host_alloc([(_local(params[i]).shape, _local(params[i]).dtype,
                              layout.orders[i])
                             for (i, _), r in zip(missing, taken) if r is None], pin_memory))
    new_state: dict[int, dict[str, torch.Tensor]] = collections.defaultdict(dict)
    for (i, key), r in zip(missing, taken):
        h = r if r is not None else next(fresh)
        hosts[i][key] = flat(h, layout.orders[i])
        new_state[i][key] = _wrap_like(params[i], h)

    cuda = _accel.current().is_device(layout.device)
    step = Step(execution=None, opt_tasks=(), grads=grads,  # type: ignore[arg-type]
                restore=restore, updated=tuple(grads),
                grad_refs={i: weakref.ref(g) for i, (_, g) in restore.items()})
    for i in grads:
        st = inner.state.get(params[i], {})
        step.host_state[i] = {k: _local(st[k]) for k in present[i]}
        step.host_state[i].update({k: _local(v) for k, v in new_state.get(i, {}).items()})

    def commit(i: int) -> None:
        # A parameter's state is committed in one go once all of it is written,
        # so a failed step never leaves a half-initialized entry.
        # (No entry for a parameter without state: SGD without momentum keeps none.)
        update = {**step.scalars.pop(i, {}), **new_state.get(i, {})}
        if update:
            inner.state[params[i]].update(update)

    def commit_all(ends: list[int]) -> None:
        for i in ends:
            commit(i)

    def work(c: ChunkTasks, buf: str | None) -> tuple[Any, Any, Any]:
        k, segs = c.index, c.segments
        ends_here = [s.param for s, _, _ in segs if layout.last_chunk[s.param] == k]
        done = functools.partial(commit_all, ends_here)
        if buf is None:  # nothing to copy out: the update commits
            return None, _opt_work(layout, inner, k, None, segs, present, scalars, hyper,
                                   step, cuda, done), None
        return (_h2d_work(buf, segs, keys, present, hosts),
                _opt_work(layout, inner, k, buf, segs, present, scalars, hyper, step, cuda,
                          None),
                _d2h_work(buf, segs, keys, hosts, done))

    local = [_local(p) for p in params]
    graph, schedule = offload_step(
        layout.device, plan, itemsize=[t.element_size() for t in local],
        nkeys=[len(k) for k in keys], local_numel=[t.numel() for t in local],
        present=[len(present.get(i, ())) for i in range(len(params))], updated=grads,
        prefetch=prefetch, budget=budget, work=work)
    step.execution = execute(graph, schedule)
    step.opt_tasks = tuple(f"opt{c.index}" for c in plan.chunks)
    return step


def single_pass(layout: Layout, inner: torch.optim.Optimizer,
                closure: Callable[[], float] | None,
                offload: Callable[[], None]) -> tuple[Execution, Any]:
    """The legacy step: all state to the device, the wrapped ``step(closure)``, all state back
    (but the device part's, which stays there).

    Runs on the synchronous schedule (inline, on the caller's thread, so a
    closure may run forward and backward). ``offload`` moves state that a
    first step created on the device to host memory. Returns the execution
    and the closure's loss.
    """
    params, dev = layout.params, layout.device
    moved: list[tuple[torch.Tensor, str, torch.Tensor, torch.Tensor]] = []

    on_device = {id(layout.params[i]) for i in layout.split.on_device}

    def h2d(ctx: TaskContext) -> None:
        for i, p in enumerate(params):
            if p.grad is not None and p.grad.layout != torch.strided:
                # Hazard: the step written, then its sparse state (SGD's momentum)
                # failing to go back to the dense host copy, and a retry stepping twice.
                raise ConfigError(f"{_describe(i, p)} has a sparse gradient; OffloadOptimizer "
                                  "supports dense gradients only")
        for p in params:  # each parameter once, even if a group lists it twice
            st = inner.state.get(p)
            if not st or id(p) in on_device:  # the device part's state is there
                continue
            for k, v in list(st.items()):
                loc = _local(v) if isinstance(v, torch.Tensor) else None
                if loc is None or k == "step" or loc.shape != _local(p).shape:
                    continue
                d = torch.empty_like(loc, device=dev)
                # Hazard: none; the host copy is pinned and kept alive in `moved`.
                d.copy_(loc, non_blocking=True)
                moved.append((p, k, loc, d))
                st[k] = _wrap_like(p, d)

    # The wrapped optimizer's step without torch's hook wrapper: the step hooks
    # (global ones, and those on the OffloadOptimizer) already ran around
    # OffloadOptimizer.step, once, as in the other modes.
    raw_step = _compat.step_body(type(inner))

    def update(ctx: TaskContext) -> Any:
        with torch.enable_grad() if closure is not None else contextlib.nullcontext():
            return raw_step(inner, closure)

    def back() -> None:
        while moved:
            p, k, host, _ = moved.pop()
            host.copy_(_local(inner.state[p][k]))
            inner.state[p][k] = _wrap_like(p, host)
        offload()  # state a first step created on the device

    graph = TaskGraph(device=dev)
    graph.add_task("h2d", TaskKind.H2D, h2d)
    graph.add_task("opt", TaskKind.OPTIMIZER_CHUNK, update, deps=["h2d"])
    graph.add_task("d2h", TaskKind.D2H, lambda ctx: back(), deps=["opt"])
    ex = execute(graph, Schedule.synchronous())
    try:
        ex.wait()
    except BaseException as err:
        if isinstance(err, KeyboardInterrupt):
            # (Not "call step() again": the step may have written some parameters,
            # and a retry steps them twice; a tester's find.)
            err.add_note("pipeoff: this Ctrl-C came inside mode='single_pass''s step, which "
                         "runs the wrapped optimizer's step on this thread as torch does: "
                         "some parameters and their state may be stepped and others not; "
                         "load a checkpoint rather than call step() again")
        # Hazard: the state left in this step's device copies for the rest of the
        # run (memory_stats() counting it as host memory) when the closure or the
        # step raised before d2h ran. Its values go back as they are (torch's own
        # failed step leaves its state as far as it got); an error here would only
        # hide the step's own, which is what the caller sees.
        with contextlib.suppress(Exception):
            back()
        raise
    return ex, ex.result("opt")


def _slot(ctx: TaskContext, buf: str, s: Any, j: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    off = s.offset + j * s.slot_bytes
    return ctx.buffer(buf)[off:off + n * dtype.itemsize].view(dtype)


def _h2d_work(buf: str, segs: Sequence[Any], keys: Sequence[tuple[str, ...]],
              present: dict[int, tuple[str, ...]], hosts: dict[int, dict[str, torch.Tensor]],
              ) -> Callable[[TaskContext], None]:
    def work(ctx: TaskContext) -> None:
        for s, lo, hi in segs:
            for j, k in enumerate(keys[s.param]):
                if k in present[s.param]:
                    # Hazard: none; the source is pinned host state that only this
                    # step's own D2H (ordered after it) writes.
                    host = hosts[s.param][k]
                    _slot(ctx, buf, s, j, hi - lo, host.dtype).copy_(host[lo:hi],
                                                                     non_blocking=True)
    return work


def _opt_work(layout: Layout, inner: torch.optim.Optimizer, k: int, buf: str | None,
              segs: Sequence[Any],
              present: dict[int, tuple[str, ...]], scalars: dict[int, dict[str, Any]],
              hyper: Sequence[dict[str, Any]], step: Step, cuda: bool,
              commit: Callable[[], Any] | None) -> Callable[[TaskContext], None]:
    def work(ctx: TaskContext) -> None:
        params, keys = layout.params, layout.keys
        groups: dict[int, _update.ChunkGroup] = {}
        mine: list[tuple[int, dict[str, Any]]] = []
        for s, lo, hi in segs:
            i = s.param
            p = flat(_local(params[i]).detach(), layout.orders[i])
            cg = _update.group_of(groups, hyper, layout.group_of[i])
            dtype = p.dtype
            if buf is not None:
                staged = {key: _slot(ctx, buf, s, j, hi - lo, dtype)
                          for j, key in enumerate(keys[i])}
            else:  # a zero-byte chunk: only zero-element (or state-less) slices
                staged = {key: p.new_empty(0) for key in keys[i]}
            sc = cg.add(p[lo:hi], step.grads[i][lo:hi], staged, present[i], scalars[i])
            if layout.last_chunk[i] == k:
                mine.append((i, sc))
        # A chunk has written its parameters once any of their version counters
        # moved (slices share their parameter's): the wrapped optimizer may
        # raise while it sets up (a flag turned on mid-training), having
        # written nothing, and then the step can be retried.
        bases = [_local(params[i]) for i in {s.param for s, _, _ in segs}]
        versions = [b._version for b in bases]
        try:
            _update.step_chunk(_update.make_shadow(inner), [groups[g] for g in sorted(groups)])
        except BaseException:
            if any(b._version != v for b, v in zip(bases, versions)):
                step.written.add(k)
            raise
        step.written.add(k)
        for i, sc in mine:
            step.scalars[i] = sc
            step.restore.pop(i, None)
            g = step.grads.pop(i, None)
            if g is not None and cuda and not _faults.disabled("record_stream"):
                # Hazard: the caching allocator handing this grad's memory to new
                # work once the user drops it, while this lane still reads it.
                _accel.current().record_stream(g, ctx.stream)
        if commit is not None:  # nothing to copy out: commit now
            commit()
    return work


def _d2h_work(buf: str, segs: Sequence[Any], keys: Sequence[tuple[str, ...]],
              hosts: dict[int, dict[str, torch.Tensor]],
              commit: Callable[[], Any]) -> Callable[[TaskContext], None]:
    def work(ctx: TaskContext) -> None:
        for s, lo, hi in segs:
            for j, key in enumerate(keys[s.param]):
                # Hazard: host readers (state_dict, the next step) see this copy
                # only after waiting for the execution. The slot is read in the host
                # state's dtype, the parameter's at step() (checked then): not the
                # parameter's now, which model.to(dtype) may have changed since (its
                # read waited for the chunk, not for this copy).
                host = hosts[s.param][key]
                host[lo:hi].copy_(_slot(ctx, buf, s, j, hi - lo, host.dtype),
                                  non_blocking=True)
        commit()
    return work
