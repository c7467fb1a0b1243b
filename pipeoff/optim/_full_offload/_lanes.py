"""The work of a full-offload micro-step's tasks, which runs on pipeoff's lanes.

Per parameter ``i`` and piece ``j`` of at most ``slot_bytes``: :meth:`LaneWork.d2h`
copies a shipped gradient into a host slot, :meth:`LaneWork.fold` adds it into
the FP32 accumulator. Per chunk ``k`` of the final micro-step:
:meth:`LaneWork.step_chunk` steps the masters and casts them into a weight
buffer, :meth:`LaneWork.h2d` copies that into the device weights. The math is
``pipeoff.optim._full_offload._accumulate`` and ``_update``; this module binds it to the
registry's tensors.

[Note: lane writes]
The lanes write only these; the caller's thread reads each only after the wait
named. What they compute goes into the accumulation's :class:`LaneResults`
(``Accumulation.results``), never into the caller's records
(``tests/test_layout.py`` parses this module and fails on any other store):

* ``LaneResults.counts[i]``, ``.norms[i]``, ``.norm_lanes`` (``acc:{i}.{j}``, the ``accumulate``
  lane): read by later tasks of the same execution (ordered by the graph's
  dependencies), and by the next micro-step's lanes after its ``prev`` gate
  (the previous execution's ``done``); the caller edits them (a gradient set
  by hand) only after waiting for the folds.
* ``LaneResults.held`` (``acc:{i}.{j}`` of a held gradient; ``norm`` or ``step:{k}``
  when they fold it), ``.held_sumsq`` (``step:{k}``): read by later tasks of the
  same execution (``_one_pass.py``), ordered by the graph's dependencies.
* ``LaneResults.partial_norms``, ``.total_norm`` (``norm``, ``norm_allreduce``,
  ``norm_pass``): the caller reads ``total_norm`` (``grad_norm``) after waiting for
  the task that sets it. (With a device part the caller's thread then replaces it
  with the norm over both parts, before it opens the ``step`` gate: ``_fraction.py``.)
* ``LaneResults.stepped_chunks``, ``.torn_chunks`` (``step:{k}``): read by
  ``classify`` once the execution is done (waited for, or settled).
* ``LaneResults.overwritten`` (``h2d:{k}``): read by ``wait_for_step()`` once the
  final execution settled.
* Host tensors (``OffloadedParam.acc``, ``.master``, ``.state``), ``.scalars``,
  ``.present``, ``.stepped`` (``acc:``, ``step:``): the caller reads them
  (``state_dict``, ``refresh_masters``, a transfer) after ``wait_for_step()``
  or the completions of ``completion_for()``.
* ``OffloadedParam.version`` (``h2d:{k}``, after its copy is issued): compared
  with the weight's version counter at the next step, after ``wait_for_step()``.
* ``Shipped.tensor`` (``d2h:``, set to ``None`` once the last piece's copy is
  issued): no one else reads it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from pipeoff import _accel, _dist, _faults
from pipeoff.graph import TaskContext
from pipeoff.optim import _update
from pipeoff.optim._full_offload import _accumulate, _edits, _fold_norm, _host_kernel
from pipeoff.optim._full_offload._config import FullOffloadConfig
from pipeoff.optim._full_offload._graph import (
    PATH,
    STEP,
    FullWork,
    grad_gate,
    pieces,
    slot_buffer,
    weight_buffer,
)
from pipeoff.optim._full_offload._one_pass import ONE_PASS, HeldWork
from pipeoff.optim._full_offload._param import OffloadedParam, ParamRegistry
from pipeoff.optim._tensors import flat, version_of

__all__ = ["LaneResults", "LaneWork", "gate_name", "reduce_norms"]


def gate_name(rec: OffloadedParam) -> str:
    """The gate a parameter's gradient opens."""
    return grad_gate(rec.name)


