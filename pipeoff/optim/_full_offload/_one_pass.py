"""The one-pass final micro-step: the final backward's BF16 gradients held in pinned
host memory until the step, and folded inside its pass (32 bytes per parameter).

[Note: one pass]
The host step of full offload is bound by memory bandwidth. Folding the final
gradient into the FP32 sum when it arrives (10 bytes per parameter), taking the
norm of the sum (4) and stepping from it (30) moves 44 bytes; folding it inside
the step's pass (``HostKernel.adam_step(..., last_grad=...)``: the same bits as
the fold then the step) moves 32, for 2 bytes per parameter of host memory that
hold the final gradients until the step. That needs two things known in time:

* the final backward, before it ends: its non-final micro-steps were marked
  (``no_sync()``, FSDP2's or DDP's flag), so that its gradients can go to the held
  buffer instead of the slot ring (:func:`plan`, at its launch);
* that nothing needs the finished sums before ``step()``: clipping (``max_norm``,
  a loop's clip call), ``grad_norm``, a read of ``param.grad``, a gradient set by
  hand. ``max_norm`` is known at the launch; the others may come later, so the
  choice is made when the first of them comes (:func:`fold`: the ``norm`` task
  folds the held gradients, then takes the norm, as before) or at ``step()``
  (:func:`one_pass`). The gate ``path`` carries it to the lanes.

Without clipping the norm a one-pass step reports (``grad_norm`` after it) is
taken inside the pass, in double (``pipeoff_adam_step_norm``): a logged value,
not torch's bits of ``clip_grad_norm_``, and never a clip coefficient. Every
other case takes the fold then the step (:class:`HostStepPath` says which ran,
and why).

Two waits order the held buffer (see the ``Hazard:`` comments): a gradient is
recorded as held only after its copy into the buffer landed (the dependency of
``acc:{i}.{j}`` on ``d2h:{i}.{j}``, ``_graph.py``), and a final backward copies
into the buffer only after the previous step that read it is done (the gate
``held``, :meth:`HeldGrads.order_after_reader`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from pipeoff import _accel, _faults
from pipeoff.execution import Execution
from pipeoff.graph import TaskContext
from pipeoff.optim._full_offload import _accumulate, _fold_norm, _host_kernel
from pipeoff.optim._full_offload._config import FullOffloadConfig
from pipeoff.optim._full_offload._graph import DONE, HELD, PATH, pieces
from pipeoff.optim._tensors import host_alloc

if TYPE_CHECKING:
    from pipeoff.optim._full_offload._common import Accumulation
    from pipeoff.optim._full_offload._lanes import LaneResults
    from pipeoff.optim._full_offload._param import OffloadedParam

__all__ = ["FOLD", "ONE_PASS", "HeldGrads", "HeldWork", "HostStepPath", "fold", "one_pass",
           "plan"]

FOLD = "fold"
"""``path`` gate payload: the ``norm`` task folds the held gradients first."""
ONE_PASS = "one pass"
"""``path`` gate payload: each step chunk folds them inside its pass."""


@dataclasses.dataclass(frozen=True, slots=True)
class HostStepPath:
    """How a step's final micro-step reached its host step, and why."""

    one_pass: bool
    """The final gradients were folded inside the step's pass."""
    bytes_per_param: int | None
    """Host memory traffic of the final micro-step per parameter of the native step
    (``fused=True`` Adam/AdamW, BF16 weights and gradients; ``docs/host_step.md``,
    "Bytes per parameter"): 32 in one pass; 40 for the fold that takes torch's norm in
    its pass, then the step; 44 with the norm apart; 28 in one pass for a step of one
    backward (no sum to read). ``None`` without the native step."""
    why: str

    def __str__(self) -> str:
        how = "one pass" if self.one_pass else "fold then step"
        size = "" if self.bytes_per_param is None else f" ({self.bytes_per_param} B)"
        return f"{how}{size}: {self.why}"


ONE_PASS_PATH = HostStepPath(
    one_pass=True, bytes_per_param=32,
    why="final backward marked, no clipping, nothing read the gradients before step()")
"""The one-pass step."""
ONE_PASS_ALONE = HostStepPath(
    one_pass=True, bytes_per_param=28,
    why="the step's only backward, known final (no earlier sum to read), no clipping, "
        "nothing read the gradients before step()")
"""The one-pass step of a step of one backward (``gradient_accumulation_steps=1``)."""


def _fallback(why: str, *, native: bool = True, norm_in_fold: bool = True) -> HostStepPath:
    """The fold then the step: 40 bytes when the final fold takes torch's norm in its
    pass (``norm_in_fold``, if the kernel's norm matches torch's here), else 44."""
    fused = norm_in_fold and _fold_norm.norm_in_fold()
    return HostStepPath(one_pass=False, bytes_per_param=(40 if fused else 44) if native else None,
                        why=why)


