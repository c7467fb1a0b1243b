"""The micro-step lifecycle of full offload: gradients in from autograd's hooks, one
execution per backward, and the transitions ``step()`` and ``zero_grad()`` drive.

An :class:`Accumulation` is one optimizer step's gradients. Its phase:

* ``ACCUMULATING``: the first gradient of a step arrived; each backward
  (micro-step) launches an execution that folds its gradients into the host
  accumulators (``accumulate="gpu"``: non-final ones sum on the device).
* ``FINAL``: the final backward began (no ``no_sync()``, FSDP2 reducing), or
  ``step()`` launched a final micro-step without gradients. Its execution also
  steps the chunks: during the backward under ``overlap="backward"``, after
  ``step()`` opens its ``step`` gate otherwise.
* ``STEPPING``: handed to ``step()`` (:meth:`MicroSteps.hand_over`): in flight
  until ``wait_for_step()``; the next step's accumulation may begin meanwhile
  (its executions wait on a ``prev`` gate).
* ``DONE``: waited for, stepped or failed. ``DISCARDED``: ``zero_grad()`` or
  ``load_state_dict()`` dropped it.

:class:`MicroSteps` holds the accumulation in progress (its phase is the
lifecycle's, ``IDLE`` without one) and the hooks. Its state is written on the
thread that runs the backward's hooks (the caller's on CPU; autograd's device
thread on CUDA, while the caller is inside ``backward()``) and on the caller's
thread between backwards; the lanes write only what ``[Note: lane writes]`` in
``_lanes.py`` lists.
"""

from __future__ import annotations

import dataclasses
import enum
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from pipeoff import _compat, _faults
from pipeoff._contract import Health, StepWrites
from pipeoff._errors import GradientError
from pipeoff._lowlevel import settle
from pipeoff.execution import Execution
from pipeoff.executor import execute
from pipeoff.graph import TaskGraph
from pipeoff.optim._full_offload._config import FullOffloadConfig
from pipeoff.optim._full_offload._grads import LoopGrads, is_placeholder
from pipeoff.optim._full_offload._lanes import LaneWork, gate_name
from pipeoff.optim._full_offload._param import ParamRegistry
from pipeoff.optim._tensors import flat_like, local, snapshot
from pipeoff.schedule import Schedule

if TYPE_CHECKING:
    from pipeoff.optim._readers import Readers

__all__ = ["Accumulation", "MicroStep", "MicroSteps", "Phase", "Shipped", "capture_hyper",
           "classify", "root_cause", "same_hyper", "writes_to"]


class Phase(enum.Enum):
    """Where an accumulation (and so the lifecycle) stands; see the module docstring."""

    IDLE = "idle"
    ACCUMULATING = "accumulating"
    FINAL = "final"
    STEPPING = "stepping"
    DONE = "done"
    DISCARDED = "discarded"


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
    deferred: Any = None
    """The frame of the outermost backward, while the end callback of a reentrant
    (inner) backward has fired but the outer one still runs."""


@dataclasses.dataclass(eq=False)
class Accumulation:
    """One optimizer step's gradient accumulation: its micro-steps and their sums."""

    counts: list[int]
    """Per parameter, the contributions folded into its host accumulator (lanes)."""
    phase: Phase = Phase.ACCUMULATING
    micro: list[MicroStep] = dataclasses.field(default_factory=list)
    final: MicroStep | None = None
    hyper: list[dict[str, Any]] | None = None
    """The groups' hyperparameters the chunks use (captured when the final
    backward began under ``overlap="backward"``, else by ``step()``)."""
    touched: set[int] = dataclasses.field(default_factory=set)
    """Parameters with a gradient in some micro-step (known on the caller's thread,
    unlike ``counts``, which the accumulate lane writes)."""
    device_sums: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    """``accumulate="gpu"``: FP32 sums of the non-final micro-steps, by parameter."""
    norms: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    partial_norms: dict[tuple[Any, ...], torch.Tensor] = dataclasses.field(
        default_factory=dict)
    """Per set of process groups, the 2-norm of the gradients of the parameters sharded
    over them (``norm``), before ``norm_allreduce``."""
    total_norm: torch.Tensor | None = None
    marked: bool = False
    """A micro-step of it was marked non-final (``no_sync()``, FSDP2's or DDP's
    gradient sync off): the user follows the protocol, so an unmarked backward is
    the final one. Otherwise, under ``overlap="forward"`` or ``"none"``, every
    backward accumulates and ``step()`` (or a read of the norm) ends it."""
    max_norm: float | None = None
    """The clipping norm of this step, set by ``clip_grad_norm_()`` (else the
    optimizer's ``max_norm``)."""
    stepped_chunks: set[int] = dataclasses.field(default_factory=set)
    """Chunks whose masters were all stepped (the host_step lane)."""
    torn_chunks: set[int] = dataclasses.field(default_factory=set)
    """Chunks whose step raised after writing some of their masters (the lane)."""
    overwritten: set[int] = dataclasses.field(default_factory=set)
    """Parameters whose weight something else wrote after the last step and before
    this step's ``h2d`` overwrote it (the lane; read after the execution settled)."""

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
            write_tasks=tuple(f"h2d:{k}" for k in range(len(plan.chunks))),
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
            if ex.events_for(f"h2d:{k}")[0].status == "ok":
                out.update(id(fin.lanes.params[i].param) for i in chunk)
        return out

    def wait_norm(self, timeout: float) -> torch.Tensor | None:
        """The total gradient norm, once the final execution has computed it."""
        ex = self.execution
        ex.wait("norm_allreduce" if "norm_allreduce" in ex.plan.order else "norm",
                timeout=timeout)
        return self.total_norm

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


