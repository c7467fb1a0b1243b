"""The values of full offload's lifecycle: an accumulation, its micro-steps and what
a failure leaves, as FSDP2's ``_fsdp_common.py`` holds ``TrainingState``.

An :class:`Accumulation` is one optimizer step's gradients. Its phase:

* ``ACCUMULATING``: the first gradient of a step arrived; each backward
  (micro-step) launches an execution that folds its gradients into the host
  accumulators (``accumulate="gpu"``: non-final ones sum on the device).
* ``FINAL``: the final backward began (no ``no_sync()``, FSDP2 reducing), or
  ``step()`` launched a final micro-step without gradients. Its execution also
  steps the chunks: during the backward under ``overlap="backward"``, after
  ``step()`` opens its ``step`` gate otherwise.
* ``STEPPING``: handed to ``step()`` (``Lifecycle.hand_over``): in flight
  until ``wait_for_step()``; the next step's accumulation may begin meanwhile
  (its executions wait on a ``prev`` gate).
* ``DONE``: waited for, stepped or failed. ``DISCARDED``: ``zero_grad()`` or
  ``load_state_dict()`` dropped it.

``IDLE`` is the lifecycle's phase without an accumulation. Every change of phase
goes through :meth:`Accumulation.move`, which checks :data:`EDGES`.
"""

from __future__ import annotations

import dataclasses
import enum
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from pipeoff._compat import local_tensor as local
from pipeoff._compat import outermost_backward_frame
from pipeoff._contract import Health, StepWrites
from pipeoff._errors import GradientError, PipeoffError
from pipeoff.execution import Execution
from pipeoff.optim._full_offload._grads import is_placeholder
from pipeoff.optim._full_offload._graph import h2d_task, norm_task, step_task
from pipeoff.optim._full_offload._param import ParamRegistry
from pipeoff.optim._tensors import flat_like, snapshot

if TYPE_CHECKING:
    from pipeoff.optim._full_offload._lanes import LaneResults, LaneWork
    from pipeoff.optim._full_offload._one_pass import HostStepPath
    from pipeoff.optim._full_offload._param import OffloadedParam

__all__ = ["EDGES", "HYPER_CHANGED", "Accumulation", "MicroStep", "Phase", "Shipped",
           "after_final_message", "capture_hyper", "checked_gradient", "classify",
           "root_cause", "same_hyper", "twice_message", "unfinished_before",
           "unmarked_is_final", "writes_to"]


class Phase(enum.Enum):
    """Where an accumulation (and so the lifecycle) stands; see the module docstring."""

    IDLE = "idle"
    ACCUMULATING = "accumulating"
    FINAL = "final"
    STEPPING = "stepping"
    DONE = "done"
    DISCARDED = "discarded"

EDGES: dict[Phase, frozenset[Phase]] = {
    Phase.IDLE: frozenset({Phase.ACCUMULATING}),
    Phase.ACCUMULATING: frozenset({Phase.FINAL, Phase.DISCARDED}),
    Phase.FINAL: frozenset({Phase.STEPPING, Phase.DISCARDED}),
    Phase.STEPPING: frozenset({Phase.DONE}),
    Phase.DONE: frozenset(),
    Phase.DISCARDED: frozenset(),
}
"""The lifecycle's transition table: from each phase, the phases it may move to
(``IDLE`` is the lifecycle without an accumulation; a new one starts
``ACCUMULATING``). ``DONE`` and ``DISCARDED`` are the ends."""


