"""FullOffloadOptimizer: gradients, FP32 masters and optimizer state in host memory.

The full-offload half of prime-rl #4221 (``../shared/REFERENCE.md`` §3, §5).
Only the compute weights (BF16, say) stay on the device. Each gradient goes to
the host as autograd finalizes it, is folded into an FP32 accumulator there,
and the wrapped optimizer's own CPU kernels step FP32 masters in chunks; the
masters, cast to the compute dtype, go back to the device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal

import torch

from pipeoff import _accel, _compat, _faults
from pipeoff._errors import (
    ConfigError,
    GradientError,
    StepFailedError,
    UnsupportedOptimizerError,
)
from pipeoff._lowlevel import completions, is_failure_of, settle
from pipeoff._validate import check_int
from pipeoff.execution import Completion, Execution
from pipeoff.executor import execute
from pipeoff.graph import TaskContext
from pipeoff.optim import _accumulate, _update
from pipeoff.optim._full_graph import (
    FullParam,
    FullWork,
    host_budget,
    micro_step_graph,
    micro_step_schedule,
    pieces,
    plan_chunks,
)
from pipeoff.optim._readers import Readers
from pipeoff.optim._tensors import flat, flat_like, host_alloc, index_of, memory_order, snapshot
from pipeoff.optim._tensors import local as _local
from pipeoff.optim._tensors import wrap_like as _wrap_like
from pipeoff.optim._waits import ForwardWaits
from pipeoff.staging import reserve_for

__all__ = ["FullOffloadOptimizer"]

Accumulate = Literal["cpu", "gpu"]
Overlap = Literal["backward", "forward", "none"]

DEFAULT_CHUNK_NUMEL = 16 << 20
"""Most elements per optimizer chunk (whole parameters; prime-rl's figure)."""
DEFAULT_SLOT_BYTES = 64 << 20
"""Bytes of one pinned host slot a gradient travels through (a larger one goes in pieces)."""


def _root_cause(acc: _Accumulation, err: BaseException) -> BaseException:
    """The failure of the earliest micro-step of ``acc`` that failed (a later one
    fails only because it waited on it), or ``err``."""
    for ms in acc.micro:
        ex = ms.execution
        if ex is not None and ex.done() and ex.exception is not None:
            return ex.exception
    return err


def _order(p: torch.Tensor) -> tuple[int, ...]:
    order = memory_order(_local(p))
    assert order is not None  # checked by add_param_group
    return order


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.shape == b.shape and bool(torch.equal(a, b)))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


@dataclasses.dataclass(eq=False)
class _Accumulation:
    """One optimizer step's gradient accumulation: its micro-steps and their sums."""

    counts: list[int]
    """Per parameter, the contributions folded into its host accumulator."""
    micro: list[_Micro] = dataclasses.field(default_factory=list)
    final: _Micro | None = None
    hyper: list[dict[str, Any]] | None = None
    """The groups' hyperparameters the chunks use (captured when the final
    backward began under ``overlap="backward"``, else by ``step()``)."""
    touched: set[int] = dataclasses.field(default_factory=set)
    """Parameters with a gradient in some micro-step (known on the caller's thread,
    unlike ``counts``, which the accumulate lane writes)."""
    device_sums: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    """``accumulate="gpu"``: FP32 sums of the non-final micro-steps, by parameter."""
    norms: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    total_norm: torch.Tensor | None = None
    clip_coef: torch.Tensor | None = None


@dataclasses.dataclass(eq=False)
class _Micro:
    """One backward (a micro-step) and the execution that takes its gradients in."""

    final: bool
    execution: Execution | None
    received: set[int] = dataclasses.field(default_factory=set)
    ended: bool = False
    deferred: Any = None
    """The frame of the outermost backward, while the end callback of a reentrant
    (inner) backward has fired but the outer one still runs."""