@dataclasses.dataclass(eq=False, slots=True)
class LaneResults:
    """What one accumulation's lanes computed (see ``[Note: lane writes]``)."""

    counts: list[int]
    """Per parameter, the contributions folded into its host accumulator."""
    norms: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    """Per parameter, the 2-norm of its final sum (taken in its final fold)."""
    partial_norms: dict[tuple[Any, ...], torch.Tensor] = dataclasses.field(
        default_factory=dict)
    """Per set of process groups, the 2-norm of the gradients of the parameters sharded
    over them (``norm``), before ``norm_allreduce``."""
    total_norm: torch.Tensor | None = None
    stepped_chunks: set[int] = dataclasses.field(default_factory=set)
    """Chunks whose masters were all stepped (the host_step lane)."""
    torn_chunks: set[int] = dataclasses.field(default_factory=set)
    """Chunks whose step raised after writing some of their masters."""
    overwritten: set[int] = dataclasses.field(default_factory=set)
    """Parameters whose weight something else wrote after the last step and before
    this step's ``h2d`` overwrote it (read after the execution settled)."""
    held: set[int] = dataclasses.field(default_factory=set)
    """Parameters whose final gradient is in the held buffer, not folded into the sum
    (``[Note: one pass]`` in ``_one_pass.py``)."""
    held_sumsq: dict[int, float] = dataclasses.field(default_factory=dict)
    """Per parameter stepped in one pass, the sum of squares of its gradient, taken in
    the pass."""
    norm_lanes: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    """Per parameter whose final fold is under way in pieces, the running lane sums of
    torch's norm (``_fold_norm.fold_norm``)."""

    @classmethod
    def for_params(cls, n: int) -> LaneResults:
        return cls(counts=[0] * n)

    def has_grad(self, i: int) -> bool:
        """Whether parameter ``i`` steps: a sum, or a held gradient."""
        return self.counts[i] > 0 or i in self.held


def _device_of(p: torch.Tensor) -> torch.device:
    """``p``'s device with its index (taken on the caller's thread: a lane's current
    device is not the rank's)."""
    accel = _accel.current()
    return accel.normalize(p.device) if accel.is_device(p.device) else p.device