NOT_MARKED = ("final backward not marked (mark the micro-steps before it with no_sync(), or "
              "give gradient_accumulation_steps: unmarked, only step() says a backward was "
              "the last)")
CLIPPING = "clipping (max_norm): every chunk needs the norm of the finished sums"
GPU_SUMS = "accumulate='gpu' folds the final gradient into the device sum"
DURING_BACKWARD = "overlap='backward' steps during the final backward"
OVER_RANKS = "the norm is all-reduced over ranks before the step"
DEVICE_PART = ("a device part (offload_fraction < 1): step() takes the norm over both "
               "parts, from the finished sums, first")
NO_BF16_ADAM = ("no parameter with a BF16 gradient in a fused=True Adam/AdamW group "
                "(the native step's domain)")


def plan(config: FullOffloadConfig, params: Sequence[OffloadedParam],
         groups: Sequence[Mapping[str, Any]], norm_groups: Sequence[tuple[Any, ...]], *,
         known: bool) -> tuple[frozenset[int], HostStepPath | None]:
    """At a final micro-step's launch: the parameters whose gradient it may hold for a
    one-pass step, or none and the fold then step's reason (``known``: the backward
    was known to be final when it began; ``groups``: the live param groups)."""
    cls = config.optimizer_class
    native = _host_kernel.host_kernel(warn=False) is not None and any(
        _host_kernel.adam_hyper(cls, g) is not None for g in groups)
    why = None
    if not known and config.gradient_accumulation_steps is not None:
        why = (f"fewer backwards than gradient_accumulation_steps="
               f"{config.gradient_accumulation_steps}: step() ended the step")
    elif not known:
        why = NOT_MARKED
    elif config.overlap == "backward":
        why = DURING_BACKWARD
    elif config.max_norm is not None:
        why = CLIPPING
    elif config.accumulate == "gpu":
        why = GPU_SUMS
    elif any(norm_groups):
        why = OVER_RANKS
    elif config.offload_fraction < 1.0:
        why = DEVICE_PART
    elif _host_kernel.host_kernel(warn=False) is None:
        why = f"the native step is off: {_host_kernel.unavailable_reason()}"
    if why is not None:
        # Unmarked, the last backward's folds took no norm: step() takes it apart.
        return frozenset(), _fallback(why, native=native, norm_in_fold=known)
    held = frozenset(i for i, rec in enumerate(params)
                     if rec.param.dtype == torch.bfloat16 and rec.numel
                     and _host_kernel.adam_hyper(cls, groups[rec.group]) is not None)
    return (held, None) if held else (held, _fallback(NO_BF16_ADAM, native=native))


def fold(acc: Accumulation, why: str) -> None:
    """Something needs the finished sums (or their norm) before ``step()``: the ``norm``
    task folds the held gradients first (a no-op if the path is chosen already, or
    nothing is held). On the caller's thread."""
    _choose(acc, FOLD, _fallback(f"{why} before step()"))


def one_pass(acc: Accumulation) -> None:
    """``step()``: nothing read the sums, the step chunks fold the held gradients."""
    _choose(acc, ONE_PASS, ONE_PASS_PATH if len(acc.micro) > 1 else ONE_PASS_ALONE)


def _choose(acc: Accumulation, payload: str, path: HostStepPath) -> None:
    fin = acc.final
    if fin is None or fin.lanes is None or fin.lanes.held is None or acc.path is not None:
        return
    assert fin.execution is not None
    acc.path = path
    fin.execution.gate(PATH).open(payload)