def classify(health: Health, acc: Accumulation, err: BaseException) -> None:
    """Set what a failed final execution leaves, and say so on ``err``: nothing stepped
    (dirty: ``zero_grad()`` clears it), every chunk stepped but a weight copy failed
    (stale: ``refresh_device_weights()``), or some chunks (or some masters of one)
    stepped (torn: load a checkpoint). A chunk counts as stepped once its optimizer
    step returned, even if its task failed afterwards (in the cast)."""
    ex = acc.execution
    fin = acc.final
    assert fin is not None and fin.lanes is not None
    health.torn_cause = err  # for each refusal's __cause__ (unused unless torn below)
    nchunks = len(fin.lanes.plan.chunks)
    stepped = sorted({k for k in range(nchunks)
                      if ex.events_for(f"step:{k}")[0].status == "ok"} | acc.stepped_chunks)
    if stepped and ex.exception is None:
        # The execution ran to the end, but this step failed elsewhere (a
        # gradient refused during the final backward): chunks stepped on it.
        health.torn = (f"this step failed ({err}) after chunk(s) {stepped} had "
                       "stepped their masters during the backward")
        return
    if acc.torn_chunks:
        health.torn = (f"a step failed in {ex.failed_task!r} while chunk(s) "
                       f"{sorted(acc.torn_chunks)} stepped their masters (chunk(s) {stepped} "
                       "had stepped theirs)")
        err.add_note(f"pipeoff: {health.torn}; later steps are refused until a "
                     "checkpoint is loaded")
    elif not stepped:
        health.dirty = err
        err.add_note("pipeoff: no master was stepped; step() refuses until "
                     "opt.zero_grad()")
    elif len(stepped) == nchunks:
        health.stale = err
        err.add_note("pipeoff: every master was stepped, but device weights were "
                     "not all written; call opt.refresh_device_weights()")
    else:
        health.torn = (f"a step failed in {ex.failed_task!r} after chunk(s) "
                       f"{stepped} had stepped their masters")
        err.add_note(f"pipeoff: {health.torn}; later steps are refused until a "
                     "checkpoint is loaded")


_OWNERS: Any = WeakIdKeyDictionary()  # (torch's: keyed by identity, not tensor equality)
"""Per parameter, the lifecycle (of the newest optimizer over it) that takes its
gradients: an optimizer built to resume from another's ``state_dict()`` on the
same model takes them over, and the old one's hooks let them be."""


class _GradHook:
    """A parameter's post-accumulate-grad hook: :meth:`MicroSteps.on_grad` while the
    optimizer lives. It holds it weakly, so that a deleted optimizer lets go of the
    model's gradients (its hooks are removed when it is collected)."""

    def __init__(self, micro_steps: MicroSteps) -> None:
        self.ref = weakref.ref(micro_steps)

    def __call__(self, p: torch.Tensor) -> None:
        micro_steps = self.ref()
        if micro_steps is not None:
            micro_steps.on_grad(p)


def _remove_hooks(handles: dict[int, Any], probe: list[Any]) -> None:
    for handle in list(handles.values()) + probe:
        handle.remove()
    handles.clear()