class LaneWork:
    """The work of each task kind of one micro-step's execution.

    It holds the registry's parameters and chunk plan as they were at launch: a
    later change of ``param_groups`` (between steps, while this one is still in
    flight under ``overlap="forward"``) re-indexes the registry, not this.
    """

    def __init__(self, registry: ParamRegistry, config: FullOffloadConfig,
                 held: Mapping[int, torch.Tensor] | None = None) -> None:
        self.params: Sequence[OffloadedParam] = tuple(registry.params)
        self.position = {id(rec.param): i for i, rec in enumerate(self.params)}
        """Each parameter's position, by ``id()`` (check identity: ``position_of``)."""
        self.groups = tuple(rec.group for rec in registry.params)
        """Per parameter, its param group at launch (the index into a step's ``hyper``)."""
        self.plan = registry.plan
        self.norm_groups = tuple(registry.norm_groups)
        """Per parameter, the process groups its gradient's squared norm is summed over."""
        self.all_norm_keys = tuple(dict.fromkeys(k for k in self.norm_groups if k))
        """The distinct non-empty sets of groups, in order (the same on every rank)."""
        self.norm_devices = {key: _device_of(self.params[self.norm_groups.index(key)].param)
                             for key in self.all_norm_keys}
        """Per set of groups, the device of its parameters: where a squared norm goes for
        a group that takes no host tensors (NCCL)."""
        self.config = config
        self.probe = registry.probe
        self.pin = registry.pin
        self.threads = config.num_threads or _host_kernel.default_threads()
        """Threads of each native kernel call (one parallel region per tensor)."""
        self.held = None if held is None else HeldWork(self.params, held, config.slot_bytes,
                                                       self.threads)
        """The work of a final micro-step's held gradients (``_one_pass.py``), or ``None``."""

    def position_of(self, param: torch.Tensor) -> int | None:
        """``param``'s position at launch, or ``None`` if it was not a parameter then."""
        i = self.position.get(id(param))
        return i if i is not None and self.params[i].param is param else None

    def bind(self, res: LaneResults, *, final: bool,
             hyper: list[dict[str, Any]] | None) -> FullWork:
        """The work of one micro-step's graph: what it computes goes into ``res`` (the
        accumulation's), ``final`` steps, ``hyper`` are the hyperparameters captured at
        launch (``overlap="backward"``; else the ``step`` gate brings them)."""
        return FullWork(
            d2h=lambda i, j, ctx: self.d2h(i, j, ctx),
            accumulate=lambda i, j, ctx: self.fold(res, final, i, j, ctx),
            step=lambda k, ctx: self.step_chunk(res, hyper, k, ctx),
            h2d=lambda k, ctx: self.h2d(res, k, ctx),
            norm=lambda ctx: self.norm(res, ctx),
            allreduce=lambda ctx: self.allreduce_norm(res),
            norm_pass=lambda ctx: self.norm_pass(res, ctx),
        )

    def _threads(self) -> None:
        n = self.config.num_threads
        if n is not None and torch.get_num_threads() != n:
            torch.set_num_threads(n)  # per thread (OpenMP): this lane only

    # -- gradients in ------------------------------------------------------------------
    def d2h(self, i: int, j: int, ctx: TaskContext) -> None:
        rec = self.params[i]
        shipped = ctx.gate(gate_name(rec))
        if shipped is None:
            ctx.moved(0)  # no gradient this micro-step: nothing crosses the link
            return
        if self.held is not None and i in self.held:
            self.held.copy(i, j, shipped, ctx)
            return
        g = shipped.tensor
        assert g is not None
        s, e = pieces(rec.numel, shipped.dtype.itemsize, self.config.slot_bytes)[j]
        if e > s:
            slot = ctx.buffer(slot_buffer(i, j), shipped.dtype)
            slot.copy_(g[s:e], non_blocking=True)
        if e == rec.numel or e == s:
            if ctx.stream is not None and not _faults.disabled("record_stream"):
                # Hazard: the caching allocator handing the gradient's memory to
                # the next allocation on the stream that made it while this
                # lane's copy still reads it.
                _accel.current().record_stream(g, ctx.stream)
            shipped.tensor = None  # the last piece is issued: free it on the device

    def fold(self, res: LaneResults, final: bool, i: int, j: int, ctx: TaskContext) -> None:
        self._threads()
        rec = self.params[i]
        g = ctx.gate(gate_name(rec))
        size = g.dtype.itemsize if g is not None else rec.param.dtype.itemsize
        parts = pieces(rec.numel, size, self.config.slot_bytes)
        last = j == len(parts) - 1
        if self.held is not None and i in self.held:
            if g is None:
                ctx.moved(0)
            self.held.arrived(res, i, last, g is not None)
            return
        normed = False
        if g is None:
            ctx.moved(0)
        else:
            s, e = parts[j]
            if e > s:
                src = ctx.buffer(slot_buffer(i, j), g.dtype)
                dst, first = rec.flat_acc[s:e], res.counts[i] == 0
                if final:  # the norm taken in the same pass, torch's bits
                    normed = self._fold_norm(res, i, dst, src, first=first, start=s, last=last)
                elif not _host_kernel.fold(dst, src, first=first, threads=self.threads):
                    _accumulate.fold(dst, src, first=first)
            if last:
                res.counts[i] += 1
        if last and final and res.counts[i] > 0 and not normed:
            res.norms[i] = _accumulate.norm(rec.flat_acc)

    def _fold_norm(self, res: LaneResults, i: int, dst: torch.Tensor, src: torch.Tensor, *,
                   first: bool, start: int, last: bool) -> bool:
        """The final fold of a piece of parameter ``i``, taking torch's norm of its sum in
        the same pass (``_fold_norm.fold_norm``) when it can: whether its norm is in
        ``res.norms`` (at the ``last`` piece); else folded apart."""
        lanes = _fold_norm.new_lanes() if start == 0 else res.norm_lanes.get(i)
        out = False if lanes is None else _fold_norm.fold_norm(
            dst, src, first=first, threads=self.threads, lanes=lanes, offset=start,
            total=self.params[i].numel, last=last)
        if out is False:
            res.norm_lanes.pop(i, None)
            if not _host_kernel.fold(dst, src, first=first, threads=self.threads):
                _accumulate.fold(dst, src, first=first)
            return False
        assert lanes is not None
        res.norm_lanes[i] = lanes
        if isinstance(out, torch.Tensor):
            res.norms[i] = out
            res.norm_lanes.pop(i)
        return out is not None

    # -- the gradient norm ---------------------------------------------------------------
    def norm(self, res: LaneResults, ctx: TaskContext) -> None:
        """Per set of groups the parameters are sharded over (one, usually), the 2-norm
        of their gradients; the total when no rank holds another part of them. With held
        gradients, first folds them (``FOLD``), or leaves it to ``norm_pass``."""
        self._threads()
        if self.held is not None:
            if ctx.gate(PATH) == ONE_PASS:
                return
            self.held.fold_all(res)
        self._local_norms(res)

    def renorm(self, res: LaneResults, edited: Sequence[int]) -> bool:
        """On the caller's thread, after the ``norm`` task and before the all-reduce's
        gate: the norms again for the gradients the loop replaced or dropped since
        (``edited``; their sums and counts say so already). Whether the total is known
        (``False``: the all-reduce will take it)."""
        for i in edited:
            if res.counts[i] > 0:
                res.norms[i] = _accumulate.norm(self.params[i].flat_acc)
            else:
                res.norms.pop(i, None)
        self._local_norms(res)
        return not any(res.partial_norms)

    def _local_norms(self, res: LaneResults) -> None:
        keys: dict[tuple[Any, ...], list[torch.Tensor]] = {}
        for i in range(len(self.params)):
            if res.counts[i] > 0:
                keys.setdefault(self.norm_groups[i], []).append(res.norms[i])
        partial = {key: torch.linalg.vector_norm(torch.stack(norms), 2.0)
                   for key, norms in keys.items()}
        res.partial_norms = partial
        if not any(partial):  # nothing to reduce: the norm is this rank's
            res.total_norm = (next(iter(partial.values())) if len(partial) == 1
                              else torch.tensor(0.0) if not partial
                              else torch.linalg.vector_norm(torch.stack(list(partial.values())),
                                                            2.0))

    def norm_pass(self, res: LaneResults, ctx: TaskContext) -> None:
        """The total norm of a one-pass step, after its chunks (``_one_pass.py``)."""
        if self.held is not None and ctx.gate(PATH) == ONE_PASS:
            self.held.total_norm(res)

    def allreduce_norm(self, res: LaneResults) -> None:
        """The squared norms (float64) summed over the ranks that hold the other shards
        of the same parameters: over the mesh dimensions they are sharded on."""
        res.total_norm = reduce_norms(res.partial_norms, self.all_norm_keys, self.norm_devices)

    # -- the step ----------------------------------------------------------------------
    def step_chunk(self, res: LaneResults, hyper_at_launch: list[dict[str, Any]] | None, k: int,
                   ctx: TaskContext) -> None:
        self._threads()
        edits: Mapping[int, Sequence[Any]] = {}
        if self.config.overlap != "backward":
            hyper, max_norm, edits = ctx.gate(STEP)
        else:
            hyper, max_norm = hyper_at_launch, None
        assert hyper is not None
        clip_coef = None
        if max_norm is not None:
            assert res.total_norm is not None
            # The expressions of torch.nn.utils.clip_grad_norm_, for the same bits.
            clip_coef = torch.clamp(max_norm / (res.total_norm + 1e-6), max=1.0)
        idx = [i for i in self.plan.chunks[k] if res.has_grad(i)]
        # The loop's own edits of each gradient (its clip call's coefficient, say), in
        # its order: one scaling by a clip coefficient goes into the native pass.
        scales: dict[int, float] = {}
        for i in idx:
            e = edits.get(i)
            if not e:
                continue
            if clip_coef is None and _edits.fusable(e):
                scales[i] = float(e[0][1])
            else:
                _edits.apply_edits(self.params[i].flat_acc, e)
        kernel, native = self._native_of(idx, hyper)
        for i in [i for i in idx if i in res.held and i not in native]:
            assert self.held is not None  # (a group no longer native: fold, then its path)
            self.held.fold_one(res, i)
        groups: dict[int, _update.ChunkGroup] = {}
        scalars: dict[int, dict[str, Any]] = {}
        for i in idx:
            if i in native:
                continue
            rec = self.params[i]
            if clip_coef is not None:
                rec.flat_acc.mul_(clip_coef)
            elif i in scales:
                _edits.apply_edits(rec.flat_acc, edits[i])
            gi = self.groups[i]
            keys = _update.state_keys(self.probe, hyper[gi])
            st = rec.ensure_state(keys, self.pin)
            scalars[i] = _update.group_of(groups, hyper, gi).add(
                rec.flat_master, rec.flat_acc, {key: flat(st[key], rec.order) for key in keys},
                tuple(key for key in rec.present if key in keys), rec.scalars)
        # A chunk whose step raised after writing some masters leaves them partly
        # stepped (torn): their version counters (aten's in-place ops and the native
        # kernel bump them) or a step count that moved (torch's fused and foreach
        # kernels bump none) say whether it may have written any.
        masters = [self.params[i].flat_master for i in idx]
        versions = [m._version for m in masters]
        w = ctx.buffer(weight_buffer(k)) if any(n for *_, n, _ in self.weight_slices(k)) else None
        cast_done: set[int] = set()
        try:
            if groups:
                _update.step_chunk(_update.make_shadow(self.probe), list(groups.values()))
            if native:
                assert kernel is not None
                scale = None if clip_coef is None else float(clip_coef)
                slices = {i: (off, n, dtype) for i, off, n, dtype in self.weight_slices(k)}
                for i, h in native.items():
                    scalars[i] = self._native_step(kernel, res, i, h, w, slices[i],
                                                   scales.get(i, scale))
                    if slices[i][2] in (torch.bfloat16, torch.float32):
                        cast_done.add(i)
        except BaseException:
            if (any(m._version != v for m, v in zip(masters, versions))
                    or any(g.advanced for g in groups.values())):
                res.torn_chunks.add(k)
            raise
        res.stepped_chunks.add(k)
        for i in idx:
            rec = self.params[i]
            rec.scalars = scalars[i]
            # (A key this step's hyperparameters do not use stays, as in torch's state:
            # momentum set to 0 for a while, then back, goes on from its buffer.)
            rec.present = tuple(dict.fromkeys(
                (*rec.present, *_update.state_keys(self.probe, hyper[self.groups[i]]))))
            rec.stepped = True
        cast = [(i, off, n, dtype) for i, off, n, dtype in self.weight_slices(k)
                if res.has_grad(i) and n and i not in cast_done]
        if cast:  # (a chunk of empty parameters has no buffer)
            assert w is not None
            for i, off, n, dtype in cast:
                _accumulate.cast_into(w[off:off + n * dtype.itemsize].view(dtype),
                                      self.params[i].flat_master)

    def _native_of(self, idx: Sequence[int], hyper: Sequence[Mapping[str, Any]],
                   ) -> tuple[_host_kernel.HostKernel | None, dict[int, _host_kernel.AdamHyper]]:
        """The native kernel and, per parameter of ``idx`` it steps, its group's
        hyperparameters (``fused=True`` Adam/AdamW groups, when the kernel passed its
        self-test here); the others take the wrapped optimizer's path."""
        cls = self.config.optimizer_class
        per_group: dict[int, _host_kernel.AdamHyper | None] = {}
        native: dict[int, _host_kernel.AdamHyper] = {}
        for i in idx:
            gi = self.groups[i]
            if gi not in per_group:
                per_group[gi] = _host_kernel.adam_hyper(cls, hyper[gi])
            h = per_group[gi]
            if h is not None:
                native[i] = h
        if not native:
            return None, native
        kernel = _host_kernel.host_kernel(warn=False)  # (step() warns, on the caller's thread)
        return kernel, native if kernel is not None else {}

    def _native_step(self, kernel: _host_kernel.HostKernel, res: LaneResults, i: int,
                     h: _host_kernel.AdamHyper, w: torch.Tensor | None,
                     where: tuple[int, int, torch.dtype], scale: float | None) -> dict[str, Any]:
        """Step parameter ``i`` with the native kernel (casting into its slice of ``w``
        when its dtype allows; a held gradient folded inside the pass, whose norm it
        takes); returns its new scalars (``step``), which the caller commits once the
        chunk has succeeded."""
        rec = self.params[i]
        st = rec.ensure_state(("exp_avg", "exp_avg_sq"), self.pin)
        m, v = flat(st["exp_avg"], rec.order), flat(st["exp_avg_sq"], rec.order)
        if "exp_avg" not in rec.present:  # a first step: the optimizer's state starts at 0
            m.zero_()
            v.zero_()
        prev = rec.scalars.get("step")
        # torch's fused Adam keeps the step as an FP32 tensor, incremented before the math.
        step = (prev.clone() if isinstance(prev, torch.Tensor)
                else torch.tensor(float(prev or 0), dtype=torch.float32))
        step += 1
        off, n, dtype = where
        out = None
        if w is not None and n and dtype in (torch.bfloat16, torch.float32):
            out = w[off:off + n * dtype.itemsize].view(dtype)
        if i in res.held:
            assert self.held is not None and scale is None  # (clipping and edits fold first)
            res.held_sumsq[i] = kernel.adam_step(  # type: ignore[assignment]
                rec.flat_master, rec.flat_acc if res.counts[i] > 0 else None, m, v, out, h,
                step=float(step), scale=None, threads=self.threads,
                last_grad=self.held.views[i], sumsq=True)
        else:
            kernel.adam_step(rec.flat_master, rec.flat_acc, m, v, out, h, step=float(step),
                             scale=scale, threads=self.threads)
        return {**rec.scalars, "step": step}

    def weight_slices(self, k: int) -> Iterator[tuple[int, int, int, torch.dtype]]:
        """``(i, byte offset, numel, dtype)`` of each weight in chunk ``k``'s buffer."""
        off = 0
        for i in self.plan.chunks[k]:
            rec = self.params[i]
            n = rec.numel
            dtype = rec.param.dtype
            yield i, off, n, dtype
            off += -(-(n * dtype.itemsize) // 64) * 64

    @torch.no_grad()
    def h2d(self, res: LaneResults, k: int, ctx: TaskContext) -> None:
        copies = [(i, off, n, dtype) for i, off, n, dtype in self.weight_slices(k)
                  if res.has_grad(i) and n]
        # What crosses the link: the weights of the stepped parameters, unpadded.
        ctx.moved(sum(n * dtype.itemsize for _, _, n, dtype in copies))
        if not copies:
            return
        w = ctx.buffer(weight_buffer(k))
        for i, off, n, dtype in copies:
            rec = self.params[i]
            loc = rec.local
            if version_of(rec.param) != rec.version:
                res.overwritten.add(i)  # written from outside since our last write
            flat(loc, rec.order).copy_(w[off:off + n * dtype.itemsize].view(dtype),
                                       non_blocking=True)
            rec.version = version_of(rec.param)  # our own write, not an external one


def reduce_norms(partial: Mapping[tuple[Any, ...], torch.Tensor],
                 keys: Sequence[tuple[Any, ...]],
                 devices: Mapping[tuple[Any, ...], torch.device]) -> torch.Tensor:
    """The total 2-norm (FP32, on the host) from each set of groups' local norm
    (``partial``, ``()`` for parameters every rank holds whole): the squares in float64,
    each set's summed over its groups, then added. ``keys``: every non-empty set any
    parameter has, in an order the same on every rank; ``devices``: per set, where a
    square goes for a group that takes no host tensors (NCCL)."""
    mine = partial.get(())  # replicated parameters: every rank has it all
    total = torch.zeros((), dtype=torch.float64) if mine is None else mine.double() ** 2
    # Every rank issues the same collectives in the same order: one per group of
    # every key any parameter may have (a rank without gradients for some
    # parameters still joins, with zero).
    for key in keys:
        t = partial.get(key)
        sq = torch.zeros((), dtype=torch.float64) if t is None else t.double() ** 2
        for group in key:  # (through device memory for a group that takes none of the
            sq = _dist.all_reduce_host(sq, group, devices[key])  # host's)
        total += sq
    return total.sqrt().float()