class HeldGrads:
    """The pinned host buffer that holds a final backward's BF16 gradients until its
    step, allocated once (again only if the held parameters change), and the last
    execution that read it.

    Written on the thread that launches a final micro-step (the backward's hooks);
    the lanes write the buffer's elements (``d2h:``), never its fields.
    """

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        """One BF16 tensor: every held parameter's gradient, 64-byte aligned."""
        self._layout: tuple[tuple[int, int], ...] = ()
        self._views: dict[int, torch.Tensor] = {}
        self.reader: Execution | None = None
        """The last final execution that held gradients (its norm task or its step
        chunks read them)."""

    @property
    def nbytes(self) -> int:
        """Bytes of host memory it holds (0 until a step first held gradients)."""
        return 0 if self.buffer is None else self.buffer.numel() * self.buffer.element_size()

    def views(self, params: Sequence[OffloadedParam], held: frozenset[int],
              pin: bool) -> dict[int, torch.Tensor]:
        """Per held parameter (by position), its flat BF16 slice of the buffer."""
        layout = tuple((id(params[i]), params[i].numel) for i in sorted(held))
        if layout != self._layout:
            offsets, total = {}, 0
            for i in sorted(held):
                offsets[i] = total
                total += -(-params[i].numel // 32) * 32  # 64-byte aligned slices
            self.buffer = host_alloc([(torch.Size((total,)), torch.bfloat16)], pin)[0]
            self._views = {i: self.buffer[o:o + params[i].numel] for i, o in offsets.items()}
            self._layout = layout
        return self._views

    def order_after_reader(self, ex: Execution) -> None:
        """``ex`` holds gradients: its copies into the buffer wait for the last reader."""
        prev = self.reader
        if prev is None or prev.done() or _faults.disabled("held_release"):
            ex.gate(HELD).close()
        else:
            # Hazard: the final backward's copies overwriting held gradients that
            # the previous step's norm task (its fold) or step chunks still read.
            ex.gate(HELD).open(None, event=prev.events_for(DONE)[0])
        self.reader = ex


class HeldWork:
    """The lane work of a final micro-step's held gradients (``[Note: one pass]``); what
    it computes goes into the accumulation's ``LaneResults`` (``held``, ``counts``,
    ``norms``, ``held_sumsq``), the gradients into the held buffer.

    Args:
        params: the parameters at launch.
        views: per held parameter, its slice of the held buffer.
        slot_bytes: the pieces a gradient ships in.
        threads: threads of each native kernel call.
    """

    def __init__(self, params: Sequence[OffloadedParam], views: Mapping[int, torch.Tensor],
                 slot_bytes: int, threads: int) -> None:
        self.params = params
        self.views = dict(views)
        self.slot_bytes = slot_bytes
        self.threads = threads

    def __contains__(self, i: int) -> bool:
        return i in self.views

    def copy(self, i: int, j: int, shipped: Any, ctx: TaskContext) -> None:
        """``d2h:{i}.{j}``: piece ``j`` of the gradient into its held slice."""
        rec = self.params[i]
        g = shipped.tensor
        assert g is not None
        s, e = pieces(rec.numel, shipped.dtype.itemsize, self.slot_bytes)[j]
        if e > s:
            # non_blocking: on the lane's stream; nothing reads the slice before the
            # acc task that waits for this copy (the dependency, _graph.py).
            self.views[i][s:e].copy_(g[s:e], non_blocking=True)
        if e == rec.numel or e == s:
            if ctx.stream is not None and not _faults.disabled("record_stream"):
                # Hazard: the caching allocator handing the gradient's memory to
                # the next allocation on the stream that made it while this
                # lane's copy still reads it.
                _accel.current().record_stream(g, ctx.stream)
            shipped.tensor = None  # the last piece is issued: free it on the device

    def arrived(self, res: LaneResults, i: int, last: bool, present: bool) -> None:
        """``acc:{i}.{j}`` of a held parameter (after its copy): a gradient in the buffer
        is recorded as held; without one, the sum of earlier micro-steps is final."""
        if not last:
            return
        if present:
            res.held.add(i)
        elif res.counts[i] > 0:
            res.norms[i] = _accumulate.norm(self.params[i].flat_acc)

    def fold_all(self, res: LaneResults) -> None:
        """The ``norm`` task under ``FOLD``: fold every held gradient into its sum and take
        its norm (in the same pass where it can, as the final fold does), so that what
        follows is the fold then step."""
        for i in sorted(res.held):
            self.fold_one(res, i)

    def fold_one(self, res: LaneResults, i: int) -> None:
        """Fold held gradient ``i`` into its sum, and take the sum's norm: it is no longer
        held."""
        rec = self.params[i]
        dst, src, first = rec.flat_acc, self.views[i], res.counts[i] == 0
        norm = _fold_norm.fold_norm(dst, src, first=first, threads=self.threads,
                                      lanes=_fold_norm.new_lanes(), offset=0,
                                      total=rec.numel, last=True)
        if not isinstance(norm, torch.Tensor):
            if not _host_kernel.fold(dst, src, first=first, threads=self.threads):
                _accumulate.fold(dst, src, first=first)
            norm = _accumulate.norm(dst)
        res.norms[i] = norm
        res.counts[i] += 1
        res.held.discard(i)

    def total_norm(self, res: LaneResults) -> None:
        """``norm_pass`` under ``ONE_PASS``: the norm from the squares the passes took (and
        the norms of the sums stepped without a held gradient): FP32, from double."""
        sq = math.fsum(res.held_sumsq.values())
        sq += math.fsum(float(n.double()) ** 2 for i, n in res.norms.items()
                        if i not in res.held_sumsq)
        res.total_norm = torch.tensor(math.sqrt(sq), dtype=torch.float32)