class Shipped:
    """A gradient on its way to the host: the gate's payload. The copy drops the
    tensor once it is issued, so the device memory is free while the execution
    (which keeps its gates' payloads) lives on."""

    __slots__ = ("dtype", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.dtype = tensor.dtype


@dataclasses.dataclass(eq=False)
class MicroStep:
    """One backward (a micro-step) and the execution that takes its gradients in."""

    final: bool
    execution: Execution | None = None
    """``None`` for a non-final micro-step under ``accumulate="gpu"`` (it sums on the
    device)."""
    lanes: LaneWork | None = None
    """The work its execution runs (the registry as it was at launch)."""
    received: set[int] = dataclasses.field(default_factory=set)
    """Parameters whose gradient this backward shipped."""
    ended: bool = False
    began_in: tuple[int, Any] | None = None
    """The backward it began in (:func:`backward_mark`; see :func:`unfinished_before`),
    until it ends, is abandoned or discarded."""
    deferred: Any = None
    """The frame of the outermost backward, while the end callback of a reentrant
    (inner) backward has fired but the outer one still runs."""
    backward: bool = True
    """Whether a backward is its own (not a final micro-step with no backward, launched
    because the loop read the gradients or their norm before ``step()``)."""


@dataclasses.dataclass(eq=False)
class Accumulation:
    """One optimizer step's gradient accumulation: its micro-steps and their sums."""

    results: LaneResults
    """What its lanes computed (counts, norms, the chunks stepped): written on the
    lanes, read after the waits ``[Note: lane writes]`` names; the one caller-side
    writer is a gradient edit (``Lifecycle.edit_sums``: a replaced or dropped sum's
    count and norm), after it waited for the folds of the sums it edits. The
    total norm is not recomputed then: ``grad_norm`` is the norm the step's
    backward produced, and a clip by ``max_norm`` refuses a replaced sum."""
    phase: Phase = Phase.ACCUMULATING
    micro: list[MicroStep] = dataclasses.field(default_factory=list)
    final: MicroStep | None = None
    hyper: list[dict[str, Any]] | None = None
    """The groups' hyperparameters the chunks use (captured when the final
    backward began under ``overlap="backward"``, else by ``step()``)."""
    touched: set[int] = dataclasses.field(default_factory=set)
    """Parameters with a gradient in some micro-step (known on the caller's thread,
    unlike ``results.counts``, which the accumulate lane writes)."""
    device_sums: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    """``accumulate="gpu"``: FP32 sums of the non-final micro-steps, by parameter."""
    marked: bool = False
    """A micro-step of it was marked non-final (``no_sync()``, FSDP2's or DDP's
    gradient sync off): the user follows the protocol, so an unmarked backward is
    the final one. Otherwise, under ``overlap="forward"`` or ``"none"``, every
    backward accumulates and ``step()`` (or a read of the norm) ends it."""
    max_norm: float | None = None
    """The clipping norm of this step, set by ``clip_grad_norm_()`` (else the
    optimizer's ``max_norm``)."""
    path: HostStepPath | None = None
    """How its final micro-step reaches the host step: set at that micro-step's launch
    (the fold then step, and why), or, when it holds gradients, when the choice is
    made (``_one_pass.fold`` or ``one_pass``; ``None`` until then)."""

    def move(self, to: Phase) -> None:
        """The one place a phase changes, along :data:`EDGES`.

        Raises:
            PipeoffError: an edge the table does not have (a bug in pipeoff).
        """
        if to not in EDGES[self.phase]:
            raise PipeoffError(f"pipeoff bug: an accumulation moved from {self.phase.name} "
                               f"to {to.name}, which the lifecycle's table does not allow")
        self.phase = to

    @property
    def execution(self) -> Execution:
        """The final micro-step's execution (the one that steps)."""
        assert self.final is not None and self.final.execution is not None
        return self.final.execution

    def writes(self, device: torch.device) -> StepWrites:
        """What its step writes, for the forward waits: per chunk, the weights its
        ``h2d:{k}`` copies (of the parameters it has gradients for)."""
        fin = self.final
        assert fin is not None and fin.lanes is not None
        plan = fin.lanes.plan
        return StepWrites(
            execution=self.execution, params=tuple(rec.param for rec in fin.lanes.params),
            write_tasks=tuple(h2d_task(k) for k in range(len(plan.chunks))),
            chunks_of=plan.chunks_of(), device=device, written=tuple(sorted(self.touched)),
            grad_of=lambda i: None)

    def weights_copied(self) -> set[int]:
        """The ``id()`` of each parameter whose weight the final execution's ``h2d`` copy
        has written (its version recorded)."""
        fin = self.final
        if fin is None or fin.execution is None or fin.lanes is None:
            return set()
        ex = fin.execution
        out: set[int] = set()
        for k, chunk in enumerate(fin.lanes.plan.chunks):
            if ex.events_for(h2d_task(k))[0].status == "ok":
                out.update(id(fin.lanes.params[i].param) for i in chunk)
        return out

    def edit_device_sums(self, replaced: Mapping[int, torch.Tensor],
                         dropped: Sequence[int]) -> None:
        """Under ``accumulate="gpu"``, before the final micro-step: gradients the loop put
        in ``param.grad`` by hand (``replaced``) or set to ``None`` (``dropped``)."""
        for i, t in replaced.items():
            self.device_sums[i] = t.to(torch.float32, copy=True)
            self.touched.add(i)
        for i in dropped:
            self.device_sums.pop(i, None)
            self.touched.discard(i)

    def wait_norm(self, timeout: float) -> torch.Tensor | None:
        """The total gradient norm, once the final execution has computed it."""
        ex = self.execution
        one_pass = self.path is not None and self.path.one_pass
        ex.wait(norm_task(ex.plan.order, one_pass=one_pass), timeout=timeout)
        return self.results.total_norm

    def failed(self) -> bool:
        """Whether an execution of its micro-steps has failed already."""
        return any(ms.execution is not None and ms.execution.done()
                   and ms.execution.exception is not None for ms in self.micro)



def capture_hyper(param_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The groups' hyperparameters, copied so that later edits cannot change a step."""
    return [{k: snapshot(v) for k, v in g.items() if k != "params"} for g in param_groups]


def same_hyper(a: Any, b: Any) -> bool:
    """Whether two captures of hyperparameters are equal (tensors bit for bit)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.shape == b.shape and bool(torch.equal(a, b)))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_hyper(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_hyper(a[k], b[k]) for k in a)
    return bool(a == b)


def root_cause(acc: Accumulation, err: BaseException) -> BaseException:
    """The failure of the earliest micro-step of ``acc`` that failed (a later one
    fails only because it waited on it), or ``err``."""
    for ms in acc.micro:
        ex = ms.execution
        if ex is not None and ex.done() and ex.exception is not None:
            return ex.exception
    return err


def classify(health: Health, acc: Accumulation, err: BaseException, *,
             device_part: bool = False) -> None:
    """Set what a failed final execution leaves, and say so on ``err``: nothing stepped
    (dirty: ``zero_grad()`` clears it), every chunk stepped but a weight copy failed
    (stale: ``refresh_device_weights()``; torn with a ``device_part``, which steps at
    ``step()`` and may not have), or some chunks (or some masters of one) stepped
    (torn: load a checkpoint). A chunk counts as stepped once its optimizer step
    returned, even if its task failed afterwards (in the cast)."""
    ex = acc.execution
    fin = acc.final
    assert fin is not None and fin.lanes is not None
    health.torn_cause = err  # for each refusal's __cause__ (unused unless torn below)
    nchunks = len(fin.lanes.plan.chunks)
    res = acc.results
    stepped = sorted({k for k in range(nchunks)
                      if ex.events_for(step_task(k))[0].status == "ok"} | res.stepped_chunks)
    if stepped and ex.exception is None:
        # The execution ran to the end, but this step failed elsewhere (a
        # gradient refused during the final backward): chunks stepped on it.
        which = ("every chunk" if len(stepped) == nchunks else f"chunk(s) {stepped}")
        health.torn = (f"this step failed ({err}) after {which} had stepped their "
                       "masters during the backward")
        return
    if res.torn_chunks:
        health.torn = (f"a step failed in {ex.failed_task!r} while chunk(s) "
                       f"{sorted(res.torn_chunks)} stepped their masters (chunk(s) {stepped} "
                       "had stepped theirs)")
        err.add_note(f"pipeoff: {health.torn}; later steps are refused until a "
                     "checkpoint is loaded")
    elif not stepped:
        health.dirty = err
        err.add_note("pipeoff: no master was stepped; step() refuses until "
                     "opt.zero_grad()")
    elif len(stepped) == nchunks and not device_part:
        health.stale = err
        err.add_note("pipeoff: every master was stepped, but device weights were "
                     "not all written; call opt.refresh_device_weights()")
    else:
        health.torn = (f"a step failed in {ex.failed_task!r} after chunk(s) "
                       f"{stepped} had stepped their masters" + (
                           "; the device part (offload_fraction < 1) had not, or may have"
                           if len(stepped) == nchunks else ""))
        err.add_note(f"pipeoff: {health.torn}; later steps are refused until a "
                     "checkpoint is loaded")



def backward_mark() -> tuple[int, Any] | None:
    """This thread and the frame of its outermost backward (``None`` outside a backward,
    or where the gradient's hook runs off the thread that called ``backward()``). The
    frame itself, not its id (a dead frame's id is soon another's): whoever keeps a mark
    drops it when the micro-step ends, is abandoned or discarded, or a raised backward's
    graph and activations would stay alive."""
    frame = outermost_backward_frame()
    return None if frame is None else (threading.get_ident(), frame)


def unfinished_before(began_in: tuple[int, Any] | None) -> bool:
    """Whether a gradient arriving now comes from another backward than the one marked
    ``began_in`` (:func:`backward_mark`) on this same thread, which then never ended (it
    raised, or was interrupted: its end callback never ran). A reentrant checkpoint's
    inner backward shares its outer one's outermost frame. ``False`` where unknown: on
    another thread (backwards may run at once on two), or off the calling thread."""
    now = backward_mark()
    return began_in is not None and now is not None and now[0] == began_in[0] \
        and now[1] is not began_in[1]


def twice_message(name: str, began_in: tuple[int, Any] | None = None) -> str:
    """Why a second gradient for parameter ``name`` in one backward is refused (or a
    gradient of a backward after one that never ended: ``began_in``, see
    :func:`unfinished_before`)."""
    if unfinished_before(began_in):
        return (f"a gradient for {name!r} from a new backward, while the previous backward "
                "never finished (it raised, or was interrupted, after some of its gradients "
                "came: they are partial). Call the optimizer's zero_grad() before the next "
                "backward (the model's zero_grad() does not reach the gradients it took); "
                "FullOffloadOptimizer does not add a backward to a partial one")
    return (f"a second gradient for {name!r} in one backward: it is used both inside and "
            "outside a reentrant checkpoint (torch.utils.checkpoint with use_reentrant=True "
            "runs a backward of its own), or its hook ran twice. FullOffloadOptimizer takes "
            "one gradient per parameter per backward; use use_reentrant=False (torch's "
            "recommended setting)")


def unmarked_is_final(overlap: str, steps: int | None, acc: Accumulation | None) -> bool:
    """Whether a backward not marked non-final that begins now is the step's final one:
    the ``steps``-th of the step (``gradient_accumulation_steps``), or, without that
    count, any under ``overlap="backward"``, and under ``"forward"`` or ``"none"`` one
    after a marked micro-step of the step."""
    if steps is not None:
        return (0 if acc is None else len(acc.micro)) + 1 >= steps
    return overlap == "backward" or (acc is not None and acc.marked)


def after_final_message(overlap: str, steps: int | None = None,
                        final: MicroStep | None = None) -> str:
    """Why a backward after the final micro-step ``final`` of a step is refused."""
    if final is not None and not final.backward:  # (a read of the gradients launched it)
        return ("a backward after the loop read this step's gradients, before step(): "
                "grad_norm, clip_grad_norm_(), or a read or in-place edit of a param.grad "
                "ended the accumulation (the sums it saw are the step's); read or edit "
                "the gradients after the final backward, then call opt.step() and "
                "opt.zero_grad()")
    if steps is not None:
        return (f"a backward after the final micro-step of this step, before step(): "
                f"gradient_accumulation_steps={steps} made backward {steps} since the "
                "last step() the final one; call opt.step() and opt.zero_grad() after "
                f"{steps} backwards, or pass the count every step has "
                "(gradient_accumulation_steps=None: the micro-steps are marked with "
                "opt.no_sync())")
    if overlap == "backward":
        return ("a backward after the final micro-step of this step, before step(): under "
                "overlap='backward' a backward outside opt.no_sync() steps the chunks "
                "while it runs, so it must be the last one; wrap the non-final "
                "micro-steps in opt.no_sync() (or the wrapper's no_sync()), or use "
                "overlap='forward', under which gradients accumulate until step()")
    return ("a backward after the final micro-step of this step, before step(): the "
            "micro-steps before it were marked non-final (no_sync()), or grad_norm / "
            "clip_grad_norm_() ended the accumulation; call opt.step() and "
            "opt.zero_grad() between steps")


HYPER_CHANGED = (
    "param_groups changed after the final backward began: under overlap='backward' the "
    "chunks step during that backward with the hyperparameters of that moment (this step "
    "used those); change hyperparameters (an LR scheduler's step()) after opt.step()")
"""Why a step under ``overlap="backward"`` refuses hyperparameters edited late."""

CLIPPED_TWICE = (
    "clip_grad_norm_() was called twice in one step: the clipping happens in the step, once "
    "(torch would clip the clipped gradients again); call it once between the last backward "
    "and step()")
"""Why a second ``clip_grad_norm_()`` in one step is refused."""


def checked_gradient(rec: OffloadedParam, grad: torch.Tensor) -> torch.Tensor:
    """``grad`` flat in ``rec``'s memory order.

    Raises:
        GradientError: not a dense gradient of the parameter's dtype and device, or a
            placeholder of an earlier step put back by hand.
    """
    p = rec.param
    loc = local(grad)
    if is_placeholder(loc):
        raise GradientError(
            f"param.grad of {rec.name!r} holds a FullOffloadOptimizer gradient placeholder "
            "of an earlier step (kept and put back by hand); gradients come from "
            "loss.backward()")
    if grad.dtype != p.dtype or loc.device != local(p).device or loc.layout != torch.strided:
        raise GradientError(
            f"the gradient of {rec.name!r} is {grad.dtype} on {loc.device} ({loc.layout}); "
            f"FullOffloadOptimizer takes dense gradients of the parameter's dtype "
            f"{p.dtype} on {local(p).device}")
    return flat_like(loc, rec.order)


def writes_to(acc: Accumulation | None, registry: ParamRegistry,
              param: torch.Tensor) -> tuple[Execution | None, list[str]]:
    """The execution of the step in flight ``acc`` and its tasks that write ``param``'s
    master, moments and weight (by the step's own parameters and chunks:
    ``param_groups`` may have been edited since); ``(None, [])`` without one.

    Raises:
        ConfigError: ``param`` is not one of the optimizer's parameters.
    """
    lanes = acc.final.lanes if acc is not None and acc.final is not None else None
    i = lanes.position_of(param) if lanes is not None else None
    if acc is None or i is None:
        registry.index_of(param)  # raises for a stranger
        return None, []  # (or added to param_groups since: the step does not write it)
    assert lanes is not None
    return acc.execution, [n for k, chunk in enumerate(lanes.plan.chunks) if i in chunk
                           for n in (step_task(k), h2d_task(k))]
