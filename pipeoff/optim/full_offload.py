"""FullOffloadOptimizer: gradients, FP32 masters and optimizer state in host memory.

The full-offload half of prime-rl #4221 (``../shared/REFERENCE.md`` §3, §5). Only the
compute weights stay on the device. Each gradient goes to the host as autograd finalizes
it and is folded into an FP32 accumulator; the optimizer's CPU kernels step FP32 masters
in chunks, whose casts go back to the device. This class is the thin orchestrator; its
parts are in ``pipeoff/optim/_full_offload/``.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal

import torch

from pipeoff import _compat
from pipeoff._contract import Health
from pipeoff._errors import ConfigError
from pipeoff._held_interrupt import step_note
from pipeoff._lowlevel import settle, train_span
from pipeoff._validate import parse_bytes
from pipeoff.execution import Execution
from pipeoff.optim._foreign import optimizer_class_of, refuse_foreign
from pipeoff.optim._full_offload import _common, _host_kernel, _intake
from pipeoff.optim._full_offload._auto import numeric, resolve
from pipeoff.optim._full_offload._common import Phase, capture_hyper, same_hyper
from pipeoff.optim._full_offload._config import (
    DEFAULT_SLOT_BYTES,
    Accumulate,
    FullOffloadConfig,
    Overlap,
    check_clip_args,
    check_model,
    chunk_numel_of,
    model_and_params,
    refuse_environment,
)
from pipeoff.optim._full_offload._device_part import FullDevicePart
from pipeoff.optim._full_offload._finder import ModelFinder
from pipeoff.optim._full_offload._fraction import FractionLifecycle
from pipeoff.optim._full_offload._graph import NORM_ALLREDUCE
from pipeoff.optim._full_offload._model_sync import ModelSync, late_write_message
from pipeoff.optim._full_offload._param import ParamRegistry
from pipeoff.optim._full_offload._reports import HostReports
from pipeoff.optim._full_offload._surface import MastersAndCheckpoints
from pipeoff.optim._full_offload._traces import StepTraces
from pipeoff.optim._offloaded import Offloaded
from pipeoff.optim._readers import Readers
from pipeoff.optim._waits import ForwardWaits

__all__ = ["FullOffloadOptimizer"]


class FullOffloadOptimizer(MastersAndCheckpoints, HostReports, Offloaded, torch.optim.Optimizer):
    """Full offload: FP32 masters, optimizer state and a gradient accumulator in host memory.

    Only ``model``'s compute weights stay on the device; the host holds 16
    bytes per parameter (AdamW: FP32 master, two moments, FP32 gradient sum),
    pinned where an accelerator is present. Gradients accumulate until
    ``step()``, as with any optimizer; marking non-final micro-steps with
    :meth:`no_sync` (or FSDP2's ``set_requires_gradient_sync(False)``, DDP's
    ``no_sync()``), or giving ``gradient_accumulation_steps``, lets the last backward
    also take the norm (or hold its gradients for a one-pass step) and, under
    ``overlap="backward"``, step while it runs. The end of each backward is
    detected without a call. Under DDP (torch's or torchft's, around the model
    before or after this optimizer was built) the gradient stepped is the one
    DDP reduced.

    * ``accumulate="cpu"`` (prime-rl's default): each gradient goes to the host
      as autograd finalizes it (``register_post_accumulate_grad_hook``),
      through a ring of pinned slots, and a host lane folds it into the FP32
      accumulator: a widening copy first, adds after. ``param.grad`` is
      released at once. ``accumulate="gpu"``: non-final micro-steps sum into
      an FP32 device accumulator (4 bytes per parameter, freed after each
      step), shipped once in the final backward.
    * ``overlap="forward"`` (the default): ``step()`` launches the chunks and
      returns; each module's forward waits for its weights (as
      ``OffloadOptimizer(mode="overlap")``). ``overlap="backward"``: a chunk
      steps on a host lane as soon as its parameters' final gradients have
      landed, and its weights go back during the backward; ``step()`` waits, or
      with :meth:`attach` returns at once. Every backward not marked non-final
      steps, and the step uses the hyperparameters in ``param_groups`` when it
      began. ``overlap="none"``: the synchronous schedule, the reference.
    * ``max_norm``: clip the global gradient norm as
      ``torch.nn.utils.clip_grad_norm_`` does (the norm of each parameter's
      sum is taken in its final accumulation, while hot in cache, then one
      scalar, summed over the mesh dimensions the parameters are sharded on).
      Needs ``overlap="forward"`` or ``"none"``: no chunk may step before the
      norm of every gradient is known. :attr:`grad_norm` is computed always;
      :meth:`clip_grad_norm_` clips one step.

    Results are bitwise those of the reference: per parameter the FP32 left
    fold of its micro-step gradients (each widened, the first copied, missing
    ones skipped), ``optimizer_class`` stepping FP32 masters on the CPU with
    the same hyperparameters, weights = masters cast to the compute dtype.

    Two forms, as torchao's ``CPUOffloadOptimizer`` and torch's optimizers take them::

        FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-4)           # the model's parameters
        FullOffloadOptimizer(param_groups, optimizer_class=torch.optim.AdamW, lr=1e-4)

    Given parameters (or param groups) alone, as the HF Trainer's
    ``optimizer_cls_and_kwargs`` builds it, the optimizer finds its model at the
    first forward that runs a module holding all of them (a global forward
    pre-hook, removed then); until then it works without one (no DDP wrapper put
    around the model later is noticed, parameters are named by their place in the
    groups).

    Args:
        model: the module whose trainable parameters are optimized, or the parameters
            (named parameters, param group dicts) themselves.
        optimizer_class: an element-wise ``torch.optim`` class (default ``AdamW``, as
            torchao's; ``Adam``,
            ``SGD``, ``Adagrad``, ``RMSprop``). With ``fused=True``, ``Adam``/``AdamW``
            step in pipeoff's native one-pass kernel, bitwise torch's fused CPU
            AdamW but for the sign and payload of NaNs (checked at first use;
            :func:`pipeoff.optim.host_step_status` says which runs), else in torch's.
        params: with a model: parameters, named parameters or param groups (dicts),
            all of ``model``'s; default: every parameter of ``model`` that requires grad
            (one unfrozen later warns at its first gradient; ``add_param_group`` it).
        accumulate: ``"cpu"`` or ``"gpu"``.
        overlap: ``"forward"``, ``"backward"`` or ``"none"``.
        max_norm: clip gradients to this global 2-norm (a positive float), or ``None``.
        chunk_numel: most elements in one optimizer chunk (whole parameters; default
            16 Mi).
        chunk_bytes: or the most bytes of FP32 masters in one chunk (4 per element),
            as ``OffloadOptimizer`` takes it; one of the two. Byte sizes may be
            strings (``"256MiB"``; ``"1GB"`` is 10**9).
        slot_bytes: bytes of one pinned host slot (a gradient larger ships in pieces).
        pin_memory: page-lock the host state (masters, moments, sums) when an
            accelerator holds the weights, as ``OffloadOptimizer`` and FSDP2's
            ``CPUOffloadPolicy`` do; ``False`` keeps it pageable (slower copies).
        slots: host slots in the ring; host staging is at most ``slots * slot_bytes``
            plus two chunks' weights.
        num_threads: CPU threads of each host lane's kernels: of each native kernel
            call, and ``torch.set_num_threads`` on that lane for torch's (per
            thread; the caller's count is untouched). ``None``: native kernels take
            this rank's share of its CPUs (its affinity mask over
            ``LOCAL_WORLD_SIZE``), torch's keep its default. Two host lanes
            (accumulate, step) run at once, beside the dataloader's workers.
        process_group: the group the squared gradient norm is summed over, for
            parameters sharded by hand (default: the mesh dimensions each DTensor
            parameter is sharded on; none for parameters every rank holds whole).
        timeout: seconds ``step()`` waits before ``StepTimeoutError`` (naming missing grads).
        offload_fraction: the share of masters, state and gradient sums in host memory, in
            [0, 1] (``0.0``: all on the device; the same on every rank), or ``"auto"``: the
            fastest that fits ``device_budget_bytes`` (default on CUDA: the free memory).
        gradient_accumulation_steps: backwards per step, where every step has as many (1:
            no accumulation): the last is then final as it begins, as if those before
            were in :meth:`no_sync`, so its BF16 gradients step in one pass. A step with
            fewer (``step()`` ends it) is exact too; one more raises ``GradientError``.
        **defaults: the optimizer's hyperparameters (``lr``, ``weight_decay``...).

    Raises:
        ConfigError: an argument is out of range or not supported (``offload_fraction`` outside
            [0, 1]...); a parameter is not in ``model``, listed twice, not dense, or under
            FSDP2's ``CPUOffloadPolicy`` or torchft's ``PureDistributedDataParallel``;
            ``max_norm`` with ``overlap="backward"``; both ``chunk_numel`` and ``chunk_bytes``;
            flush-to-zero or compiled autograd is on.
        PlanMismatchError: under FSDP2, ranks passed different ``offload_fraction`` values.
        UnsupportedOptimizerError: ``optimizer_class`` is not element-wise.
    """

    def __init__(
        self,
        model: torch.nn.Module | Iterable[Any],
        optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
        *,
        params: Iterable[Any] | None = None,
        accumulate: Accumulate = "cpu",
        overlap: Overlap = "forward",
        max_norm: float | None = None,
        chunk_numel: int | None = None,
        chunk_bytes: int | str | None = None,
        slot_bytes: int | str = DEFAULT_SLOT_BYTES,
        pin_memory: bool = True,
        slots: int = 4,
        num_threads: int | None = None,
        process_group: Any = None,
        timeout: float = 600.0,
        offload_fraction: float | Literal["auto"] = 1.0,
        device_budget_bytes: int | str | None = None,
        gradient_accumulation_steps: int | None = None,
        **defaults: Any,
    ) -> None:
        params, found = model_and_params(model, params)
        refuse_foreign(defaults, "FullOffloadOptimizer")
        defaults.pop("offload_gradients", None)  # (True: what this does)
        chunk_numel = chunk_numel_of(chunk_numel, chunk_bytes)
        config = FullOffloadConfig(
            optimizer_class=optimizer_class_of(optimizer_class), accumulate=accumulate,
            overlap=overlap, max_norm=max_norm, chunk_numel=chunk_numel, pin_memory=pin_memory,
            slot_bytes=parse_bytes(slot_bytes, name="slot_bytes"), slots=slots,
            num_threads=num_threads, process_group=process_group, timeout=timeout,
            defaults=defaults, offload_fraction=numeric(offload_fraction),
            gradient_accumulation_steps=gradient_accumulation_steps)
        refuse_environment()
        # Hazard: a compile session that began before the first chunk's math (is_compiling()
        # is process-wide) steering torch.optim into its compiled-code branches on a lane.
        _compat.eager_math()
        probe = config.probe()
        config, self.offload_choice, params = resolve(  # "auto"'s choice (else None), config
            config, offload_fraction, params, found, probe, device_budget_bytes)
        # Decide the native host step now, on the caller's thread and before any
        # parameter is taken: its fallback warning (an error under -W error) then
        # leaves nothing half-built. (A group's own fused=True: at step().)
        _host_kernel.warn_if_off(config.optimizer_class, [probe.defaults])
        # The arguments, as given (read-only: the config is what runs).
        self.model: torch.nn.Module | None = found
        """The model (``None`` until found, for an optimizer built from parameters)."""
        self._config = config
        self.optimizer_class = config.optimizer_class
        self.accumulate, self.overlap = config.accumulate, config.overlap
        self.max_norm, self.chunk_numel = config.max_norm, config.chunk_numel
        self.slot_bytes, self.slots, self.num_threads = (config.slot_bytes, config.slots,
                                                         config.num_threads)
        self.process_group, self.timeout = config.process_group, config.timeout
        self.gradient_accumulation_steps = config.gradient_accumulation_steps
        # The parameters and their host state; the lifecycle (the accumulation and the
        # step in flight); the model sync; the hooks (the intake calls down to both).
        self._registry = ParamRegistry(found, config, probe)
        self._health = Health()  # what a failed step left: torn, dirty, stale
        self._readers = Readers()  # state transfers reading the host state
        self._lifecycle = FractionLifecycle(self._registry, config, self._health, self._readers,
                                            lambda: self.param_groups,
                                            part=FullDevicePart(config.offload_fraction))
        self._model_sync = ModelSync(self._registry, self._lifecycle, config, self._readers,
                                     lambda: self.param_groups)
        self._intake = _intake.GradientIntake(self._lifecycle, self._model_sync)
        # Forward hooks (attach()); the ended step's traces.
        self._waits = ForwardWaits(self.wait_for_step)
        self._traces = StepTraces(self._lifecycle, self._waits, self.offload_choice)
        self._attach_handles: list[Any] = []
        self._attached: torch.nn.Module | None = None
        self._handed_over = 0  # steps launched (step() without gradients launches none)
        self._warned_compiled = False
        self._finder: ModelFinder | None = None
        if params is None:  # (the model form's default)
            params = self._intake.trainable_of(found)
        self._building = True
        try:
            super().__init__(list(params), probe.defaults)
        except ValueError as err:
            if isinstance(err, ConfigError):
                raise
            raise ConfigError(f"params: {err}") from None
        self._building = False
        self._lifecycle.split(probe)  # the device part (offload_fraction < 1)
        self._reindex()
        if found is not None:
            self._train_spans_on(found)  # forward and backward on a recorded trace's train row
        else:
            self._finder = ModelFinder(self._lifecycle.all_tensors, self._found_model)

    def _reindex(self) -> None:
        """Index the parameters of ``param_groups`` anew, and hook the new ones."""
        self._model_sync.reindex()
        self._intake.ensure_hooks()

    def _found_model(self, model: torch.nn.Module) -> bool:
        """The model of an optimizer built from parameters, seen in a forward: take it
        (between steps; mid-step it is taken at a later forward)."""
        if self._lifecycle.acc is not None or self._lifecycle.inflight is not None:
            return False
        check_model(model)
        self._registry.adopt_model(model)
        self.model = model
        self._reindex()
        self._model_sync.note_state_dict()  # (its state_dict() may have been written through)
        self._train_spans_on(model)
        return True

    # -- set-up ------------------------------------------------------------------------
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
            if self._lifecycle.phase is not Phase.IDLE:
                raise ConfigError("add_param_group() between a backward and step(): call it "
                                  "after step() and zero_grad()")
        group = self._registry.check_group(param_group, self.param_groups)
        before = list(self.param_groups)
        super().add_param_group(group)
        if not self._building:
            try:
                self._reindex()
            except BaseException:
                self.param_groups[:] = before
                self._reindex()
                raise

    # -- the Optimizer surface -------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("FullOffloadOptimizer cannot be pickled; save state_dict() instead")

    def __repr__(self) -> str:
        return (f"FullOffloadOptimizer({self.optimizer_class.__name__}, "
                f"accumulate={self.accumulate!r}, overlap={self.overlap!r}, "
                f"max_norm={self.max_norm!r}, {self._params_repr()})")

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Mark the backwards inside as non-final micro-steps (the convention of DDP's
        ``no_sync()``): their gradients are accumulated and nothing steps."""
        self._lifecycle.settle_deferred()
        self._intake.no_sync_depth += 1
        try:
            yield
        finally:
            self._intake.no_sync_depth -= 1

    def attach(self, model: torch.nn.Module | None = None) -> None:
        """Make ``model``'s forward (default: the optimizer's) wait, per module, for the
        weights a step still writes; ``step()`` then returns at once under
        ``overlap="backward"`` too.

        Raises:
            ConfigError: ``model`` is not a module, or lacks some parameters.
        """
        if model is None and self.model is None:
            raise ConfigError(
                "attach() needs the model: this FullOffloadOptimizer was built from "
                "parameters and has not seen its model's forward yet; call attach(model)")
        target = self.model if model is None else model
        assert target is not None
        super().attach(target)

    def _stepped_params(self) -> list[torch.Tensor]:
        return self._registry.tensors()

    # -- stepping ----------------------------------------------------------------------
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Step on the accumulated gradients: wait for the chunks, or launch them and
        return (``overlap="forward"``, or ``"backward"`` after :meth:`attach`).

        The gradients are those the backwards since the last step delivered, plus any
        set by hand in ``param.grad`` (``torch.distributed.checkpoint`` creates state
        that way). ``closure`` (Lightning's automatic optimization passes one) is
        called once, with gradients enabled, before the step, and its result is
        returned; its backward is a micro-step like any other.

        Raises:
            ConfigError: ``param_groups`` edited after the final backward began under
                ``overlap="backward"``; compiled autograd or flush-to-zero switched on.
            GradientError: a gradient set by hand is not of the parameter's dtype and
                device.
            StepFailedError: a gradient copy or add failed (``zero_grad()`` clears
                it), an earlier step failed after writing some masters (load a
                checkpoint), or the device weights are stale after a failed copy
                (call :meth:`refresh_device_weights`).
            StepTimeoutError: a gradient never came (``timeout``), naming it.
            KeyboardInterrupt: Ctrl-C while waiting; a synchronous step completes
                first, an asynchronous one goes on (see the exception's note).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        step, start, handed = self._steps_called, time.perf_counter_ns(), self._handed_over
        hooks = self._stats_hook_ns  # (the hooks' time in this call: not the step's)
        with torch.no_grad(), train_span("step", step):  # (while a region is recorded)
            if self._stats_pending is not None and self._stats_hooks:
                self.wait_for_step()  # (_step waits for it anyway, first thing: timed)
                self._emit_stats()  # the last step's figures, now that it has finished
            try:
                # A Ctrl-C held back (the device part, the withdraw), passed on after.
                with self._lifecycle.part.interrupt.passed_on(
                        lambda: step_note(self._lifecycle.inflight is None)):
                    self._step()
            finally:
                self._steps_called += 1
                if self._handed_over != handed:  # (a step without gradients steps nothing)
                    self._stats_after_step(step, self._exposed_since(start, hooks))
        return loss

    def _step_finished(self) -> bool:
        return self._lifecycle.inflight is None

    def _step(self) -> None:
        refuse_environment()
        _host_kernel.warn_if_off(self.optimizer_class, self.param_groups)
        self.wait_for_step()
        self._health.check("step()")
        _intake.at_step(self._intake)
        micro = self._lifecycle
        if micro.phase is Phase.IDLE:
            # A failure that stepped nothing, surfaced after step(): refused until zero_grad().
            self._health.check_dirty("step()")
            if not micro.begin_from_params():
                return None  # no gradient at all: nothing steps, as in torch
        micro.close_open_backward("step() was called before its backward finished")
        if self._health.dirty is not None or (micro.acc is not None and micro.acc.failed()):
            settled = micro.settle_failure()
            if settled is not None:
                self.last_trace = settled.trace
            self._health.check("step()")
        self._health.check_dirty("step()")
        # The loop's edits of param.grad (its clip, a gradient set or dropped) become the sums'.
        edits = micro.grads.withdraw(stepping=True)
        if micro.acc is None:
            return None  # every gradient was dropped (model.zero_grad()): nothing steps
        hyper = capture_hyper(self.param_groups)
        micro.prepare_hand_over()  # (its waits stay interruptible)
        # Hazard: a Ctrl-C from the hand-over (chunks may go) to the forward waits: the step not
        # in flight, the device part unstepped, the next forward on stale weights. Held.
        with micro.part.interrupt.hold():
            acc = micro.hand_over(hyper, edits)
            self._handed_over += 1
            changed = self.overlap == "backward" and not same_hyper(hyper, acc.hyper)
            asynchronous = not changed and self._asynchronous()
            if asynchronous:
                self._traces.begin(acc, self._registry.device)
        if changed:
            self.wait_for_step()
            raise ConfigError(_common.HYPER_CHANGED)
        if not asynchronous:
            self._wait_synchronously()
            return None
        if NORM_ALLREDUCE in acc.execution.plan.order:
            # Hazard: the lane's all-reduce of the norm (hand_over() let it go) and the caller's
            # next collectives (the next forward's all-gathers) on one group from two threads.
            try:
                settle(acc.execution, NORM_ALLREDUCE, timeout=self.timeout)
            except BaseException as err:
                err.add_note("pipeoff: interrupted while waiting for the clipping norm's "
                             "all-reduce; the step goes on (the forward waits for its weights) "
                             "and must not be repeated. Call wait_for_step() to wait for it.")
                raise
        return None

    def _asynchronous(self) -> bool:
        """Whether ``step()`` returns with the step in flight (forward hooks wait)."""
        if self.overlap == "none" or self.overlap == "backward" and self._attached is None:
            return False
        if self._attached is None and self.model is not None and _compat.runs_compiled(
                self.model):
            # Hazard: compiled code reading weights the step still writes; it
            # cannot wait per parameter, and only attach()'s hooks run in it.
            if not self._warned_compiled:
                self._warned_compiled = True
                warnings.warn(
                    "FullOffloadOptimizer: the model runs compiled code and the optimizer "
                    "is not attached, so step() waits for the whole step (no overlap); call "
                    "opt.attach(): its hooks run before every module, compiled or not",
                    RuntimeWarning, stacklevel=3)
            return False
        return True

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """The total 2-norm of the gradients (before clipping), as
        ``torch.nn.utils.clip_grad_norm_`` returns it: a 0-dim FP32 CPU tensor.

        Between the last backward of a step and ``step()`` it is that step's norm (0
        with every gradient dropped): reading it ends the accumulation (waiting for the
        norm, not the step), so a step can be skipped on a non-finite norm with
        ``zero_grad()`` instead of ``step()``. Otherwise the last ``step()``'s. ``None``
        before any step, or under ``overlap="backward"`` before the final backward.
        Sharded parameters (FSDP2, HSDP): squares summed over their shard dimensions.
        """
        return self._lifecycle.norm()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> torch.Tensor:
        """Clip this step's gradients to the global 2-norm ``max_norm`` and return their
        total norm, as ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)``
        does for gradients in ``.grad`` (here they are on the host): the clipping
        happens in the step. Call it after the last backward and before
        ``step()``; it ends the accumulation. (FSDP1's ``clip_grad_norm_`` and
        DeepSpeed's engine take the same place; ``pipeoff.integrations.hf`` routes
        the HF Trainer's ``max_grad_norm`` here.)

        Args:
            max_norm: the norm to clip to (a positive float; ``inf``: only the norm), this
                step only; the optimizer's ``max_norm`` applies to steps without this call.
            norm_type: 2.0 only.
            error_if_nonfinite: raise if the norm is ``nan`` or ``inf``.
            foreach: ignored (accepted for torch's signature).

        Returns:
            The total norm before clipping, a 0-dim FP32 CPU tensor (0 without
            gradients, as torch's).

        Raises:
            ConfigError: ``overlap="backward"`` (the chunks step during the backward,
                before the norm is known), ``norm_type`` other than 2, ``max_norm``
                not a positive number, or a second call in one step.
            RuntimeError: ``error_if_nonfinite`` and the norm is not finite.
        """
        max_norm, unbounded = check_clip_args(max_norm, norm_type, self.overlap)
        norm = self._lifecycle.set_clip(max_norm, unbounded=unbounded)
        if norm is None:
            return torch.tensor(0.0)
        if error_if_nonfinite and not bool(torch.isfinite(norm)):
            raise RuntimeError(
                f"The total norm of order {float(norm_type)} for gradients from "
                "`parameters` is non-finite, so it cannot be clipped. To disable this error "
                "and scale the gradients by the non-finite norm anyway, set "
                "`error_if_nonfinite=False`")
        return norm

    def wait_for_step(self) -> None:
        """Block until the step in flight (if any) has written every weight.

        Raises:
            BaseException: the failure of a task of the step, with its traceback;
                see :meth:`step` for what is refused afterwards.
            ConfigError: under ``overlap="backward"``, a weight written after the final
                backward began was overwritten by the step (the step is done).
            KeyboardInterrupt: Ctrl-C while waiting: the step is still in flight.
        """
        names: list[str] = []
        try:
            # The names of weights the step's copy overwrote after they were written
            # during the final backward.
            names = self._lifecycle.wait_step()
        finally:
            # A step that ended (done or failed, not interrupted), here or in the model
            # sync's wait.
            ended = self._traces.take_ended()
        if not ended:
            return
        try:
            # The finished step's figures, to the hooks: last, so that a hook that
            # raises leaves no bookkeeping (grad_norm) undone.
            self._emit_stats()
        finally:
            if names:
                raise ConfigError(late_write_message(names))

    @property
    def last_trace(self) -> Any:
        """The :class:`pipeoff.trace.Trace` of the last step that ended (``None``
        before the first)."""
        self._traces.take_ended()
        return self._traces.last

    @last_trace.setter
    def last_trace(self, trace: Any) -> None:
        self._traces.last = trace

    def _writes_to(self, param: torch.Tensor) -> tuple[Execution | None, list[str]]:
        return self._lifecycle.writes_to(param)

    def _step_traces(self) -> list[Any]:
        return list(self._traces.micro)

    def _host_tensor(self, param: torch.Tensor, key: str) -> torch.Tensor:
        return self._registry.host_tensor(param, key)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the accumulated gradients (and a failed accumulation); ``param.grad``
        is ``None`` (``set_to_none=False``: zeros, as torch leaves them, where a gradient
        came since the last ``set_to_none=True``). A step in flight goes on. Under
        ``overlap="backward"`` the final backward has stepped: this cannot skip it (warns).

        Raises:
            StepFailedError: it abandoned a final backward (that raised) whose chunks
                had stepped: the parameters are partly stepped (load a checkpoint).
            KeyboardInterrupt: Ctrl-C while waiting for the discarded micro-steps
                (call ``zero_grad()`` again).
        """
        micro, held = self._lifecycle, _intake.present(self._intake) | self._intake.had_grad
        with _intake.refuse_if_torn(self._health, "training on after zero_grad()"):
            micro.settle_deferred()
            if micro.phase is not Phase.IDLE:
                if micro.micro is not None:
                    micro.abandon(micro.micro, "zero_grad() was called before its backward "
                                  "finished (the backward raised, or is still running)")
                if (self.overlap == "backward" and micro.phase is Phase.FINAL
                        and self._health.dirty is None):
                    warnings.warn("zero_grad() after the final backward without step(): under "
                                  "overlap='backward' that backward has stepped already (kept); "
                                  "call step() to wait for it, or use overlap='forward' to be "
                                  "able to skip a step", RuntimeWarning, stacklevel=3)
                    self.wait_for_step()  # the step before it (one step in flight at a time)
                    micro.prepare_hand_over()
                    micro.hand_over(None)
                    self.wait_for_step()
            micro.discard("zero_grad() discarded the micro-step", classify_final=True)
            _intake.zero_grads(self._intake, held, set_to_none)

    def trace_summary(self) -> Any:
        """The summary of the last step's trace (``None`` before one finished)."""
        return None if self.last_trace is None else self.last_trace.summary()
