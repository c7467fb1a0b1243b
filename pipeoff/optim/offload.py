"""OffloadOptimizer: optimizer state in pinned host memory, stepped in pipelined chunks."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
import warnings
from collections.abc import Callable
from typing import Any, Literal

import torch

from pipeoff import _accel, _compat, _validate
from pipeoff._contract import Health
from pipeoff._errors import ConfigError
from pipeoff._held_interrupt import held_through, step_note
from pipeoff._lowlevel import hook_wait_records, is_failure_of, report_unraised_at_exit, train_span
from pipeoff.execution import Execution
from pipeoff.optim import _offloaded, _update
from pipeoff.optim._offload import _graph, _join
from pipeoff.optim._offload._args import (
    _DEFAULT,
    _Default,
    check_fraction,
    mode_of,
    staging_args,
    wrapped,
)
from pipeoff.optim._offload._auto import FractionChoice, auto_fraction
from pipeoff.optim._offload._device_part import DevicePart, state_bytes
from pipeoff.optim._offload._graph import Step
from pipeoff.optim._offload._host_layout import HostLayout
from pipeoff.optim._offload._host_state import host_tensor, offload_state
from pipeoff.optim._offload._layout import Layout
from pipeoff.optim._offloaded import Offloaded
from pipeoff.optim._plan import ChunkPlan, verify_plan
from pipeoff.optim._readers import Readers
from pipeoff.optim._tensors import index_of
from pipeoff.optim._waits import ForwardWaits
from pipeoff.trace import Trace

__all__ = ["OffloadOptimizer"]

Mode = Literal["single_pass", "chunked", "overlap"]

class OffloadOptimizer(Offloaded, torch.optim.Optimizer):
    """Wraps an optimizer; keeps its state in (pinned) host memory and steps it in chunks.

    The flat parameter space is cut into chunks whose optimizer state is at most
    ``chunk_bytes`` (:func:`~pipeoff.optim.plan_chunks`; a parameter larger than a
    chunk is split into flat slices). A step is a task graph: per chunk, copy its
    state host-to-device into pooled staging, update the chunk's parameters with the
    wrapped optimizer's own kernels, copy it back (chunk k+1's copy in overlaps).

    Memory: device optimizer state at most ``(prefetch + 1) * chunk_bytes`` (or
    ``device_budget_bytes``) instead of all of it (AdamW: 8 bytes per fp32 parameter),
    plus, on a first step, one chunk the optimizer allocates initializing state.
    Host: all state (pinned); each stepped parameter's state crosses the host link
    twice a step. Where the state fits on the device, a plain optimizer moves nothing.

    Modes:
        ``"single_pass"``: the legacy path: all state moves to the device, the
        wrapped optimizer steps normally (any optimizer; it calls the closure),
        and the state moves back. ``"chunked"``: bounded chunks, one host wait
        per step. ``"overlap"``: ``step()`` captures grads and hyperparameters,
        launches the chunks and returns; every read of a parameter waits for the
        chunks that write it (see ``docs/optimizer.md``, "What overlap mode needs
        from your model"), and :meth:`attach` makes each module's forward wait,
        on CUDA streams, only for the chunks holding its parameters.

    The live ``param_groups`` are the truth: parameters added, removed or
    re-pointed in place, and a parameter whose layout changed (channels-last),
    are picked up at the next step, which re-plans before writing anything; a
    changed layout re-lays that parameter's host state (values kept) in its new
    memory order. ``step(closure)`` works in every mode, as in torch. Results are
    bitwise equal to stepping the wrapped optimizer directly.

    ``offload_fraction=f``: the first parameters (at most ``1 - f`` of the state's
    bytes) keep their state on the device, stepped by torch on the caller's stream as
    the chunks of the rest run (docs/optimizer.md); ``"auto"``: :attr:`offload_choice`.

    Two forms: an optimizer to wrap, or torchao's (``CPUOffloadOptimizer``'s)::

        OffloadOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4), overlap="forward")
        OffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-4, overlap="forward")

    Args:
        params: the optimizer to wrap (its ``param_groups`` are shared), or the
            parameters (or param groups) to build one from.
        optimizer_class: with parameters, the ``torch.optim`` class to build (default
            ``AdamW``, as torchao's).
        optimizer: the optimizer to wrap, by keyword.
        **optimizer_kwargs: with parameters, the optimizer's hyperparameters (``lr``...).
        mode: ``"single_pass"``, ``"chunked"`` (the default) or ``"overlap"``.
        overlap: instead of ``mode`` (FullOffloadOptimizer's name): ``"forward"`` or ``"none"``.
        chunk_bytes: bound on each chunk's device state (an int, or a string such as
            ``"256MiB"``), or ``None`` for one chunk.
        pin_memory: page-lock the host state (ignored without an accelerator).
        prefetch: chunks staged ahead of the one being updated (default 2; formerly
            ``lookahead``): device staging is at most ``(prefetch + 1)`` largest chunks.
        device_budget_bytes: instead of ``prefetch``, a cap on live device staging
            in bytes, as ``LocalSGD`` takes one: chunks of a third of it unless
            ``chunk_bytes`` is given too (at most the budget). With ``"auto"``: the
            cap on state and staging together.
        process_group: the group whose ranks must agree on the chunk plan (default:
            the world, when torch.distributed is initialized), checked collectively
            here and by :meth:`verify_plan`; never inside ``step()``,
            ``load_state_dict()`` or ``add_param_group()``, which a rank may call alone.
            An optimizer built on some ranks only needs a group of just those.
        reserve: allocate the host state of every parameter now (see
            :meth:`reserve`), rather than at the first step.
        read_guard: in ``overlap`` mode, make every eager read of a parameter
            that a step is still writing wait for it (a ``TorchFunctionMode``
            while the step is in flight; see ``docs/optimizer.md``). ``False``
            leaves only :meth:`attach`'s module hooks: run
            :func:`~pipeoff.optim.check_overlap` with ``read_guard=False`` first.
            Under any ``TorchFunctionMode`` torch skips the fast paths of
            ``nn.TransformerEncoderLayer`` and ``nn.MultiheadAttention`` in
            inference, whose last bits differ.
        offload_fraction: the share of the state in host memory, in [0, 1]
            (``1.0``: all of it; ``0.0``: all on the device, stepped by torch), or
            ``"auto"``: the fastest share whose device memory (state and staging)
            fits ``device_budget_bytes`` (on CUDA, default: the free memory), by a
            model of the step from rates measured here (``docs/optimizer.md``).

    Raises:
        ConfigError: an argument is out of range (``offload_fraction`` not a
            number in [0, 1] or ``"auto"``; ``"auto"`` without a budget to be
            had, or one too small for the staging); parameters on mixed devices,
            not dense in memory, or (outside ``single_pass``) listed twice.
        UnsupportedOptimizerError: a chunked mode was asked of a non-element-wise optimizer.
        PlanMismatchError: ranks of ``process_group`` disagree on the plan.
    """

    def __init__(
        self,
        params: torch.optim.Optimizer | Any = None,
        optimizer_class: type[torch.optim.Optimizer] | None = None,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        mode: Mode | None = None,
        overlap: Literal["forward", "none"] | None = None,
        chunk_bytes: int | str | None | _Default = _DEFAULT,
        pin_memory: bool = True,
        prefetch: int | None = None,
        device_budget_bytes: int | str | None = None,
        process_group: Any = None,
        read_guard: bool = True,
        reserve: bool = True,
        lookahead: int | None = None,
        offload_fraction: float | Literal["auto"] = 1.0,
        **optimizer_kwargs: Any,
    ) -> None:
        optimizer = wrapped(params, optimizer_class, optimizer, optimizer_kwargs)
        mode = mode_of("chunked" if mode is None and overlap is None else mode, overlap)
        process_group = _validate.check_process_group(process_group)
        self.offload_choice: FractionChoice | None = auto_fraction(
            optimizer, mode, offload_fraction, None if isinstance(chunk_bytes, _Default)
            else chunk_bytes, prefetch, lookahead, device_budget_bytes, pin_memory,
            process_group)
        """What ``offload_fraction="auto"`` chose and why (else ``None``)."""
        if (c := self.offload_choice) is not None:  # (its budget made the staging)
            offload_fraction, chunk_bytes, prefetch, lookahead, device_budget_bytes = (
                c.fraction, c.chunk_bytes, c.prefetch, None, None)
        chunk_bytes, prefetch, device_budget_bytes = staging_args(
            chunk_bytes, prefetch, lookahead, device_budget_bytes)
        if not isinstance(read_guard, bool):
            raise ConfigError(f"read_guard must be True or False, got {read_guard!r}")
        if not isinstance(reserve, bool):
            raise ConfigError(f"reserve must be True or False, got {reserve!r}")
        offload_fraction = check_fraction(offload_fraction, "OffloadOptimizer")
        if mode != "single_pass":
            _update.check_elementwise(optimizer, f"mode={mode!r}" if overlap is None
                                      else f"overlap={overlap!r}")
            # Hazard: a compile session that began before the first chunk's math
            # (is_compiling() is process-wide) steering torch.optim into its
            # compiled-code branches on a host lane: the session guard goes in now.
            _compat.eager_math()
        self.inner = optimizer
        self.mode: Mode = mode
        self.chunk_bytes = chunk_bytes
        self.prefetch: int | None = prefetch
        """Chunks staged ahead of the one being updated (``None`` with a device budget)."""
        self.device_budget_bytes = device_budget_bytes
        """The cap on live device staging, if given instead of ``prefetch`` (not auto's)."""
        self.process_group = process_group
        self.pin_memory = (_validate.check_bool("pin_memory", pin_memory)
                           and _accel.current().available())
        # Optimizer.__init__ is not called (it wants parameters): what hooks, repr need.
        self.defaults = optimizer.defaults
        _compat.init_optimizer_hooks(self)
        self._inflight: Step | None = None
        report_unraised_at_exit(self, lambda o: o._inflight and o._inflight.execution,
                                "OffloadOptimizer")
        self._last: Execution | None = None
        self._last_waits: list[tuple[str, int, int]] = []
        self._health = Health()  # what a failed step left (torn: partly stepped)
        self._readers = Readers()  # state transfers reading the host state
        self._step_layout: Layout | None = None  # the layout of the step in flight
        self._attach_handles: list[Any] = []  # attach()'s forward hooks
        self._attached: torch.nn.Module | None = None
        self._waits = ForwardWaits(self.wait_for_step)
        self._waits.guard_enabled = read_guard
        self._reserve = reserve
        # The layout of the live groups, host state in it, host memory reserved ahead.
        self._device = DevicePart()  # the device part's step and its event
        self._host = HostLayout(optimizer, chunked=self._chunked, chunk_bytes=chunk_bytes,
                                pin_memory=self.pin_memory, on_change=self._waits.forget,
                                offload_fraction=offload_fraction)
        if self._chunked:
            self.verify_plan()
            if reserve:
                self.reserve()

    @property
    def lookahead(self) -> int | None:
        """The old name of :attr:`prefetch` (deprecated)."""
        warnings.warn("OffloadOptimizer.lookahead is now .prefetch; lookahead will be removed",
                      FutureWarning, stacklevel=2)
        return self.prefetch

    @property
    def _chunked(self) -> bool:
        return self.mode != "single_pass"

    # -- the Optimizer surface ------------------------------------------------
    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.inner.param_groups = value

    @property  # type: ignore[override]
    def state(self) -> collections.defaultdict[torch.Tensor, Any]:
        """The wrapped optimizer's state (host tensors); waits for a step in flight."""
        self.wait_for_step()
        return self.inner.state

    @state.setter
    def state(self, value: Any) -> None:
        self.wait_for_step()  # Hazard: the step in flight writing into the dicts given
        self.inner.state = value

    @property
    def device(self) -> torch.device:
        """The device of the parameters (their local shards)."""
        return self._host.layout.device

    @property
    def offload_fraction(self) -> float:
        """About this share of the optimizer state is in host memory (by bytes; the
        split is by whole parameters, the first ones in param-group order on the device)."""
        return self._host.offload_fraction

    def memory_stats(self) -> dict[str, int]:
        """Where the optimizer state is, after the step in flight (the live param groups).

        Returns:
            A dict of ints: ``state_bytes_host``, bytes of the host part's state
            (host tensors reserved for state a first step makes included);
            ``state_bytes_device``, bytes of the device part's state;
            ``params_host`` and ``params_device``, the parameters of each part.
            Scalar state (``step``) counts where it lives on an accelerator (a
            fused optimizer's is on the device), else with its part. Device
            staging is not state: a step adds at most ``(prefetch + 1)`` chunks of
            it (or ``device_budget_bytes``).

        Raises:
            ConfigError: the live param groups are invalid.
        """
        self.wait_for_step()
        return state_bytes(self.inner, self._host.current(self._attached), self._host.reserved)

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("OffloadOptimizer cannot be pickled; save state_dict() instead")

    def __repr__(self) -> str:
        staging = (f"device_budget_bytes={self.device_budget_bytes}"
                   if self.device_budget_bytes is not None else f"prefetch={self.prefetch}")
        fraction = ("" if self.offload_fraction == 1.0 and self.offload_choice is None else
                    f"offload_fraction={self.offload_fraction:.4g}"
                    f"{'' if self.offload_choice is None else ' (auto)'}, ")
        return (f"OffloadOptimizer(mode={self.mode!r}, chunk_bytes={self.chunk_bytes}, "
                f"{staging}, {fraction}{self.inner!r})")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the wrapped optimizer; the next step plans it in.

        Either the group is added, or (on any error) the optimizer, its hooks
        and the model are left as they were.

        Raises:
            ConfigError: a parameter of the group is on another device, not
                dense, listed twice (outside ``single_pass``), or not in the
                model given to :meth:`attach`.
        """
        self.wait_for_step()
        groups = list(self.inner.param_groups)
        self.inner.add_param_group(param_group)
        try:
            layout = self._host.checked(self._attached)
        except BaseException:
            self.inner.param_groups[:] = groups  # atomic: nothing was added
            raise
        self._host.adopt(layout)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear grads. Setting them to ``None`` never waits; zeroing in place waits
        for a step in flight (its chunks still read them)."""
        if not set_to_none:
            self.wait_for_step()  # the chunks still read these grads
        self.inner.zero_grad(set_to_none=set_to_none)

    @_offloaded.fires_state_dict_hooks
    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict (host tensors), after any step in flight
        (its state-dict hooks run, as torch's do). Raises ``StepFailedError``: the
        last step failed after writing some parameters."""
        self.wait_for_step()
        self._health.check("state_dict()")
        return _offloaded.in_param_order(self.inner.state_dict())

    @_offloaded.fires_load_state_dict_hooks
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load into the wrapped optimizer, then move the state to host memory.

        This is also how to go on after a step that failed partway (load the model's state
        too). Rank-local: no collective runs. All is loaded or nothing. Its load hooks run.

        Raises:
            ConfigError: not an optimizer state dict, a per-element state tensor not of its
                parameter's shape, or state torch's step could not take (meta, sparse, a
                ``step`` not a number, a key missing).
            ValueError: torch's own checks (a group of another size).
        """
        self.wait_for_step()
        self._readers.wait()
        # Hazard: a Ctrl-C between two parameters' entries (the old state's host tensors
        # are reused): old state and new, mixed (a tester's find). Held until whole.
        with held_through("load_state_dict() wrote the optimizer's state"):
            self._host.load(state_dict, self._attached)
            self._device.mark(self.inner)  # (the device part's loaded state: for the readers)
            self._health.torn = None

    def wait_for_step(self) -> None:
        """Block until the step in flight (if any) has finished, device part included.

        In overlap mode every read of a parameter already waits for the chunks
        that write it (on the thread that called ``step()``); call this before
        reading parameters on another thread, or to collect a failure.

        Raises:
            BaseException: the exception a chunk raised, with its traceback. If
                chunks had already written their parameters, a note says which,
                and later steps raise :class:`~pipeoff.StepFailedError` until a
                checkpoint is loaded.
        """
        if torch.compiler.is_compiling():
            # Traced by Dynamo (a compiled training step): run it eagerly, or the
            # trace would bake in this call's waits and bookkeeping.
            return _compat.dynamo_disable(OffloadOptimizer.wait_for_step)(self)  # type: ignore[no-any-return]
        st = self._inflight
        if st is None:
            self._device.wait()
            return
        try:
            st.execution.wait()
        except BaseException as err:
            if not is_failure_of(err, st.execution):
                _join.interrupted(err)  # (Ctrl-C: the step goes on)
                raise
            self._inflight = None
            _join.report(self._health, err, st, st.execution.failed_task)
            _join.finish(st, self._waits)
            raise
        self._device.wait()  # the join: see [Note: the two parts of a step]
        self._inflight = None
        _join.finish(st, self._waits)
        self._emit_stats()  # the finished step's figures, to the hooks

    def _writes_to(self, param: torch.Tensor) -> tuple[Execution | None, list[str]]:
        st = self._inflight
        # The step in flight indexes parameters by its own layout (param_groups may
        # have been edited since, and a read of `plan` re-plans).
        layout = self._step_layout if st is not None and self._step_layout else self._host.layout
        i = index_of(layout.params, param)
        if st is None or i not in st.updated:
            return None, []
        return st.execution, [n for c in layout.chunks_of[i] for n in (f"opt{c}", f"d2h{c}")]

    def _host_tensor(self, param: torch.Tensor, key: str) -> torch.Tensor:
        """The local host tensor of a per-element state ``key``; scalar state such as
        ``"step"`` is committed at the end of a step: read it after :meth:`wait_for_step`."""
        st = self._inflight
        layout = self._step_layout if st is not None and self._step_layout else self._host.layout
        return host_tensor(self.inner, layout, param, key,
                           st.host_state if st is not None else {}, chunked=self._chunked)

    def _stepped_params(self) -> tuple[torch.Tensor, ...]:
        return self._host.current(self._attached).params

    @property
    def last_execution(self) -> Execution | None:
        """The execution of the latest step (its ``.trace`` waits for it)."""
        return self._last

    @property
    def last_trace(self) -> Trace | None:
        """The trace of the latest step, after it finished, with its forward-hook waits."""
        ex = self._last
        if ex is None:
            return None
        trace = ex.trace
        waits = hook_wait_records(self._last_waits, ex.origin_ns, trace.metadata.get("rank", 0))
        meta = {**trace.metadata, "offload_fraction": self.offload_fraction,
                **({} if (c := self.offload_choice) is None else {"offload_choice": c.as_dict()})}
        return dataclasses.replace(trace, tasks=trace.tasks + waits, metadata=meta)

    @property
    def plan(self) -> ChunkPlan:
        """The chunk plan of the live param groups.

        Raises:
            ConfigError: in ``single_pass`` (it has none), or the live groups are invalid.
        """
        if not self._chunked:
            raise ConfigError("mode='single_pass' has no chunk plan")
        layout = self._host.current(self._attached)
        assert layout.plan is not None
        return layout.plan

    def verify_plan(self) -> None:
        """Check collectively that every rank of ``process_group`` has the same chunk plan.

        A collective: call it on every rank, after changing param groups on all
        of them. Runs at construction too. Does nothing unless torch.distributed
        is initialized.

        Raises:
            PlanMismatchError: on every rank, when ranks disagree.
        """
        if self._chunked:
            verify_plan(self.plan, self.process_group)

    def attach(self, model: torch.nn.Module) -> None:
        """Make ``model``'s forward wait, per module, for the chunks it reads.
        FSDP2 modules get a ``prepend=True`` pre-forward hook waiting for the chunks
        of their own parameters and of the modules they prefetch; on a plain tree each
        module owning parameters, and the root, gets one (a module whose hook did not
        fire has its parameters waited for by the nearest hooked ancestor that runs).
        Hooks run under ``torch.compile`` as graph breaks (not for ``fullgraph=True``
        regions holding hooked modules); code compiled before is recompiled. A second
        call replaces the hooks; on any error the old ones stay. A model pickled or
        copied with the hooks carries inert ones.

        Raises:
            ConfigError: ``model`` is not a module, or some of the optimizer's
                parameters are not in it.
        """
        super().attach(model)

    # -- stepping -------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Step the wrapped optimizer: at once (``overlap``) or before returning.

        Nothing is written unless every check passes.
        Args:
            closure: as in torch: a function that computes the loss and calls
                ``backward()`` (PyTorch Lightning passes one). It runs once,
                under ``torch.enable_grad()``, before the step is planned and
                launched; in ``overlap`` mode its forward waits, per module, for
                the previous step's chunks, as any forward does. In
                ``single_pass`` the wrapped optimizer calls it (as often as it
                wants: LBFGS).

        Returns:
            The closure's return value, or ``None`` without a closure.

        Raises:
            ConfigError: a sparse grad, a grad on another device, or live
                param groups that are invalid (a parameter on another device,
                not dense, listed twice, or outside the attached model).
            StepFailedError: an earlier step failed after writing parameters
                (before the closure runs).
            BaseException: the failure of the previous step in flight; or
                whatever the closure raised, and then nothing is stepped.
        """
        if torch.compiler.is_compiling():
            # Traced by Dynamo (torch.compile of a training step, or of step()
            # itself): launching chunks, waiting and its bookkeeping must run
            # for real at every call, not once at trace time.
            return _compat.dynamo_disable(OffloadOptimizer._counted_step)(self, closure)  # type: ignore[no-any-return]
        return self._counted_step(closure)

    def _counted_step(self, closure: Callable[[], float] | None) -> float | None:
        step, start, launched = self._steps_called, time.perf_counter_ns(), self._last
        hooks = self._stats_hook_ns  # (the hooks' time in this call: not the step's)
        with train_span("step", step):  # (the training thread's, while a region is recorded)
            if self._stats_pending is not None and self._stats_hooks:
                _wait_before_step(self)  # (step() waits for it anyway, first thing: timed)
                self._emit_stats()  # the last step's figures, now that it has finished
            try:
                return _offloaded.with_step_hooks(  # type: ignore[no-any-return]
                    self.inner, closure, self._step, self.wait_for_step)
            except KeyboardInterrupt as err:
                _join.note_interrupted_step(err, launched=self._last is not launched)
                raise
            finally:
                self._steps_called += 1
                if self._last is not launched:  # (a step that raised before launching has none)
                    self._stats_after_step(step, self._exposed_since(start, hooks))

    def _step_finished(self) -> bool:
        return self._last is None or self._last.done()

    def _step(self, closure: Callable[[], float] | None) -> float | None:
        if closure is not None and self._chunked:
            # As torch's element-wise optimizers do: the closure once, then the
            # update of every parameter. The step in flight (overlap) is not
            # waited for first: the closure's forward waits for the chunks of
            # each module it reads, so it overlaps them like any forward.
            self._health.check("step()")  # a torn optimizer runs no forward
            with torch.enable_grad():
                loss = closure()
            self._step(None)
            return loss
        _wait_before_step(self)
        self._health.check("step()")
        self._readers.wait()
        # A profiler range only while profiling (record_function: ~0.5 ms a step).
        with (torch.profiler.record_function("pipeoff::optim::step")
              if _compat.profiler_enabled() else contextlib.nullcontext()):
            layout = self._host.current(self._attached)
            if self.mode == "single_pass":
                ex, loss = _graph.single_pass(layout, self.inner, closure, lambda: offload_state(
                    self.inner, layout, chunked=False, pin=self.pin_memory))
                self._last, self._last_waits = ex, []
                return loss  # type: ignore[no-any-return]
            self._step_layout = layout
            held = self._device.interrupt  # (a Ctrl-C held back, passed on after)
            # Hazard: a Ctrl-C from the launch until the step is in flight whole (both
            # parts launched, its forward waits begun): a half-launched step, which a
            # retried step() takes again. Nothing here waits but the device part.
            with held.hold(), held.passed_on(lambda: "", drop_only=True):
                st = _graph.launch(layout, self.inner, pin_memory=self.pin_memory,
                                   prefetch=self.prefetch, budget=self.device_budget_bytes,
                                   reserved=self._host.pop_reserved)
                self._inflight, self._last, self._last_waits = st, st.execution, []
                try:  # launched first: the lanes do not wait for it (the two parts' Note)
                    st.device_params = self._device.step(layout, self.inner)
                except BaseException as err:
                    st.device_written = self._device.written
                    _join.device_failed(self._health, st, self._waits, err)
                    self._inflight = None
                    raise
                st.device_written = self._device.written
                if self.mode != "chunked":
                    self._last_waits = _join.begin_waits(self._waits, st, layout,
                                                         self._attached, self.device)
            with held.passed_on(lambda: step_note(self.mode == "chunked")):
                if self.mode == "chunked":
                    self._wait_synchronously()  # the one host wait of a chunked step
        return None

    def reserve(self) -> int:
        """Allocate now the (pinned) host memory of every state tensor that does not
        exist yet, and the staging blocks a step uses.

        Otherwise the first step allocates them: pinning costs time
        (``cudaHostAlloc`` runs at a few GB/s and synchronizes the device) at a
        moment the training loop did not choose, possibly under a collective.
        The constructor calls this unless ``reserve=False``; call it again
        after adding parameters. Host state is the state's own size (AdamW: 8
        bytes per fp32 parameter), allocated once; staging is what a step can
        hold at once (about ``(prefetch + 1) * chunk_bytes`` of device memory),
        reserved in the process's staging pools (:func:`pipeoff.staging.reserve_for`).

        Returns the bytes allocated.
        """
        if not self._chunked:
            return 0
        return self._host.reserve(self._host.current(self._attached), prefetch=self.prefetch,
                                  budget=self.device_budget_bytes)


def _wait_before_step(self: OffloadOptimizer) -> None:
    """``self.wait_for_step()`` in a ``step()`` that has not begun its own step."""
    try:
        self.wait_for_step()
    except BaseException as err:
        if self._inflight is not None:  # (interrupted: the step before goes on)
            _join.not_begun(err)
        raise