class _WrapperProbe:
    """The model's forward pre-hook that notices a DDP wrapper (:meth:`MicroSteps.see_wrapper`).
    A copy of the model (``copy.deepcopy``, an EMA) shares it instead of copying the
    optimizer; the copy's forward is no business of it (the wrapper is checked to
    wrap the very module)."""

    def __init__(self, micro_steps: MicroSteps) -> None:
        self.ref = weakref.ref(micro_steps)

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        _opaque_probe()(self, module)

    def __deepcopy__(self, memo: dict[int, Any]) -> _WrapperProbe:
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled (torch.save(model)): the copy belongs to no optimizer.
        return (_inert_probe, ())


def _probe(probe: _WrapperProbe, module: torch.nn.Module) -> None:
    micro_steps = probe.ref()
    if micro_steps is None or micro_steps.registry.model is not module:
        return
    micro_steps.see_wrapper(module)
    if torch.is_grad_enabled() and micro_steps.grads.showing:
        # The next micro-step's forward: the placeholders leave .grad before autograd
        # (or a DDP reducer) would accumulate into them.
        micro_steps.grads.withdraw(stepping=False)


_OPAQUE_PROBE: Any = None


def _opaque_probe() -> Any:
    # Opaque to Dynamo: under torch.compile it runs eagerly at every forward.
    global _OPAQUE_PROBE
    if _OPAQUE_PROBE is None:
        _OPAQUE_PROBE = _compat.dynamo_disable(_probe)
    return _OPAQUE_PROBE


class _InertProbe:
    """What a pickled probe becomes: a forward pre-hook that does nothing."""

    def __call__(self, *args: Any) -> None:
        return None


def _inert_probe() -> _InertProbe:
    return _InertProbe()