class _Shipped:
    """A gradient on its way to the host: the gate's payload. The copy drops the
    tensor once it is issued, so the device memory is free while the execution
    (which keeps its gates' payloads) lives on."""

    __slots__ = ("dtype", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.dtype = tensor.dtype


@dataclasses.dataclass(eq=False)
class _WaitStep:
    """The view of a step that :class:`ForwardWaits` reads."""

    execution: Execution
    opt_tasks: tuple[str, ...]
    restore: dict[int, Any] = dataclasses.field(default_factory=dict)
    waited: set[int] = dataclasses.field(default_factory=set)
    hook_waits: list[tuple[str, int, int]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class _WaitLayout:
    params: Sequence[torch.Tensor]
    chunks_of: Sequence[tuple[int, ...]]
    device: torch.device


class FullOffloadOptimizer(torch.optim.Optimizer):
    """Full offload: FP32 masters, optimizer state and a gradient accumulator in host memory.

    Only ``model``'s compute weights stay on the device; the host holds 16
    bytes per parameter (AdamW: FP32 master, two moments, FP32 gradient sum),
    pinned where an accelerator is present. Mark non-final micro-steps with
    :meth:`no_sync` (or FSDP2's ``set_requires_gradient_sync(False)``); the
    end of each backward is detected without a call.

    * ``accumulate="cpu"`` (prime-rl's default): each gradient goes to the host
      as autograd finalizes it (``register_post_accumulate_grad_hook``),
      through a ring of pinned slots, and a host lane folds it into the FP32
      accumulator: a widening copy first, adds after. ``param.grad`` is
      released at once. ``accumulate="gpu"``: non-final micro-steps sum into
      an FP32 device accumulator (4 bytes per parameter, freed after each
      step), shipped once in the final backward.
    * ``overlap="backward"``: a chunk steps on a host lane as soon as its
      parameters' final gradients have landed, and its weights go back during
      the backward; ``step()`` waits, or with :meth:`attach` returns at once.
      The step uses the hyperparameters in ``param_groups`` when the final
      backward began. ``overlap="forward"``: ``step()`` launches the chunks and
      returns; each module's forward waits for its weights (as
      ``OffloadOptimizer(mode="overlap")``). ``overlap="none"``: the
      synchronous schedule, the reference.
    * ``max_norm``: clip the global gradient norm as
      ``torch.nn.utils.clip_grad_norm_`` does (the norm of each parameter's
      sum is taken in its final accumulation, while hot in cache, then one
      scalar, all-reduced over ``process_group``). Needs ``overlap="forward"``
      or ``"none"``: no chunk may step before the norm of every gradient is known.

    Results are bitwise those of the reference: per parameter the FP32 left
    fold of its micro-step gradients (each widened, the first copied, missing
    ones skipped), ``optimizer_class`` stepping FP32 masters on the CPU with
    the same hyperparameters, weights = masters cast to the compute dtype.

    Args:
        model: the module whose trainable parameters are optimized.
        optimizer_class: an element-wise ``torch.optim`` class (``AdamW``, ``Adam``,
            ``SGD``, ``Adagrad``, ``RMSprop``); ``fused=True`` uses torch's fused CPU kernel.
        params: parameters or param groups (dicts), all of ``model``'s; default:
            every parameter of ``model`` that requires grad.
        accumulate: ``"cpu"`` or ``"gpu"``.
        overlap: ``"backward"``, ``"forward"`` or ``"none"``.
        max_norm: clip gradients to this global 2-norm (a positive float), or ``None``.
        chunk_numel: most elements in one optimizer chunk (whole parameters).
        slot_bytes: bytes of one pinned host slot (a gradient larger ships in pieces).
        slots: host slots in the ring; host staging is at most ``slots * slot_bytes``
            plus two chunks' weights.
        num_threads: CPU threads of each host lane's kernels (``torch.set_num_threads``
            on that lane, which is per thread); ``None`` keeps torch's default
            (``OMP_NUM_THREADS``, else every core). Two host lanes (accumulate,
            step) run at once, beside the dataloader's workers.
        process_group: the group over which the clipping norm is all-reduced
            (default: the world when torch.distributed is initialized).
        timeout: seconds ``step()`` waits before raising ``StepTimeoutError``
            naming the gradients that never came.
        **defaults: the optimizer's hyperparameters (``lr``, ``weight_decay``...).

    Raises:
        ConfigError: an argument is out of range; a parameter is not in ``model``,
            listed twice, not dense, or under FSDP2's ``CPUOffloadPolicy``;
            ``max_norm`` with ``overlap="backward"``; flush-to-zero or compiled
            autograd is on.
        UnsupportedOptimizerError: ``optimizer_class`` is not element-wise.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer_class: type[torch.optim.Optimizer],
        *,
        params: Iterable[Any] | None = None,
        accumulate: Accumulate = "cpu",
        overlap: Overlap = "backward",
        max_norm: float | None = None,
        chunk_numel: int = DEFAULT_CHUNK_NUMEL,
        slot_bytes: int = DEFAULT_SLOT_BYTES,
        slots: int = 4,
        num_threads: int | None = None,
        process_group: Any = None,
        timeout: float = 600.0,
        **defaults: Any,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(f"model must be a torch.nn.Module, got {model!r}")
        if not (isinstance(optimizer_class, type)
                and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise ConfigError(
                f"optimizer_class must be a torch.optim.Optimizer class such as "
                f"torch.optim.AdamW, got {optimizer_class!r}")
        if optimizer_class not in _update.ELEMENTWISE:
            names = ", ".join(f"torch.optim.{t.__name__}" for t in _update.ELEMENTWISE)
            raise UnsupportedOptimizerError(
                f"FullOffloadOptimizer steps the masters in chunks, exact only for element-wise "
                f"optimizers ({names}); {optimizer_class.__qualname__} is not one of them")
        if accumulate not in ("cpu", "gpu"):
            raise ConfigError(f"accumulate must be 'cpu' or 'gpu', got {accumulate!r}")
        if overlap not in ("backward", "forward", "none"):
            raise ConfigError(
                f"overlap must be 'backward', 'forward' or 'none', got {overlap!r}")
        if max_norm is not None:
            if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not (
                    max_norm > 0 and max_norm != float("inf")):
                raise ConfigError(f"max_norm must be a positive finite float or None, "
                                  f"got {max_norm!r}")
            if overlap == "backward":
                raise ConfigError(
                    "max_norm needs overlap='forward' or 'none': clipping scales every "
                    "gradient by the global norm, which is known only after the last "
                    "gradient of the backward has landed, so no chunk can step during "
                    "the backward (overlap='backward')")
        check_int("chunk_numel", chunk_numel, as_bound=True)
        check_int("slot_bytes", slot_bytes, minimum=16)
        check_int("slots", slots, as_bound=True)
        check_int("num_threads", num_threads, optional=True, as_bound=True)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self._refuse_environment()
        # Hazard: a compile session that began before the first chunk's math
        # (is_compiling() is process-wide) steering torch.optim into its
        # compiled-code branches on a host lane.
        _compat.eager_math()
        for m in model.modules():
            if _compat.fsdp_cpu_offload(m):
                raise ConfigError(
                    "the model is under FSDP2's CPUOffloadPolicy, which already keeps "
                    "parameters and gradients on the host (and copies them synchronously); "
                    "FullOffloadOptimizer needs the compute weights on the device: shard "
                    "without offload_policy")
        for flag in ("capturable", "differentiable"):
            if defaults.get(flag):
                raise ConfigError(
                    f"{flag}=True is not for FullOffloadOptimizer: the masters are stepped on "
                    "the host, outside autograd and CUDA graphs")
        if isinstance(params, torch.Tensor):
            raise ConfigError("params must be an iterable of parameters or of param group "
                              f"dicts, got a single tensor of shape {tuple(params.shape)}")
        try:
            probe = optimizer_class([torch.zeros(1, requires_grad=True)], **defaults)
        except (TypeError, ValueError) as err:
            raise ConfigError(f"{optimizer_class.__name__} refused the hyperparameters "
                              f"{defaults}: {err}") from None
        self.model = model
        self.optimizer_class = optimizer_class
        self.accumulate: Accumulate = accumulate
        self.overlap: Overlap = overlap
        self.max_norm = None if max_norm is None else float(max_norm)
        self.chunk_numel = chunk_numel
        self.slot_bytes = slot_bytes
        self.slots = slots
        self.num_threads = num_threads
        self.process_group = process_group
        self.timeout = float(timeout)
        self._probe = probe
        self._kwargs = dict(defaults)
        self._names = {id(p): n for n, p in model.named_parameters(remove_duplicate=True)}
        if params is None:
            params = [p for p in model.parameters() if p.requires_grad]
        self._lock = threading.RLock()
        self._micro: _Micro | None = None
        self._acc_state: _Accumulation | None = None
        self._inflight: tuple[_Accumulation, _Micro] | None = None
        self._prev: Execution | None = None
        """The latest execution that writes accumulators or masters: the next
        micro-step's accumulations wait for it."""
        self._dirty: BaseException | None = None
        self._torn: str | None = None
        self._readers = Readers()  # state transfers reading the host state
        self._stale: BaseException | None = None
        self._no_sync = 0
        self._hooked: dict[int, Any] = {}
        self._attach_handles: list[Any] = []
        self._attached: torch.nn.Module | None = None
        self._warned_compiled = False
        self._waits = ForwardWaits(self.wait_for_step)
        self.last_trace: Any = None
        self._grad_norm: torch.Tensor | None = None
        self._params: list[torch.Tensor] = []
        self._retired: dict[int, tuple[Any, ...]] = {}
        self._stepped: set[int] = set()
        self._outside_writes = 0
        """Parameters found written outside the optimizer (tests: FSDP2 must not
        trigger it every step, which would copy weights to the host)."""
        """``id()`` of the parameters stepped at least once (an optimizer without
        per-parameter state, SGD without momentum, has no other trace of it)."""
        self._versions: list[int] = []
        self._masters: list[torch.Tensor] = []
        self._accs: list[torch.Tensor] = []
        self._flat_masters: list[torch.Tensor] = []
        self._flat_accs: list[torch.Tensor] = []
        self._building = True
        try:
            super().__init__(list(params), probe.defaults)
        except ValueError as err:
            if isinstance(err, ConfigError):
                raise
            raise ConfigError(f"params: {err}") from None
        self._building = False
        self._index_params()

    # -- set-up -----------------------------------------------------------------
    @staticmethod
    def _refuse_environment() -> None:
        if _accumulate.flush_to_zero():
            raise ConfigError(
                "flush-to-zero is on (torch.set_flush_denormal(True)): subnormal gradients "
                "would become 0 on the host and results would differ from the reference; "
                "call torch.set_flush_denormal(False)")
        if _compat.compiled_autograd_active():
            raise ConfigError(
                "compiled autograd is on: it skips post-accumulate-grad hooks, so no "
                "gradient would reach FullOffloadOptimizer; compile the model, not the "
                "backward (torch._dynamo.config.compiled_autograd = False)")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group of ``model``'s parameters (with its own hyperparameters).

        Either the group is added with its host state, or nothing changes.

        Raises:
            ConfigError: a parameter is not in ``model``, listed twice, not a
                floating-point dense tensor, or the hyperparameters are refused.
        """
        if not isinstance(param_group, dict):
            raise ConfigError(f"param_group must be a dict, got {type(param_group).__name__}")
        if not self._building:
            self.wait_for_step()
            if self._acc_state is not None:
                raise ConfigError("add_param_group() between a backward and step(): call it "
                                  "after step() and zero_grad()")
        group = dict(param_group)
        if "params" not in group:
            raise ConfigError("a param group needs a 'params' entry (its parameters), got keys "
                              f"{sorted(group)}")
        for flag in ("capturable", "differentiable"):
            if group.get(flag):
                raise ConfigError(f"param group: {flag}=True is not for FullOffloadOptimizer")
        ps = group["params"]
        group["params"] = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        hyper = {k: v for k, v in group.items() if k != "params"}
        try:
            self.optimizer_class([torch.zeros(1, requires_grad=True)],
                                 **{**self._kwargs, **hyper})
        except (TypeError, ValueError) as err:
            raise ConfigError(f"{self.optimizer_class.__name__} refused the group's "
                              f"hyperparameters {hyper}: {err}") from None
        seen = {id(p) for g in self.param_groups for p in g["params"]}
        for p in group["params"]:
            if not isinstance(p, torch.Tensor):
                raise ConfigError(f"param groups hold tensors, got {p!r}")
            name = self._names.get(id(p))
            if name is None:
                raise ConfigError(f"a parameter of shape {tuple(p.shape)} is not in the model "
                                  "given to FullOffloadOptimizer")
            if id(p) in seen:
                raise ConfigError(f"parameter {name!r} is listed twice (a tied weight is one "
                                  "parameter: list it once)")
            seen.add(id(p))
            if not p.dtype.is_floating_point or memory_order(_local(p)) is None:
                raise ConfigError(f"parameter {name!r} must be a dense floating-point tensor, "
                                  f"got {p.dtype} with strides {_local(p).stride()}")
        before = list(self.param_groups)
        super().add_param_group(group)
        if not self._building:
            try:
                self._index_params()
            except BaseException:
                self.param_groups[:] = before
                self._index_params()
                raise

    def _index_params(self) -> None:
        """Host state and hooks for the parameters of ``param_groups`` (new ones only)."""
        params = [p for g in self.param_groups for p in g["params"]]
        old = self._params
        keep = {id(p): i for i, p in enumerate(old)}
        now = {id(p) for p in params}
        for i, p in enumerate(old):
            if id(p) not in now:
                # Removed from param_groups: keep its master and state, as torch
                # keeps opt.state[p], for when it comes back.
                self._retired[id(p)] = (p, self._masters[i], self._accs[i],
                                        self._flat_masters[i], self._flat_accs[i],
                                        self._state[i], self._scalars[i], self._present[i])
        devices = {_local(p).device for p in params}
        if len(devices) > 1:
            raise ConfigError(f"parameters on several devices {sorted(map(str, devices))}; "
                              "FullOffloadOptimizer needs one device per rank")
        self.device = devices.pop() if devices else torch.device("cpu")
        pin = _accel.current().is_device(self.device)
        back = {id(p): self._retired.pop(id(p)) for p in params
                if id(p) not in keep and id(p) in self._retired
                and self._retired[id(p)][0] is p}
        new = [p for p in params if id(p) not in keep and id(p) not in back]
        specs: list[Any] = []
        for p in new:
            loc = _local(p)
            specs += [(loc.shape, torch.float32, _order(p))] * 2
        tensors = host_alloc(specs, pin) if specs else []
        made = {id(p): (tensors[2 * k], tensors[2 * k + 1]) for k, p in enumerate(new)}
        masters, accs, flat_m, flat_a, state, scalars, present = [], [], [], [], [], [], []
        for p in params:
            if id(p) in keep:
                i = keep[id(p)]
                masters.append(self._masters[i])
                accs.append(self._accs[i])
                flat_m.append(self._flat_masters[i])
                flat_a.append(self._flat_accs[i])
                state.append(self._state[i])
                scalars.append(self._scalars[i])
                present.append(self._present[i])
                continue
            if id(p) in back:
                _, m, a, fm, fa, st, sc, pr = back[id(p)]
                masters.append(m)
                accs.append(a)
                flat_m.append(fm)
                flat_a.append(fa)
                state.append(st)
                scalars.append(sc)
                present.append(pr)
                continue
            m, a = made[id(p)]
            order = _order(p)
            with torch.no_grad():
                m.copy_(_local(p))  # widening: exact
            masters.append(m)
            accs.append(a)
            flat_m.append(flat(m, order))
            flat_a.append(flat(a, order))
            state.append({})
            scalars.append({})
            present.append(())
        self._params = params
        self._masters, self._accs = masters, accs
        self._flat_masters, self._flat_accs = flat_m, flat_a
        self._state: list[dict[str, torch.Tensor]] = state
        self._scalars: list[dict[str, Any]] = scalars
        self._present: list[tuple[str, ...]] = present
        self._pidx = {id(p): i for i, p in enumerate(params)}
        self._indexed = self._fingerprint()
        self._versions = [_local(p)._version for p in params]
        self._orders: list[tuple[int, ...]] = [_order(p) for p in params]
        self._group_of = [gi for gi, g in enumerate(self.param_groups) for _ in g["params"]]
        self._pnames = [self._names[id(p)] for p in params]
        self._chunks = plan_chunks([_local(p).numel() for p in params], self.chunk_numel)
        self._chunks_of = [(0,)] * len(params)
        for k, chunk in enumerate(self._chunks):
            for i in chunk:
                self._chunks_of[i] = (k,)
        self._ensure_hooks()
        for i in range(len(params)):
            self._ensure_state(i, self.param_groups[self._group_of[i]])
        self.host_budget_bytes = host_budget(self._full_params(None), self._chunks,
                                             slot_bytes=self.slot_bytes, slots=self.slots)
        """Most bytes of host staging live at once: the slot ring and two chunks' weights."""
        graph, schedule = self._graph(final=True, itemsize=None, work=None)
        reserve_for(graph, schedule)

    def _ensure_hooks(self) -> None:
        """A post-accumulate-grad hook on every parameter of the model, once.

        Hooks stay: a parameter removed from ``param_groups`` is ignored by its
        hook (its gradient stays in ``.grad``, as with torch), and one added back,
        or unfrozen, is taken in at once. (A hook registered for the first time
        during a backward does not fire in it: in-place edits are noticed at the
        first gradient of the next backward.) A frozen parameter gets its hook
        with ``requires_grad`` switched on for the call.
        """
        for p in self.model.parameters():
            if id(p) in self._hooked:
                continue
            frozen = not p.requires_grad
            if frozen:
                p.requires_grad_(True)
            try:
                self._hooked[id(p)] = p.register_post_accumulate_grad_hook(self._on_grad)
            finally:
                if frozen:
                    p.requires_grad_(False)

    def _ensure_state(self, i: int, group: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """The per-element host state of parameter ``i`` for ``group``'s keys (allocated once)."""
        keys = _update.state_keys(self._probe, group)
        st = self._state[i]
        missing = [k for k in keys if k not in st]
        if missing:
            loc = _local(self._params[i])
            pin = _accel.current().is_device(self.device)
            made = host_alloc([(loc.shape, torch.float32, self._orders[i])] * len(missing), pin)
            for k, t in zip(missing, made):
                t.zero_()
                st[k] = t
        return st

    # -- the Optimizer surface -------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("FullOffloadOptimizer cannot be pickled; save state_dict() instead")

    def __repr__(self) -> str:
        return (f"FullOffloadOptimizer({self.optimizer_class.__name__}, "
                f"accumulate={self.accumulate!r}, overlap={self.overlap!r}, "
                f"max_norm={self.max_norm!r}, params={len(getattr(self, '_params', []))})")

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Mark the backwards inside as non-final micro-steps (the convention of DDP's
        ``no_sync()``): their gradients are accumulated and nothing steps."""
        self._settle_deferred()
        self._no_sync += 1
        try:
            yield
        finally:
            self._no_sync -= 1

    def attach(self, model: torch.nn.Module | None = None) -> None:
        """Make ``model``'s forward wait, per module, for the weights a step still writes;
        ``step()`` then returns at once under ``overlap="backward"`` too.

        Raises:
            ConfigError: ``model`` is not a module, or lacks some parameters.
        """
        from pipeoff.optim._hooks import install, unwrap

        model = self.model if model is None else model
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(f"attach() needs a torch.nn.Module, got {model!r}")
        ids = {id(p) for p in unwrap(model).parameters()}
        missing = [self._pnames[i] for i, p in enumerate(self._params) if id(p) not in ids]
        if missing:
            raise ConfigError(f"attach(): parameters {missing[:5]} are not in the model")
        self.wait_for_step()
        handles = install(self._waits, model, self._params)
        for h in self._attach_handles:
            h.remove()
        self._attach_handles = handles
        self._attached = model

    def detach(self) -> None:
        """Remove the forward hooks :meth:`attach` installed."""
        self.wait_for_step()
        for h in self._attach_handles:
            h.remove()
        self._attach_handles = []
        self._attached = None
        self._waits.set_modules(torch.nn.Module(), [])
        self._waits.attached = False

    # -- gradients in ----------------------------------------------------------------
    def _fsdp_sync(self) -> bool:
        from pipeoff.optim._hooks import unwrap

        flag = _compat.fsdp_gradient_sync(unwrap(self.model))
        return flag is not False

    def _quiesce(self) -> None:
        """Wait for every write to masters and weights: the step in flight, and under
        ``overlap="backward"`` the chunks a final backward started before ``step()``."""
        self.wait_for_step()
        acc = self._acc_state
        fin = acc.final if acc is not None else None
        if fin is not None and fin.execution is not None and self.overlap == "backward":
            ex = fin.execution
            self._settle_deferred()
            if not fin.ended:
                return  # inside that backward: nothing more can be waited for here
            settle(ex, timeout=self.timeout)  # its failure is classified below
            if ex.exception is not None:
                assert acc is not None
                self._acc_state = None
                self.last_trace = ex.trace
                self._classify(ex, _root_cause(acc, ex.exception))

    def _quiesce_keeping_failures(self) -> None:
        """:meth:`_quiesce`, without raising a failed step's error (its state, torn, stale
        or dirty, is recorded and said by the next step); an interrupt is raised."""
        try:
            self.wait_for_step()
        except BaseException:
            if self._inflight is not None:
                raise  # the wait was interrupted: the step is still in flight
            # The step failed: wait_for_step() classified it.
        self._quiesce()

    def _accel_sync(self) -> None:
        if _accel.current().is_device(self.device):
            _accel.current().synchronize(self.device)

    def _adopt_external_writes(self) -> None:
        """Weights written by something else since this optimizer last wrote them
        (``model.load_state_dict``, an initializer) become the masters, unless they
        hold exactly the masters' cast (a checkpoint of this very state)."""
        changed = [i for i, p in enumerate(self._params)
                   if _local(p)._version != self._versions[i]]
        if not changed:
            return
        self._outside_writes += len(changed)
        self.wait_for_step()  # our own writes first
        self._accel_sync()
        with torch.no_grad():
            for i in changed:
                loc = _local(self._params[i])
                w = flat(loc, self._orders[i]).to("cpu", copy=True)
                m = self._flat_masters[i]
                if not torch.equal(w.view(torch.uint8), m.to(w.dtype).view(torch.uint8)):
                    m.copy_(w)
                self._versions[i] = loc._version

    def _sync_with_model(self) -> None:
        """At the start of a step: adopt outside writes to the weights, then follow
        in-place edits of ``param_groups``."""
        if self._acc_state is None:
            self._adopt_external_writes()
        self._follow_param_groups()

    def _fingerprint(self) -> tuple[tuple[tuple[int, bool], ...], ...]:
        return tuple(tuple((id(p), p.requires_grad) for p in g["params"])
                     for g in self.param_groups)

    def _follow_param_groups(self) -> None:
        """The live ``param_groups`` are the truth: parameters removed from, added to or
        moved between groups in place are picked up between steps."""
        if self._fingerprint() == self._indexed:
            return
        if self._acc_state is not None:
            raise ConfigError(
                "param_groups' parameters changed in the middle of gradient accumulation "
                "(between a backward and step()); change them after step() and zero_grad()")
        seen: set[int] = set()
        for g in self.param_groups:
            for q in g["params"]:
                name = self._names.get(id(q))
                if name is None:
                    raise ConfigError(f"param_groups holds a tensor of shape {tuple(q.shape)} "
                                      "that is not a parameter of the model")
                if id(q) in seen:
                    raise ConfigError(f"parameter {name!r} is listed twice in param_groups")
                seen.add(id(q))
        self._index_params()

    def _on_grad(self, p: torch.Tensor) -> None:
        """The post-accumulate-grad hook of every parameter: ship the gradient."""
        if self._acc_state is None and self._micro is None:
            self._sync_with_model()  # the first gradient of a step
        i = self._pidx.get(id(p))
        if i is None:
            return
        name = self._pnames[i]
        bwd = _compat.backward_id()
        grad = p.grad
        if grad is None:
            return
        if bwd < 0:
            raise GradientError(
                f"a gradient for {name!r} reached FullOffloadOptimizer outside a backward "
                "(a post-accumulate-grad hook called by hand?): gradients are taken in "
                "only from loss.backward()")
        loc = _local(grad)
        if grad.dtype != p.dtype or loc.device != _local(p).device or loc.layout != torch.strided:
            err = GradientError(
                f"the gradient of {name!r} is {grad.dtype} on {loc.device} ({loc.layout}); "
                f"FullOffloadOptimizer takes dense gradients of the parameter's dtype "
                f"{p.dtype} on {_local(p).device}")
            self._fail_current(err)
            raise err
        if self._dirty is not None or self._torn is not None:
            p.grad = None  # dropped: step() refuses until zero_grad()
            return
        ms = self._micro
        if ms is not None and ms.deferred is not None:
            if _compat.outermost_backward_frame() is ms.deferred:
                # Still the backward whose inner (reentrant) part ended: end the
                # micro-step when this, its outer graph task, ends.
                ms.deferred = None
                outer = ms
                _compat.queue_backward_callback(lambda: self._end_backward(outer))
            else:
                self._end_backward(ms, force=True)  # that backward is over
                ms = self._micro
        # A backward inside a backward (a reentrant checkpoint's recomputation)
        # has a graph task of its own; its gradients belong to the outer one.
        if ms is None or ms.ended:
            ms = self._begin_micro()
        if i in ms.received:
            err = GradientError(
                f"a second gradient for {name!r} in one backward: it is used both inside "
                "and outside a reentrant checkpoint (torch.utils.checkpoint with "
                "use_reentrant=True runs a backward of its own), or its hook ran twice. "
                "FullOffloadOptimizer takes one gradient per parameter per backward; use "
                "use_reentrant=False (torch's recommended setting)")
            self._fail_current(err)
            raise err
        ms.received.add(i)
        order = self._orders[i]
        payload = flat_like(loc, order) if order is not None else loc.reshape(-1)
        p.grad = None
        acc = self._acc_state
        assert acc is not None
        acc.touched.add(i)
        if self.accumulate == "gpu":
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
        ms.execution.gate(self._gate(i)).open(_Shipped(payload))

    def _gate(self, i: int) -> str:
        return f"grad:{self._pnames[i]}"

    def _begin_micro(self) -> _Micro:
        """The first gradient of a backward: launch its execution."""
        acc = self._acc_state
        if acc is None:
            acc = self._acc_state = _Accumulation(counts=[0] * len(self._params))
        final = self._no_sync == 0 and self._fsdp_sync()
        if acc.final is not None:
            err = GradientError(
                "a backward after the final micro-step of this step, before step(): call "
                "opt.step() and opt.zero_grad() between steps, and wrap the non-final "
                "micro-steps in opt.no_sync()")
            self._dirty = err
            raise err
        ms = _Micro(final=final, execution=None)
        if final:
            acc.final = ms
            if self.overlap == "backward":
                acc.hyper = self._capture_hyper()
        if final:
            # The final micro-step's graph steps the masters and moments (under
            # overlap="backward" during this backward): after running transfers.
            self._readers.wait()
        if final or self.accumulate == "cpu":
            ms.execution = self._launch(acc, ms)
        acc.micro.append(ms)
        self._micro = ms
        _compat.queue_backward_callback(lambda: self._end_backward(ms))
        return ms

    def _launch(self, acc: _Accumulation, ms: _Micro) -> Execution:
        itemsize = None
        if ms.final and self.accumulate == "gpu":
            itemsize = {i: 4 for i in acc.device_sums}
        work = FullWork(
            d2h=lambda i, j, ctx: self._d2h(ms, i, j, ctx),
            accumulate=lambda i, j, ctx: self._fold(acc, ms, i, j, ctx),
            step=lambda k, ctx: self._step_chunk(acc, k, ctx),
            h2d=lambda k, ctx: self._h2d(acc, k, ctx),
            norm=lambda ctx: self._norm(acc),
            allreduce=lambda ctx: self._allreduce_norm(acc),
        )
        graph, schedule = self._graph(final=ms.final, itemsize=itemsize, work=work)
        ex = execute(graph, schedule)
        prev = self._prev
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
        self._prev = ex
        return ex

    def _graph(self, *, final: bool, itemsize: Mapping[int, int] | None,
               work: FullWork | None) -> tuple[Any, Any]:
        params = self._full_params(itemsize)
        allreduce = self.max_norm is not None and self._world() > 1
        graph = micro_step_graph(
            self.device, params, self._chunks, final=final, slot_bytes=self.slot_bytes,
            clip=self.max_norm is not None, allreduce=allreduce,
            step_gate=self.overlap != "backward", work=work)
        return graph, micro_step_schedule(self.overlap, self.host_budget_bytes)

    def _full_params(self, itemsize: Mapping[int, int] | None) -> list[FullParam]:
        return [FullParam(name=self._pnames[i], numel=_local(p).numel(),
                          grad_itemsize=(itemsize or {}).get(i, p.dtype.itemsize),
                          weight_itemsize=p.dtype.itemsize)
                for i, p in enumerate(self._params)]

    def _world(self) -> int:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return 1
        return int(dist.get_world_size(self.process_group))

    def _end_backward(self, ms: _Micro, *, force: bool = False) -> None:
        """Autograd's end-of-backward callback: settle the gates no gradient opened.

        Under a reentrant checkpoint the first gradient may come from the backward
        its recomputation runs *inside* the user's backward: the callback then
        fires when that inner backward ends. The micro-step goes on until the
        outer one ends (:meth:`_on_grad` queues a callback there, or the next
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
        if self._micro is ms:
            self._micro = None
        ms.ended = True
        ex = ms.execution
        if ex is None:
            return
        acc = self._acc_state
        for i in range(len(self._params)):
            if i in ms.received:
                continue
            gate = ex.gate(self._gate(i))
            s = acc.device_sums.pop(i, None) if (acc is not None and ms.final) else None
            if s is not None:
                gate.open(_Shipped(s))  # only non-final micro-steps had a gradient for it
            else:
                gate.close()

    def _settle_deferred(self) -> None:
        """End a micro-step whose reentrant inner backward ended, once no backward runs."""
        ms = self._micro
        if ms is not None and ms.deferred is not None and _compat.backward_id() < 0:
            self._end_backward(ms, force=True)

    def _fail_current(self, err: BaseException) -> None:
        ms = self._micro
        self._dirty = err
        if ms is not None:
            self._abandon(ms, str(err), err)

    def _abandon(self, ms: _Micro, why: str, err: BaseException | None = None) -> None:
        """Fail what of a micro-step's execution still waits for a gate (a backward that
        never ended, a step that will not come)."""
        ms.ended = True
        if self._micro is ms:
            self._micro = None
        if err is None:
            err = GradientError(f"a micro-step was abandoned: {why}")
            self._dirty = self._dirty or err
        ex = ms.execution
        if ex is None or ex.done():
            return
        names = [self._gate(i) for i in range(len(self._params))]
        if ms.final and self.overlap != "backward":
            names.append("step")
        for name in names:
            gate = ex.gate(name)
            if gate.state == "pending":
                gate.fail(err)

    # -- task work (lanes) -------------------------------------------------------------
    def _threads(self) -> None:
        n = self.num_threads
        if n is not None and torch.get_num_threads() != n:
            torch.set_num_threads(n)  # per thread (OpenMP): this lane only

    def _piece(self, i: int, j: int, itemsize: int) -> tuple[int, int]:
        return pieces(_local(self._params[i]).numel(), itemsize, self.slot_bytes)[j]

    def _d2h(self, ms: _Micro, i: int, j: int, ctx: TaskContext) -> None:
        shipped = ctx.gate(self._gate(i))
        if shipped is None:
            return
        g = shipped.tensor
        assert g is not None
        s, e = self._piece(i, j, shipped.dtype.itemsize)
        if e > s:
            slot = ctx.buffer(f"slot:{i}.{j}", shipped.dtype)
            slot.copy_(g[s:e], non_blocking=True)
        if e == _local(self._params[i]).numel() or e == s:
            if ctx.stream is not None and not _faults.disabled("record_stream"):
                # Hazard: the caching allocator handing the gradient's memory to
                # the next allocation on the stream that made it while this
                # lane's copy still reads it.
                _accel.current().record_stream(g, ctx.stream)
            shipped.tensor = None  # the last piece is issued: free it on the device

    def _fold(self, acc: _Accumulation, ms: _Micro, i: int, j: int, ctx: TaskContext) -> None:
        self._threads()
        g = ctx.gate(self._gate(i))
        size = g.dtype.itemsize if g is not None else self._params[i].dtype.itemsize
        parts = pieces(_local(self._params[i]).numel(), size, self.slot_bytes)
        last = j == len(parts) - 1
        if g is not None:
            s, e = parts[j]
            if e > s:
                src = ctx.buffer(f"slot:{i}.{j}", g.dtype)
                _accumulate.fold(self._flat_accs[i][s:e], src, first=acc.counts[i] == 0)
            if last:
                acc.counts[i] += 1
        if last and ms.final and self.max_norm is not None and acc.counts[i] > 0:
            acc.norms[i] = _accumulate.norm(self._flat_accs[i])

    def _norm(self, acc: _Accumulation) -> None:
        self._threads()
        norms = [acc.norms[i] for i in range(len(self._params)) if acc.counts[i] > 0]
        total = (torch.linalg.vector_norm(torch.stack(norms), 2.0) if norms
                 else torch.tensor(0.0))
        self._set_clip(acc, total)

    def _set_clip(self, acc: _Accumulation, total: torch.Tensor) -> None:
        assert self.max_norm is not None
        acc.total_norm = total
        # The expressions of torch.nn.utils.clip_grad_norm_, for the same bits.
        clip_coef = self.max_norm / (total + 1e-6)
        acc.clip_coef = torch.clamp(clip_coef, max=1.0)

    def _allreduce_norm(self, acc: _Accumulation) -> None:
        import torch.distributed as dist

        assert acc.total_norm is not None
        sq = acc.total_norm.double() ** 2
        dist.all_reduce(sq, group=self.process_group)
        self._set_clip(acc, sq.sqrt().float())

    def _step_chunk(self, acc: _Accumulation, k: int, ctx: TaskContext) -> None:
        self._threads()
        hyper = ctx.gate("step") if self.overlap != "backward" else acc.hyper
        assert hyper is not None
        idx = [i for i in self._chunks[k] if acc.counts[i] > 0]
        groups: dict[int, _update.ChunkGroup] = {}
        scalars: dict[int, dict[str, Any]] = {}
        for i in idx:
            if acc.clip_coef is not None:
                self._flat_accs[i].mul_(acc.clip_coef)
            gi = self._group_of[i]
            st = self._ensure_state(i, hyper[gi])
            keys = _update.state_keys(self._probe, hyper[gi])
            order = self._orders[i]
            cg = groups.get(gi)
            if cg is None:
                cg = groups[gi] = _update.ChunkGroup(hyper[gi], [], [], [], [], [])
            scalars[i] = {k2: (v.clone() if isinstance(v, torch.Tensor) else v)
                          for k2, v in self._scalars[i].items()}
            cg.params.append(self._flat_masters[i])  # type: ignore[attr-defined]
            cg.grads.append(self._flat_accs[i])  # type: ignore[attr-defined]
            cg.staged.append({key: flat(st[key], order) for key in keys})  # type: ignore[attr-defined]
            cg.present.append(tuple(key for key in self._present[i] if key in keys))  # type: ignore[attr-defined]
            cg.scalars.append(scalars[i])  # type: ignore[attr-defined]
        if groups:
            _update.step_chunk(_update.make_shadow(self._probe), list(groups.values()))
        for i in idx:
            self._scalars[i] = scalars[i]
            self._present[i] = _update.state_keys(self._probe, hyper[self._group_of[i]])
            self._stepped.add(id(self._params[i]))
        if idx:
            w = ctx.buffer(f"w:{k}")
            for i, off, n, dtype in self._weight_slices(k):
                if acc.counts[i] > 0 and n:
                    _accumulate.cast_into(w[off:off + n * dtype.itemsize].view(dtype),
                                          self._flat_masters[i])

    def _weight_slices(self, k: int) -> Iterator[tuple[int, int, int, torch.dtype]]:
        off = 0
        for i in self._chunks[k]:
            p = self._params[i]
            n = _local(p).numel()
            yield i, off, n, p.dtype
            off += -(-(n * p.dtype.itemsize) // 64) * 64

    @torch.no_grad()
    def _h2d(self, acc: _Accumulation, k: int, ctx: TaskContext) -> None:
        if not any(acc.counts[i] > 0 for i in self._chunks[k]):
            return
        w = ctx.buffer(f"w:{k}")
        for i, off, n, dtype in self._weight_slices(k):
            if acc.counts[i] > 0 and n:
                loc = _local(self._params[i])
                flat(loc, self._orders[i]).copy_(w[off:off + n * dtype.itemsize].view(dtype),
                                                 non_blocking=True)
                self._versions[i] = loc._version  # our own write, not an external one

    # -- stepping ----------------------------------------------------------------------
    def _capture_hyper(self) -> list[dict[str, Any]]:
        return [{k: snapshot(v) for k, v in g.items() if k != "params"}
                for g in self.param_groups]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        """Step on the accumulated gradients: wait for the chunks, or launch them and
        return (``overlap="forward"``, or ``"backward"`` after :meth:`attach`).

        Raises:
            ConfigError: a closure (the gradients come from hooks, not from a
                re-evaluation); ``param_groups`` edited after the final backward
                began under ``overlap="backward"``; compiled autograd or
                flush-to-zero switched on.
            StepFailedError: a gradient copy or add failed (``zero_grad()`` clears
                it), an earlier step failed after writing some masters (load a
                checkpoint), or the device weights are stale after a failed copy
                (call :meth:`refresh_device_weights`).
            StepTimeoutError: a gradient never came (``timeout``), naming it.
        """
        if closure is not None:
            raise ConfigError("FullOffloadOptimizer.step() takes no closure: the gradients "
                              "arrive from the backward's hooks, so a closure's backward "
                              "cannot be re-run inside step()")
        self._refuse_environment()
        self.wait_for_step()
        self._check_usable()
        self._sync_with_model()
        acc = self._acc_state
        if acc is None:
            return None  # no gradient at all: nothing steps, as in torch
        self._settle_deferred()
        if self._micro is not None:
            ms = self._micro
            self._abandon(ms, "step() was called before its backward finished")
            if ms.execution is not None:
                settle(ms.execution, timeout=self.timeout)  # failed by _abandon
        if self._dirty is not None or any(
                ms.execution is not None and ms.execution.done()
                and ms.execution.exception is not None for ms in acc.micro):
            # Something failed: let every execution of this step settle, then say
            # what the failure left (a final micro-step may have stepped chunks).
            for ms in acc.micro:
                ex = ms.execution
                if ex is None:
                    continue
                self._abandon(ms, "an earlier failure of this step",
                              GradientError("an earlier failure of this step"))
                settle(ex, timeout=self.timeout)  # its failure is classified below
                if ex.exception is not None:
                    self._dirty = self._dirty or ex.exception
                if ms.final and ex.done():
                    self.last_trace = ex.trace
                    cause = ex.exception or self._dirty
                    assert cause is not None
                    self._classify(ex, cause)
            self._check_usable()
        if self._dirty is not None:
            raise StepFailedError(
                "a gradient copy or accumulation of this step failed; step() refuses until "
                "opt.zero_grad() clears the accumulated gradients") from self._dirty
        hyper = self._capture_hyper()
        if acc.final is None:
            self._launch_final_now(acc)
        fin = acc.final
        assert fin is not None and fin.execution is not None
        if self.overlap == "backward":
            if not _same(hyper, acc.hyper):
                self._inflight = (acc, fin)
                self._acc_state = None
                self.wait_for_step()
                raise ConfigError(
                    "param_groups changed after the final backward began: under "
                    "overlap='backward' the chunks step during that backward with the "
                    "hyperparameters of that moment (this step used those); change "
                    "hyperparameters (an LR scheduler's step()) after opt.step()")
        else:
            fin.execution.gate("step").open(hyper)
        self._inflight = (acc, fin)
        self._acc_state = None
        asynchronous = self.overlap == "forward" or (
            self.overlap == "backward" and self._attached is not None)
        if asynchronous and self._attached is None and _compat.runs_compiled(self.model):
            # Hazard: compiled code reading weights the step still writes; it
            # cannot wait per parameter, and only attach()'s hooks run in it.
            if not self._warned_compiled:
                self._warned_compiled = True
                warnings.warn(
                    "FullOffloadOptimizer: the model runs compiled code and the optimizer "
                    "is not attached, so step() waits for the whole step (no overlap); call "
                    "opt.attach(): its hooks run before every module, compiled or not",
                    RuntimeWarning, stacklevel=2)
            asynchronous = False
        if not asynchronous:
            try:
                self.wait_for_step()
            except KeyboardInterrupt as err:
                # A synchronous step is all or nothing for its caller: let it
                # finish, then pass the interrupt on. (A second interrupt leaves
                # it in flight; wait_for_step() ends it.)
                self.wait_for_step()
                err.add_note("pipeoff: the step completed before the interrupt was passed "
                             "on; do not step again for the same gradients.")
                raise
            return None
        layout = _WaitLayout(self._params, self._chunks_of, self.device)
        wait_step: Any = _WaitStep(
            fin.execution, tuple(f"h2d:{k}" for k in range(len(self._chunks))))
        self._waits.begin(wait_step, layout, sorted(acc.touched))  # type: ignore[arg-type]
        if "norm_allreduce" in fin.execution.plan.order:
            # Hazard: the lane's all-reduce of the norm and the caller's next
            # collectives (FSDP2's all-gathers in the next forward) issued on
            # one process group from two threads, in an order that may differ
            # between ranks. The norm is known once the backward is over.
            try:
                settle(fin.execution, "norm_allreduce", timeout=self.timeout)
            except BaseException as err:
                err.add_note("pipeoff: interrupted while waiting for the clipping norm's "
                             "all-reduce; the step goes on (the forward waits for its "
                             "weights) and must not be repeated. Call wait_for_step() to "
                             "wait for it.")
                raise
        return None

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """The total gradient norm (before clipping) of the last ``step()``, as
        ``clip_grad_norm_`` returns it: a 0-dim FP32 CPU tensor; ``None`` without
        ``max_norm`` or before a step. Waits for the norm of a step in flight (not
        for its chunks)."""
        if self.max_norm is None:
            return None
        inflight = self._inflight
        if inflight is not None:
            acc, fin = inflight
            assert fin.execution is not None
            task = "norm_allreduce" if "norm_allreduce" in fin.execution.plan.order else "norm"
            fin.execution.wait(task, timeout=self.timeout)
            return acc.total_norm
        return self._grad_norm

    def _classify(self, ex: Execution, err: BaseException) -> None:
        """Set the state a failed final execution leaves, and say so on ``err``:
        nothing stepped (dirty: ``zero_grad()`` clears it), every chunk stepped but
        a weight copy failed (stale: ``refresh_device_weights()``), or some chunks
        stepped (torn: load a checkpoint)."""
        stepped = [k for k in range(len(self._chunks))
                   if ex.events_for(f"step:{k}")[0].status == "ok"]
        if stepped and ex.exception is None:
            # The execution ran to the end, but this step failed elsewhere (a
            # gradient refused during the final backward): chunks stepped on it.
            self._torn = (f"this step failed ({err}) after chunk(s) {stepped} had "
                          "stepped their masters during the backward")
            return
        if not stepped:
            self._dirty = err
            err.add_note("pipeoff: no master was stepped; step() refuses until "
                         "opt.zero_grad()")
        elif len(stepped) == len(self._chunks):
            self._stale = err
            err.add_note("pipeoff: every master was stepped, but device weights were "
                         "not all written; call opt.refresh_device_weights()")
        else:
            self._torn = (f"a step failed in {ex.failed_task!r} after chunk(s) "
                          f"{stepped} had stepped their masters")
            err.add_note(f"pipeoff: {self._torn}; later steps are refused until a "
                         "checkpoint is loaded")

    def _launch_final_now(self, acc: _Accumulation) -> None:
        """``step()`` without a final backward: a final micro-step with no gradient of its own."""
        ms = _Micro(final=True, execution=None)
        acc.final = ms
        if self.overlap == "backward":
            acc.hyper = self._capture_hyper()
        ms.execution = self._launch(acc, ms)
        acc.micro.append(ms)
        self._end_backward(ms)

    def _check_usable(self) -> None:
        if self._torn is not None:
            raise StepFailedError(
                f"{self._torn}; the masters are partly stepped. Load a checkpoint "
                "(opt.load_state_dict) to go on")
        if self._stale is not None:
            raise StepFailedError(
                "the device weights are stale (a host-to-device copy failed after the "
                "masters were stepped); call opt.refresh_device_weights()") from self._stale

    def wait_for_step(self) -> None:
        """Block until the step in flight (if any) has written every weight.

        Raises:
            BaseException: the failure of a task of the step, with its traceback;
                see :meth:`step` for what is refused afterwards.
        """
        inflight = self._inflight
        if inflight is None:
            return
        acc, fin = inflight
        ex = fin.execution
        assert ex is not None
        try:
            ex.wait(timeout=self.timeout)
        except BaseException as err:
            if not is_failure_of(err, ex):
                raise  # interrupted or timed out: still in flight
            self._inflight = None
            self._waits.end()
            self.last_trace = ex.trace
            self._classify(ex, err)
            root = _root_cause(acc, err)
            if root is not err:
                raise root from err
            raise
        self._inflight = None
        self._waits.end()
        self.last_trace = ex.trace
        self._grad_norm = acc.total_norm
        acc.device_sums.clear()

    def completion_for(self, param: torch.Tensor) -> tuple[Completion, ...]:
        """The completions of the tasks of the step in flight that write ``param``'s
        master, moments and device weight (empty if none does): a readiness for
        :class:`~pipeoff.transfer.LiveTensor`, finer than :meth:`wait_for_step`.

        Raises:
            ConfigError: ``param`` is not one of this optimizer's parameters.
        """
        i = index_of(self._params, param)
        inflight = self._inflight
        if inflight is None or inflight[1].execution is None:
            return ()
        ex = inflight[1].execution
        return completions(ex, [n for k, chunk in enumerate(self._chunks) if i in chunk
                                for n in (f"step:{k}", f"h2d:{k}")])

    def live_state(self, param: torch.Tensor,
                   key: str) -> tuple[torch.Tensor, tuple[Completion, ...]]:
        """The host tensor of ``param``'s FP32 ``"master"`` or per-element state ``key``
        (``"exp_avg"``, ...) and its :meth:`completion_for`; used by
        :meth:`pipeoff.transfer.LiveTensor.from_optimizer`. Does not wait.

        Raises:
            ConfigError: ``param`` is not a parameter of this optimizer, or it has no
                state ``key`` (yet: moments exist from the first ``step()`` on).
            StepFailedError: an earlier step failed after writing some masters.
        """
        if self._torn is not None:
            raise StepFailedError(f"{self._torn}; its state is partly stepped")
        i = index_of(self._params, param)
        host = self._masters[i] if key == "master" else self._state[i].get(key)
        if host is None:
            raise ConfigError(
                f"parameter {i} has no state {key!r} (it has 'master' and "
                f"{sorted(self._state[i])}; moments exist from the first step() on)")
        return host, self.completion_for(param)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the accumulated gradients (and a failed accumulation); ``param.grad``
        is ``None`` already. A step in flight goes on.

        Under ``overlap="backward"`` the final backward has stepped already: a
        ``zero_grad()`` without ``step()`` after it cannot skip that step (it
        warns); to skip steps (a non-finite loss), use ``overlap="forward"``.
        """
        self._settle_deferred()
        acc = self._acc_state
        if acc is not None:
            if self._micro is not None:
                self._abandon(self._micro, "zero_grad() was called inside its backward")
            fin = acc.final
            if (self.overlap == "backward" and fin is not None and fin.execution is not None
                    and self._dirty is None):
                warnings.warn(
                    "zero_grad() after the final backward without step(): under "
                    "overlap='backward' that backward has stepped already (the step is "
                    "kept); call step() to wait for it, or use overlap='forward' to be "
                    "able to skip a step", RuntimeWarning, stacklevel=2)
                self._inflight = (acc, fin)
                self._acc_state = None
                self.wait_for_step()
                acc = None
        if acc is not None:
            for ms in acc.micro:
                ex = ms.execution
                if ex is not None:
                    # Discarded: a gate left pending (the step's, or a backward
                    # that never ended) would hold its lanes until the timeout.
                    self._abandon(ms, "zero_grad() discarded the micro-step",
                                  GradientError("zero_grad() discarded this micro-step"))
                    settle(ex, timeout=self.timeout)  # its failure is classified below
                    cause = ex.exception or self._dirty
                    if ms.final and ex.done() and cause is not None:
                        # Chunks that stepped before the failure make a torn step,
                        # which zero_grad() does not clear.
                        self._classify(ex, cause)
        self._acc_state = None
        self._dirty = None
        for p in self._params:
            p.grad = None

    def refresh_device_weights(self) -> None:
        """Write every device weight from its master (the truth), e.g. after a failed copy."""
        self._quiesce_keeping_failures()
        with torch.no_grad():
            for i, p in enumerate(self._params):
                loc = _local(p)
                flat(loc, self._orders[i]).copy_(self._flat_masters[i])
                self._versions[i] = loc._version
        self._stale = None

    def _discard_accumulation(self) -> None:
        acc = self._acc_state
        if acc is not None:
            for ms in acc.micro:
                if ms.execution is not None:
                    self._abandon(ms, "discarded", GradientError("discarded"))
                    settle(ms.execution, timeout=self.timeout)  # failed by _abandon
        self._acc_state = None
        self._micro = None
        self._dirty = None

    def refresh_masters(self) -> None:
        """Make every master the (widened) device weight, after something other than this
        optimizer wrote the weights through ``.data`` (which bumps no version
        counter): a committed LocalSGD average (``pipeoff.ft.LocalSGD`` calls this
        itself). Other writes (``model.load_state_dict``) are noticed at the next
        step without it.

        Without it the next step would overwrite those weights with the old masters.
        The masters' bits below the compute dtype's precision are lost.
        """
        self._readers.wait()
        self._quiesce()
        self._accel_sync()
        with torch.no_grad():
            for i, p in enumerate(self._params):
                loc = _local(p)
                self._flat_masters[i].copy_(flat(loc, self._orders[i]))
                self._versions[i] = loc._version

    # -- checkpoints -------------------------------------------------------------------
    def _state_entries(self) -> dict[torch.Tensor, dict[str, Any]]:
        out: dict[torch.Tensor, dict[str, Any]] = {}
        for i, p in enumerate(self._params):
            if id(p) not in self._stepped and not self._scalars[i] and not self._present[i]:
                continue
            entry: dict[str, Any] = dict(self._scalars[i])
            for key in self._present[i]:
                entry[key] = _wrap_like(p, self._state[i][key])
            entry["master"] = _wrap_like(p, self._masters[i])
            out[p] = entry
        return out

    @property  # type: ignore[override]
    def state(self) -> Any:
        """Per parameter with a step, torch's state (host FP32 tensors) plus ``"master"``."""
        if getattr(self, "_building", True):
            return self.__dict__.setdefault("_base_state", {})
        self._quiesce()
        import collections

        return collections.defaultdict(dict, self._state_entries())

    @state.setter
    def state(self, value: Any) -> None:
        self.__dict__["_base_state"] = value

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state dict (host tensors), each entry with its FP32 ``"master"``.

        Raises:
            StepFailedError: the last step failed after stepping some masters.
        """
        self._quiesce()
        if self._torn is not None:
            raise StepFailedError(f"{self._torn}; its state is partly stepped")
        entries = self._state_entries()
        ids: dict[int, int] = {}
        groups = []
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = [ids.setdefault(id(p), len(ids)) for p in g["params"]]
            groups.append(packed)
        state = {ids[id(p)]: v for p, v in entries.items()}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load torch's format (with or without ``"master"`` entries); then every device
        weight is written from its master. Either all is loaded or nothing.

        Clears a failed or torn step. Creating state never steps the optimizer.

        Raises:
            ConfigError: not an optimizer state dict, groups of other sizes, or a
                state tensor of another size than its parameter.
        """
        self._readers.wait()
        self._quiesce_keeping_failures()
        if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= state_dict.keys():
            raise ConfigError("load_state_dict expects an optimizer state dict (a dict with "
                              f"'state' and 'param_groups'), got {type(state_dict).__name__}")
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
                len(s["params"]) != len(g["params"])
                for s, g in zip(saved_groups, self.param_groups)):
            raise ConfigError(
                "the state dict's param groups do not match this optimizer's: "
                f"{[len(s['params']) for s in saved_groups]} parameters per group saved, "
                f"{[len(g['params']) for g in self.param_groups]} here")
        by_id = {}
        for s, g in zip(saved_groups, self.param_groups):
            for pid, p in zip(s["params"], g["params"]):
                by_id[pid] = self._pidx[id(p)]
        plan: list[tuple[int, dict[str, Any]]] = []
        for pid, entry in state_dict["state"].items():
            if pid not in by_id:
                raise ConfigError(f"the state dict has state for parameter {pid!r}, which no "
                                  "param group lists")
            i = by_id[pid]
            n = _local(self._params[i]).numel()
            for key, val in entry.items():
                if isinstance(val, torch.Tensor) and val.dim() > 0 and _local(val).numel() != n:
                    raise ConfigError(
                        f"state {key!r} of {self._pnames[i]!r} has {_local(val).numel()} "
                        f"elements, the parameter {n}")
            plan.append((i, entry))
        # Checked: now write. Gradients accumulated so far belong to the state
        # being replaced.
        self._discard_accumulation()
        self._accel_sync()
        for s, g in zip(saved_groups, self.param_groups):
            for k, v in s.items():
                if k != "params":
                    g[k] = v
        for i in range(len(self._params)):
            self._scalars[i] = {}
            self._present[i] = ()
            self._stepped.discard(id(self._params[i]))
        with torch.no_grad():
            # A parameter without an entry (never stepped: no gradient yet, or an
            # optimizer without per-parameter state) has the model's weight as its
            # master: load the model's state dict first.
            entries = {i for i, _ in plan}
            for i, p in enumerate(self._params):
                if i not in entries:
                    self._flat_masters[i].copy_(flat(_local(p), self._orders[i]))
            for i, entry in plan:
                p = self._params[i]
                order = self._orders[i]
                keys = []
                st = self._ensure_state(i, self.param_groups[self._group_of[i]])
                for key, val in entry.items():
                    if isinstance(val, torch.Tensor) and val.dim() > 0:
                        src = flat_like(_local(val), order)
                        if key == "master":
                            self._flat_masters[i].copy_(src)
                        else:
                            if key not in st:
                                st[key] = host_alloc([(_local(p).shape, torch.float32, order)],
                                                     False)[0]
                            flat(st[key], order).copy_(src)
                            keys.append(key)
                    else:
                        self._scalars[i][key] = (val.detach().clone().cpu()
                                                 if isinstance(val, torch.Tensor) else val)
                self._present[i] = tuple(keys)
                self._stepped.add(id(p))
                if "master" not in entry:
                    self._masters[i].copy_(_local(p))
        self._torn = None
        self._dirty = None
        self._acc_state = None
        self.refresh_device_weights()

    def trace_summary(self) -> Any:
        """The summary of the last step's trace (``None`` before one finished)."""
        return None if self.last_trace is None else self.last_trace.summary()