class MicroSteps:
    """The micro-step lifecycle: the post-accumulate-grad hooks, one execution per
    backward, the end of each backward, and the transitions of the accumulation.

    Args:
        registry: the parameters.
        config: the optimizer's configuration.
        health: what failed steps left (shared with the optimizer).
        readers: transfers reading the host state: a final micro-step waits for them.
        param_groups: the optimizer's live ``param_groups`` (read for hyperparameters).
        on_first_gradient: called by the first gradient of a step, before it is taken
            in (the optimizer follows the model and ``param_groups`` there).
    """

    def __init__(self, registry: ParamRegistry, config: FullOffloadConfig, health: Health,
                 readers: Readers, param_groups: Callable[[], list[dict[str, Any]]],
                 on_first_gradient: Callable[[], None]) -> None:
        self.registry = registry
        self.config = config
        self.health = health
        self.readers = readers
        self.param_groups = param_groups
        self.on_first_gradient = on_first_gradient
        # hook state: the thread running the backward's hooks, or the caller's
        self.acc: Accumulation | None = None
        """The accumulation in progress (``None``: ``IDLE``)."""
        self.micro: MicroStep | None = None
        """The micro-step whose backward is running (or whose end is deferred)."""
        self.no_sync_depth = 0
        self.grads = LoopGrads(self, config.overlap)
        """The placeholders the loop sees in ``param.grad`` (the host sums, see
        ``_grads.py``): in from the end of each backward, out at the next forward."""
        self.ddp: Any = (None if registry.model is None else
                         _compat.data_parallel(registry.model))
        """The ``DistributedDataParallel`` around the model, or ``None``. Under one, the
        gradients stay in ``param.grad`` (the wrapper reduces and accumulates them
        there) and a final micro-step takes them at the end of its backward."""
        self._wrapper_probe: Any = None
        self.grad_hooks: dict[int, Any] = {}
        self._probe_handles: list[Any] = []
        weakref.finalize(self, _remove_hooks, self.grad_hooks, self._probe_handles)
        """The post-accumulate-grad hook of each of the model's parameters, by ``id()``."""
        # ordering between executions
        self.prev: Execution | None = None
        """The latest execution that writes accumulators or masters: the next
        micro-step's accumulations wait for it (its ``prev`` gate)."""

    @property
    def phase(self) -> Phase:
        return Phase.IDLE if self.acc is None else self.acc.phase

    # -- the graph -----------------------------------------------------------------------
    def graph(self, *, final: bool, grad_itemsize: Mapping[int, int] | None = None,
              lanes: LaneWork | None = None, acc: Accumulation | None = None,
              ms: MicroStep | None = None) -> tuple[TaskGraph, Schedule]:
        """The graph and schedule of a micro-step (shape-only without ``lanes``)."""
        config = self.config
        plan = self.registry.plan if lanes is None else lanes.plan
        work = None
        if lanes is not None:
            assert acc is not None and ms is not None
            work = lanes.bind(acc, ms)
        groups = self.registry.norm_groups if lanes is None else lanes.norm_groups
        graph = plan.graph(self.registry.device, final=final,
                           norm_first=config.overlap != "backward",
                           allreduce=any(groups), step_gate=config.overlap != "backward",
                           grad_itemsize=grad_itemsize, work=work)
        return graph, plan.schedule(config.overlap)

    # -- hooks -----------------------------------------------------------------------------
    def ensure_hooks(self) -> None:
        """A post-accumulate-grad hook on every parameter of the model, once.

        Hooks stay: a parameter removed from ``param_groups`` is ignored by its
        hook (its gradient stays in ``.grad``, as with torch), and one added back,
        or unfrozen, is taken in at once. (A hook registered for the first time
        during a backward does not fire in it: in-place edits are noticed at the
        first gradient of the next backward.) A frozen parameter gets its hook
        with ``requires_grad`` switched on for the call.
        """
        model = self.registry.model
        if self._wrapper_probe is None and model is not None:
            self._wrapper_probe = model.register_forward_pre_hook(_WrapperProbe(self))
            self._probe_handles.append(self._wrapper_probe)
            if self.ddp is None:
                self.ddp = _compat.data_parallel(model)
        taken = []
        for rec in self.registry:
            before = _OWNERS.get(rec.param)
            owner = before() if before is not None else None
            if owner is not None and owner is not self:
                taken.append(rec.name)
            _OWNERS[rec.param] = weakref.ref(self)
        if taken:
            warnings.warn(
                f"FullOffloadOptimizer: parameter(s) {taken[:4]}{'...' if len(taken) > 4 else ''} "
                "belonged to another FullOffloadOptimizer, which no longer receives their "
                "gradients (the newest optimizer of a parameter takes them; load the old "
                "one's state_dict() into this one to resume)", RuntimeWarning, stacklevel=4)
        for p in (model.parameters() if model is not None else self.registry.tensors()):
            if id(p) in self.grad_hooks:
                continue
            frozen = not p.requires_grad
            if frozen:
                p.requires_grad_(True)
            try:
                self.grad_hooks[id(p)] = p.register_post_accumulate_grad_hook(_GradHook(self))
            finally:
                if frozen:
                    p.requires_grad_(False)

    def see_wrapper(self, module: torch.nn.Module) -> None:
        """The model's forward begins: a ``DistributedDataParallel`` put around the model
        after the optimizer was built (as ``accelerate.prepare`` does) may run it."""
        if self.ddp is None:
            ddp = _compat.active_data_parallel()
            if ddp is not None and any(q is module for q in ddp.modules()):
                if self.acc is not None:
                    raise GradientError(
                        "the model was wrapped in DistributedDataParallel in the middle of "
                        "gradient accumulation: wrap it before the first backward, or "
                        "after step()")
                self.ddp = ddp

    def _explicitly_non_final(self) -> bool:
        """Whether this backward is marked non-final: ``no_sync()``, or the wrapper does
        not reduce gradients in it (FSDP2's ``set_requires_gradient_sync(False)``,
        DDP's ``no_sync()``)."""
        if self.no_sync_depth > 0:
            return True
        model = self.registry.model
        if model is not None and _compat.fsdp_gradient_sync(
                _compat.compiled_original(model)) is False:
            return True
        return self.ddp is not None and not _compat.ddp_gradient_sync(self.ddp)

    def on_grad(self, p: torch.Tensor) -> None:
        """The post-accumulate-grad hook of every parameter: ship the gradient (under
        DDP, leave it to the wrapper: the end of the backward takes it)."""
        owner = _OWNERS.get(p)
        if owner is None or owner() is not self:
            return  # another (newer) optimizer's parameter, or none's
        if self.grads.showing:
            # A backward whose forward this optimizer did not see (a submodule called
            # alone): the placeholders leave .grad now; what autograd added into this
            # one is its gradient.
            self.grads.withdraw(stepping=False)
        if self.acc is None and self.micro is None:
            self.on_first_gradient()  # the first gradient of a step
        i = self.registry.position(p)
        if i is None:
            return
        name = self.registry[i].name
        bwd = _compat.backward_id()
        grad = p.grad
        if grad is None:
            return
        if bwd < 0:
            raise GradientError(
                f"a gradient for {name!r} reached FullOffloadOptimizer outside a backward "
                "(a post-accumulate-grad hook called by hand?): gradients are taken in "
                "only from loss.backward()")
        if self.ddp is not None:
            ms = self.micro
            if ms is None or ms.ended:
                ms = self._begin()
            ms.received.add(i)
            return
        try:
            payload = self._checked(self.registry[i], grad)
        except GradientError as err:
            self.fail_current(err)
            raise
        if self.health.dirty is not None or self.health.torn is not None:
            p.grad = None  # dropped: step() refuses until zero_grad()
            return
        ms = self.micro
        if ms is not None and ms.deferred is not None:
            if _compat.outermost_backward_frame() is ms.deferred:
                # Still the backward whose inner (reentrant) part ended: end the
                # micro-step when this, its outer graph task, ends.
                ms.deferred = None
                outer = ms
                _compat.queue_backward_callback(lambda: self.end_backward(outer))
            else:
                self.end_backward(ms, force=True)  # that backward is over
                ms = self.micro
        # A backward inside a backward (a reentrant checkpoint's recomputation)
        # has a graph task of its own; its gradients belong to the outer one.
        if ms is None or ms.ended:
            ms = self._begin()
        if i in ms.received:
            twice = GradientError(
                f"a second gradient for {name!r} in one backward: it is used both inside "
                "and outside a reentrant checkpoint (torch.utils.checkpoint with "
                "use_reentrant=True runs a backward of its own), or its hook ran twice. "
                "FullOffloadOptimizer takes one gradient per parameter per backward; use "
                "use_reentrant=False (torch's recommended setting)")
            self.fail_current(twice)
            raise twice
        ms.received.add(i)
        p.grad = None
        acc = self.acc
        assert acc is not None
        acc.touched.add(i)
        if self.config.accumulate == "gpu":
            sums = acc.device_sums
            if not ms.final:
                s = sums.get(i)
                if s is None:
                    sums[i] = payload.to(torch.float32, copy=True)  # the first: a copy
                else:
                    s.add_(payload)
                return
            s = sums.pop(i, None)
            if s is not None:
                s.add_(payload)
                payload = s
        assert ms.execution is not None
        ms.execution.gate(gate_name(self.registry[i])).open(Shipped(payload))

    def _begin(self) -> MicroStep:
        """The first gradient of a backward: launch its execution."""
        acc = self.acc
        if acc is None:
            acc = self.acc = Accumulation(counts=[0] * len(self.registry))
        marked = self._explicitly_non_final()
        final = not marked and (self.config.overlap == "backward" or acc.marked)
        if acc.final is not None:
            err = GradientError(self._after_final_message())
            self.health.dirty = err
            raise err
        ms = MicroStep(final=final)
        if final:
            self._before_final(acc)
        if final or (self.config.accumulate == "cpu" and self.ddp is None):
            ms.execution = self._launch(acc, ms)
        acc.marked = acc.marked or marked
        # Launched: only now does the accumulation hold the micro-step (an interrupt
        # or a failure above leaves it as it was).
        if final:
            acc.final = ms
            acc.phase = Phase.FINAL
        acc.micro.append(ms)
        self.micro = ms
        _compat.queue_backward_callback(lambda: self.end_backward(ms))
        return ms

    def _after_final_message(self) -> str:
        if self.config.overlap == "backward":
            return ("a backward after the final micro-step of this step, before step(): under "
                    "overlap='backward' a backward outside opt.no_sync() steps the chunks "
                    "while it runs, so it must be the last one; wrap the non-final "
                    "micro-steps in opt.no_sync() (or the wrapper's no_sync()), or use "
                    "overlap='forward', under which gradients accumulate until step()")
        return ("a backward after the final micro-step of this step, before step(): the "
                "micro-steps before it were marked non-final (no_sync()), or grad_norm / "
                "clip_grad_norm_() ended the accumulation; call opt.step() and "
                "opt.zero_grad() between steps")

    def _before_final(self, acc: Accumulation) -> None:
        """What a final micro-step needs before its launch: the transfers reading the
        host state done, and under ``overlap="backward"`` the hyperparameters."""
        # Hazard: the final micro-step's graph steps the masters and moments
        # (under overlap="backward" during this backward) while a transfer
        # launched after the previous step still reads them.
        self.readers.wait()
        if self.config.overlap == "backward":
            acc.hyper = capture_hyper(self.param_groups())

    def _launch(self, acc: Accumulation, ms: MicroStep) -> Execution:
        itemsize = None
        if ms.final and self.config.accumulate == "gpu":
            itemsize = {i: 4 for i in acc.device_sums}
        ms.lanes = LaneWork(self.registry, self.config)
        graph, schedule = self.graph(final=ms.final, grad_itemsize=itemsize, lanes=ms.lanes,
                                     acc=acc, ms=ms)
        ex = execute(graph, schedule)
        prev = self.prev
        try:
            if prev is None or prev.done() or _faults.disabled("micro_step_order"):
                ex.gate("prev").close()
            else:
                # Hazard: folding into accumulators (or stepping masters) that the
                # previous micro-step's execution, or a step still in flight, is
                # still reading or writing.
                ex.gate("prev").open(None, event=prev.events_for("done")[0])
        except BaseException as err:
            # The previous execution failed meanwhile: this one must not wait on
            # gates nobody will open.
            for name in graph.gates:
                if ex.gate(name).state == "pending":
                    ex.gate(name).fail(err)
            raise
        self.prev = ex
        return ex

    # -- the end of a backward ---------------------------------------------------------------
    def end_backward(self, ms: MicroStep, *, force: bool = False) -> None:
        """Autograd's end-of-backward callback: settle the gates no gradient opened.

        Under a reentrant checkpoint the first gradient may come from the backward
        its recomputation runs *inside* the user's backward: the callback then
        fires when that inner backward ends. The micro-step goes on until the
        outer one ends (:meth:`on_grad` queues a callback there, or the next
        ``step()``, ``zero_grad()`` or backward settles it).
        """
        if ms.ended:
            return
        if not force:
            outer = _compat.outer_backward_frame()
            if outer is not None:
                ms.deferred = outer
                return
        ms.deferred = None
        if self.micro is ms:
            self.micro = None
        ms.ended = True
        ex = ms.execution
        if ex is None:
            self._show()
            return
        if (self.ddp is not None and ms.final and _compat.backward_id() >= 0
                and not _faults.disabled("ddp_reduced")):
            # Hazard: taking param.grad before DDP's reducer has written the
            # reduced gradient into it: its finalize callback, queued during this
            # backward after ours, runs after this one; a callback queued now
            # runs after it.
            def take() -> None:
                self.take_gradients(ms)
                self._show()

            _compat.queue_backward_callback(take)
        else:
            self.take_gradients(ms)
            self._show()

    def _show(self) -> None:
        """The backward ended: the loop sees the host sums in ``param.grad``."""
        if self.acc is not None:
            self.grads.install(self.acc, self.registry.params)

    def take_gradients(self, ms: MicroStep) -> None:
        """Settle every gradient gate this backward's hooks did not open: a final
        micro-step takes what ``param.grad`` holds (a wrapper's reduced gradient, one
        set by hand) and the device sums of non-final ones; other gates close."""
        ex = ms.execution
        assert ex is not None
        acc = self.acc
        for i, rec in enumerate(self.registry):
            if i in ms.received and self.ddp is None:
                continue
            gate = ex.gate(gate_name(rec))
            s = acc.device_sums.pop(i, None) if (acc is not None and ms.final) else None
            g = rec.param.grad if ms.final else None
            if is_placeholder(g):
                g = None  # it stands for the host sum: nothing new
            if g is not None:
                try:
                    payload = self._checked(rec, g)
                except GradientError as err:
                    self.health.dirty = err
                    self.abandon(ms, str(err), err)
                    raise
                rec.param.grad = None
                if acc is not None:
                    acc.touched.add(i)
                if s is not None:
                    s.add_(payload)
                    payload = s
                gate.open(Shipped(payload))
            elif s is not None:
                gate.open(Shipped(s))  # only non-final micro-steps had a gradient for it
            else:
                gate.close()

    def _checked(self, rec: Any, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` flat in ``rec``'s memory order.

        Raises:
            GradientError: not a dense gradient of the parameter's dtype and device.
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

    def settle_deferred(self) -> None:
        """End a micro-step whose reentrant inner backward ended, once no backward runs."""
        ms = self.micro
        if ms is not None and ms.deferred is not None and _compat.backward_id() < 0:
            self.end_backward(ms, force=True)

    # -- failures --------------------------------------------------------------------------
    def fail_current(self, err: BaseException) -> None:
        """A gradient was refused: this step is lost (dirty) and its backward abandoned."""
        ms = self.micro
        self.health.dirty = err
        if ms is not None:
            self.abandon(ms, str(err), err)

    def abandon(self, ms: MicroStep, why: str, err: BaseException | None = None) -> None:
        """Fail what of a micro-step's execution still waits for a gate (a backward that
        never ended, a step that will not come)."""
        ms.ended = True
        if self.micro is ms:
            self.micro = None
        if err is None:
            err = GradientError(f"a micro-step was abandoned: {why}")
            self.health.dirty = self.health.dirty or err
        ex = ms.execution
        if ex is None or ex.done():
            return
        names = [gate_name(rec) for rec in self.registry]
        if ms.final and self.config.overlap != "backward":
            names.append("step")
        if ms.final and "norm_allreduce" in ex.plan.order:
            names.append("reduce")
        for name in names:
            gate = ex.gate(name)
            if gate.state == "pending":
                gate.fail(err)

    def close_open_backward(self, why: str) -> None:
        """``step()`` during a backward (or with its end missed): abandon it and wait
        for what of its execution runs."""
        self.settle_deferred()
        ms = self.micro
        if ms is not None:
            self.abandon(ms, why)
            if ms.execution is not None:
                settle(ms.execution, timeout=self.config.timeout)  # failed by abandon()

    def settle_failure(self) -> Execution | None:
        """A micro-step of the accumulation failed: let every execution settle, and say
        what the failure left (a final micro-step may have stepped chunks). Returns the
        final execution once it settled.

        Raises:
            KeyboardInterrupt: while waiting (the accumulation stays as it was).
        """
        acc = self.acc
        assert acc is not None
        settled = None
        for ms in acc.micro:
            ex = ms.execution
            if ex is None:
                continue
            self.abandon(ms, "an earlier failure of this step",
                         GradientError("an earlier failure of this step"))
            settle(ex, timeout=self.config.timeout)  # its failure is classified below
            if ex.exception is not None:
                self.health.dirty = self.health.dirty or ex.exception
            if ms.final and ex.done():
                cause = ex.exception or self.health.dirty
                assert cause is not None
                classify(self.health, acc, cause)
                settled = ex
        return settled

    def settle_final_backward(self) -> Execution | None:
        """Under ``overlap="backward"``, wait for the chunks a final backward started
        before ``step()``; if they failed, drop the accumulation (classified) and
        return the execution."""
        acc = self.acc
        fin = acc.final if acc is not None else None
        if acc is None or fin is None or fin.execution is None or (
                self.config.overlap != "backward"):
            return None
        ex = fin.execution
        self.settle_deferred()
        if not fin.ended:
            return None  # inside that backward: nothing more can be waited for here
        self.reduce_norm(acc)
        settle(ex, timeout=self.config.timeout)  # its failure is classified below
        if ex.exception is None:
            return None
        self.acc = None
        acc.phase = Phase.DISCARDED
        classify(self.health, acc, root_cause(acc, ex.exception))
        return ex

    # -- transitions step() and zero_grad() drive ---------------------------------------------
    def begin_from_params(self) -> bool:
        """``step()`` with no gradient from a backward: gradients set by hand in
        ``param.grad`` (as ``torch.distributed.checkpoint`` does to create state) are
        this step's. Returns whether there were any."""
        if not any(rec.param.grad is not None for rec in self.registry):
            return False
        self.acc = Accumulation(counts=[0] * len(self.registry))
        return True

    def finalize(self) -> Accumulation | None:
        """End the accumulation (no backward may follow before ``step()``): launch a final
        micro-step with no gradient of its own if no backward was the final one. Returns
        it, or ``None`` if there is none (or, under ``overlap="backward"``, no final
        backward: launching one would step)."""
        acc = self.acc
        if acc is None:
            return None
        self.settle_deferred()
        if acc.final is None:
            if self.micro is not None or self.config.overlap == "backward":
                return None
            self._launch_final(acc)
        return acc

    def _launch_final(self, acc: Accumulation) -> None:
        """A final micro-step with no backward: its gradients are the sums so far, and
        what ``param.grad`` holds."""
        ms = MicroStep(final=True)
        self._before_final(acc)
        ms.execution = self._launch(acc, ms)
        acc.final = ms
        acc.phase = Phase.FINAL
        acc.micro.append(ms)
        self.end_backward(ms)

    def current_norm(self) -> torch.Tensor | None:
        """The norm of the accumulation in progress, which it ends (:meth:`finalize`), or
        ``None``. Waits for the norm, not for the step."""
        acc = self.finalize()
        if acc is None:
            return None
        self.reduce_norm(acc)
        return acc.wait_norm(self.config.timeout)

    def reduce_norm(self, acc: Accumulation) -> None:
        """Let the final execution all-reduce the norm (its gate ``reduce``): called on
        the caller's thread, which then waits for it."""
        # Hazard: the lane's all-reduce of the norm and the caller's own
        # collectives (a loss all-reduce, FSDP2's all-gathers) issued on one
        # process group from two threads, in an order that may differ between
        # ranks: the caller opens it, then waits for it before going on.
        fin = acc.final
        if fin is None or fin.execution is None or (
                "norm_allreduce" not in fin.execution.plan.order):
            return
        gate = fin.execution.gate("reduce")
        if gate.state == "pending":
            gate.open(None)

    def hand_over(self, hyper: list[dict[str, Any]] | None, max_norm: float | None = None,
                  edits: Mapping[int, tuple[Any, ...]] | None = None) -> Accumulation:
        """``step()``: the accumulation becomes the step in flight. Without a final
        backward, a final micro-step with no gradient of its own is launched now; under
        ``overlap="forward"`` or ``"none"`` its chunks may start (``hyper``, clipping to
        ``max_norm``, the loop's ``edits`` of each gradient first)."""
        acc = self.acc
        assert acc is not None
        if acc.final is None:
            self._launch_final(acc)
        elif self.config.overlap != "backward":
            # Hazard: the chunks stepping the masters while a transfer launched
            # after the final backward began (its execution waits for this gate)
            # still reads them.
            self.readers.wait()
        self.reduce_norm(acc)
        if self.config.overlap != "backward":
            acc.execution.gate("step").open((hyper, max_norm, dict(edits or {})))
        acc.phase = Phase.STEPPING
        self.acc = None
        self.grads.clear()  # step() consumes the gradients (a final micro-step launched
        # just now showed them)
        return acc

    def discard(self, why: str, *, classify_final: bool) -> None:
        """Drop the accumulation: fail what of its executions waits for a gate, and wait
        for them; with ``classify_final``, say what a final one that stepped chunks
        before it failed left (a torn step, which this does not clear).

        Raises:
            KeyboardInterrupt: while waiting (the accumulation stays, to be discarded
                again).
        """
        acc = self.acc
        self.grads.clear()
        if acc is not None:
            for ms in acc.micro:
                ex = ms.execution
                if ex is None:
                    continue
                # Discarded: a gate left pending (the step's, or a backward that
                # never ended) would hold its lanes until the timeout.
                self.abandon(ms, why, GradientError(why))
                settle(ex, timeout=self.config.timeout)  # failed by abandon()
                cause = ex.exception or self.health.dirty
                if classify_final and ms.final and ex.done() and cause is not None:
                    # Chunks that stepped before the failure make a torn step.
                    classify(self.health, acc, cause)
            acc.phase = Phase.DISCARDED
        self.acc = None
        self.micro = None
        self.health.dirty = None

    def edit_sums(self, replaced: Mapping[int, torch.Tensor], dropped: Sequence[int]) -> None:
        """The loop put a gradient in ``param.grad`` by hand (``replaced``: flat, in the
        parameter's memory order) or set it to ``None`` (``dropped``) after a backward:
        the host sums (or, under ``accumulate="gpu"`` before the final micro-step, the
        device sums) say so from now on. Runs on the caller's thread between backwards."""
        acc = self.acc
        assert acc is not None
        if self.config.accumulate == "gpu" and acc.final is None:
            for i, t in replaced.items():
                acc.device_sums[i] = t.to(torch.float32, copy=True)
                acc.touched.add(i)
            for i in dropped:
                acc.device_sums.pop(i, None)
                acc.touched.discard(i)
            return
        # Hazard: writing a host sum (and its count) that a fold of this
        # accumulation's executions is still writing on the accumulate lane.
        for ms in acc.micro if not _faults.disabled("grad_edit_wait") else ():
            if ms.execution is None:
                continue
            if ms.final:
                acc.wait_norm(self.config.timeout)  # its folds (its chunks wait for step())
            else:
                settle(ms.execution, timeout=self.config.timeout)
        for i, t in replaced.items():
            rec = self.registry[i]
            with torch.no_grad():
                rec.flat_acc.copy_(t)  # widening: exact
            acc.counts[i] = 1
            acc.touched.add(i)
        for i in dropped:
            acc.counts[i] = 0  # (a later micro-step's gradient starts the sum again)
            acc.touched.discard(i)
            acc.norms.pop(i, None)


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
                           for n in (f"step:{k}", f"h2d:{k}")]
