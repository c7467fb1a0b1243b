"""OffloadOptimizer: optimizer state in pinned host memory, stepped in pipelined chunks."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import time
import warnings
from collections.abc import Callable
from typing import Any, Literal

import torch

from pipeoff import _accel, _compat
from pipeoff._contract import Health, StepWrites
from pipeoff._errors import ConfigError
from pipeoff._lowlevel import hook_wait_records, is_failure_of
from pipeoff._validate import check_int
from pipeoff.execution import Execution
from pipeoff.optim import _graph, _update
from pipeoff.optim._foreign import refuse_foreign
from pipeoff.optim._graph import Step
from pipeoff.optim._hooks import set_post_optim_event
from pipeoff.optim._host_state import (
    check_loaded,
    check_state_dtypes,
    loaded_value,
    offload_state,
)
from pipeoff.optim._layout import Layout, build_layout, fingerprint
from pipeoff.optim._offloaded import Offloaded, check_in_model
from pipeoff.optim._plan import ChunkPlan, verify_plan
from pipeoff.optim._readers import Readers
from pipeoff.optim._step_graph import offload_step
from pipeoff.optim._tensors import describe as _describe
from pipeoff.optim._tensors import host_alloc, index_of, memory_order, relaid
from pipeoff.optim._tensors import local as _local
from pipeoff.optim._waits import ForwardWaits
from pipeoff.staging import reserve_for
from pipeoff.trace import Trace
from pipeoff.trace.lowlevel import train_span

__all__ = ["OffloadOptimizer"]

Mode = Literal["single_pass", "chunked", "overlap"]
_MODES = ("single_pass", "chunked", "overlap")

DEFAULT_CHUNK_BYTES = 1 << 30
"""``chunk_bytes`` when neither it nor ``device_budget_bytes`` is given."""


class _Default:
    """The default of ``chunk_bytes``: 1 GiB, or a third of ``device_budget_bytes``."""

    def __repr__(self) -> str:
        return "DEFAULT_CHUNK_BYTES"


_DEFAULT = _Default()


def _wrapped(params: Any, optimizer_class: Any, optimizer: Any,
             kwargs: dict[str, Any]) -> torch.optim.Optimizer:
    """The optimizer to wrap: given (``OffloadOptimizer(opt)``), or built from the
    parameters, ``optimizer_class`` and its keyword arguments (torchao's form).

    Raises:
        ConfigError: both forms mixed, or not an optimizer / optimizer class, or the
            class refused the arguments.
    """
    if isinstance(params, torch.optim.Optimizer):
        if optimizer is not None:
            raise ConfigError("give the optimizer to wrap once (positionally or as optimizer=)")
        optimizer, params = params, None
    if optimizer is not None:
        if params is not None or optimizer_class is not None or kwargs:
            extra = sorted(kwargs) + (["params"] if params is not None else []) + (
                ["optimizer_class"] if optimizer_class is not None else [])
            raise ConfigError(
                f"OffloadOptimizer wraps either an optimizer instance or builds one from "
                f"params and optimizer_class; with an instance, {extra} have no place (set "
                "hyperparameters on the instance)")
        if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(
                optimizer, OffloadOptimizer):
            raise ConfigError(
                f"optimizer must be a torch.optim.Optimizer to wrap, got {optimizer!r}")
        return optimizer
    if params is None:
        raise ConfigError("OffloadOptimizer needs an optimizer to wrap, or the parameters "
                          "and optimizer_class to build one (torchao's form)")
    refuse_foreign(kwargs, "OffloadOptimizer")
    kwargs.pop("offload_gradients", None)  # (False, torchao's default: what this does)
    cls = torch.optim.AdamW if optimizer_class is None else optimizer_class
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)) or issubclass(
            cls, OffloadOptimizer):
        raise ConfigError(f"optimizer_class must be a torch.optim.Optimizer class such as "
                          f"torch.optim.AdamW, got {cls!r}")
    if isinstance(params, torch.Tensor):
        raise ConfigError("params must be an iterable of parameters or of param group "
                          f"dicts, got a single tensor of shape {tuple(params.shape)}")
    try:
        return cls(params, **kwargs)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{cls.__name__} refused {sorted(kwargs)}: {err}") from err


class OffloadOptimizer(Offloaded, torch.optim.Optimizer):
    """Wraps an optimizer; keeps its state in (pinned) host memory and steps it in chunks.

    The flat parameter space is cut into chunks whose optimizer state is at most
    ``chunk_bytes`` (:func:`~pipeoff.optim.plan_chunks`; a parameter larger than a
    chunk is split into flat slices). A step is a task graph: per chunk, copy its
    state host-to-device into pooled staging, update the chunk's parameters with
    the wrapped optimizer's own kernels, copy the state back. Chunk k+1's copy in
    overlaps chunk k's update and chunk k-1's copy out.

    Memory: device optimizer state at most ``(prefetch + 1) * chunk_bytes`` (or
    ``device_budget_bytes``)
    instead of all of it (AdamW: 8 bytes per fp32 parameter), plus, on a first
    step only, one chunk that the optimizer allocates while it initializes state.
    Host: all state (pinned). Traffic: the state of every parameter with a grad
    moves twice over the host link per step. Do not use it when the state fits on
    the device with room to spare: a plain optimizer moves nothing.

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
    memory order. ``step(closure)`` works in every mode, as in torch.

    Results are bitwise equal to stepping the wrapped optimizer directly.

    Two forms: an optimizer to wrap, or torchao's (``CPUOffloadOptimizer``'s)::

        OffloadOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4), mode="overlap")
        OffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-4, mode="overlap")

    Args:
        params: the optimizer to wrap (its ``param_groups`` are shared), or the
            parameters (or param groups) to build one from.
        optimizer_class: with parameters, the ``torch.optim`` class to build (default
            ``AdamW``, as torchao's).
        optimizer: the optimizer to wrap, by keyword.
        **optimizer_kwargs: with parameters, the optimizer's hyperparameters (``lr``...).
        mode: ``"single_pass"``, ``"chunked"`` or ``"overlap"``.
        chunk_bytes: bound on each chunk's device state, or ``None`` for one chunk.
        pin_memory: page-lock the host state (ignored without an accelerator).
        prefetch: chunks staged ahead of the one being updated (default 2).
            Device staging is then at most ``(prefetch + 1)`` of the largest
            chunk. (Formerly ``lookahead``, still accepted with a
            ``FutureWarning``.)
        device_budget_bytes: instead of ``prefetch``, a cap on live device
            staging in bytes, as ``LocalSGD`` takes one: chunks of a third of it
            unless ``chunk_bytes`` is given too (at most the budget).
        process_group: the group whose ranks must agree on the chunk plan
            (default: the world, when torch.distributed is initialized). The
            plan is checked collectively here, at construction, where every
            rank is known to be, and by :meth:`verify_plan`; never inside
            ``step()``, ``load_state_dict()`` or ``add_param_group()``, which a
            rank may call alone.
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

    Raises:
        ConfigError: an argument is out of range; parameters on mixed devices,
            not dense in memory, or (outside ``single_pass``) listed twice.
        UnsupportedOptimizerError: a chunked mode was asked of an optimizer that
            is not element-wise.
        PlanMismatchError: ranks of ``process_group`` disagree on the plan.
    """

    def __init__(
        self,
        params: torch.optim.Optimizer | Any = None,
        optimizer_class: type[torch.optim.Optimizer] | None = None,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        mode: Mode = "chunked",
        chunk_bytes: int | None | _Default = _DEFAULT,
        pin_memory: bool = True,
        prefetch: int | None = None,
        device_budget_bytes: int | None = None,
        process_group: Any = None,
        read_guard: bool = True,
        reserve: bool = True,
        lookahead: int | None = None,
        **optimizer_kwargs: Any,
    ) -> None:
        optimizer = _wrapped(params, optimizer_class, optimizer, optimizer_kwargs)
        if mode not in _MODES:
            raise ConfigError(f"mode must be one of {_MODES}, got {mode!r}")
        chunk_bytes_given = None if isinstance(chunk_bytes, _Default) else chunk_bytes
        if isinstance(chunk_bytes, _Default):
            chunk_bytes = DEFAULT_CHUNK_BYTES
        check_int("chunk_bytes", chunk_bytes, optional=True, unit="bytes")
        prefetch_name = "prefetch"
        if lookahead is not None:
            if prefetch is not None:
                raise ConfigError("give prefetch (the new name of lookahead), not both")
            warnings.warn("OffloadOptimizer(lookahead=...) is now prefetch=...; lookahead will "
                          "be removed", FutureWarning, stacklevel=2)
            prefetch, prefetch_name = lookahead, "lookahead"
        check_int(prefetch_name, prefetch, minimum=0, optional=True)
        if device_budget_bytes is not None:
            check_int("device_budget_bytes", device_budget_bytes, unit="bytes", optional=True)
            if prefetch is not None:
                raise ConfigError(
                    f"give {prefetch_name} or device_budget_bytes, not both (got "
                    f"{prefetch_name}={prefetch!r}, device_budget_bytes={device_budget_bytes!r})")
            if chunk_bytes_given is None:
                chunk_bytes = max(1, device_budget_bytes // 3)
            elif chunk_bytes is None or chunk_bytes > device_budget_bytes:
                raise ConfigError(
                    f"device_budget_bytes={device_budget_bytes} must hold one chunk, but "
                    f"chunk_bytes={chunk_bytes!r}; use chunk_bytes <= device_budget_bytes")
        if not isinstance(read_guard, bool):
            raise ConfigError(f"read_guard must be True or False, got {read_guard!r}")
        if not isinstance(reserve, bool):
            raise ConfigError(f"reserve must be True or False, got {reserve!r}")
        if mode != "single_pass":
            _update.check_elementwise(optimizer, mode)
        self.inner = optimizer
        self.mode: Mode = mode
        self.chunk_bytes = chunk_bytes
        self.prefetch: int | None = (
            None if device_budget_bytes is not None else 2 if prefetch is None else prefetch)
        """Chunks staged ahead of the one being updated (``None`` with a device budget)."""
        self.device_budget_bytes = device_budget_bytes
        """The cap on live device staging, if given instead of ``prefetch``."""
        self.process_group = process_group
        self.pin_memory = bool(pin_memory) and _accel.current().available()
        # Optimizer.__init__ is not called (it wants parameters); set what the
        # base class's hooks, schedulers and repr need.
        self.defaults = optimizer.defaults
        _compat.init_optimizer_hooks(self)
        self._inflight: Step | None = None
        self._last: Execution | None = None
        self._last_waits: list[tuple[str, int, int]] = []
        self._health = Health()  # what a failed step left (torn: partly stepped)
        self._readers = Readers()  # state transfers reading the host state
        self._step_layout: Layout | None = None  # the layout of the step in flight
        self._attach_handles: list[Any] = []  # attach()'s forward hooks
        self._fsdp_root: Any = None  # set by attach() on an FSDP2 root
        self._attached: torch.nn.Module | None = None
        self._waits = ForwardWaits(self.wait_for_step)
        self._waits.guard_enabled = read_guard
        self._reserve = reserve
        self._reserved: dict[tuple[int, str], torch.Tensor] = {}
        self._staging_reserved: tuple[int, ...] | None = None
        """The signature of the plan whose staging blocks are reserved."""
        self._adopt(build_layout(optimizer, chunked=self._chunked, chunk_bytes=chunk_bytes))
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
        self.inner.state = value

    @property
    def device(self) -> torch.device:
        """The device of the parameters (their local shards)."""
        return self._layout.device

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("OffloadOptimizer cannot be pickled; save state_dict() instead")

    def __repr__(self) -> str:
        staging = (f"device_budget_bytes={self.device_budget_bytes}"
                   if self.device_budget_bytes is not None else f"prefetch={self.prefetch}")
        return (f"OffloadOptimizer(mode={self.mode!r}, chunk_bytes={self.chunk_bytes}, "
                f"{staging}, {self.inner!r})")

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
            layout = self._checked_layout()
        except BaseException:
            self.inner.param_groups[:] = groups  # atomic: nothing was added
            raise
        self._adopt(layout)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear grads. Setting them to ``None`` never waits; zeroing in place waits
        for a step in flight (its chunks still read them)."""
        if not set_to_none:
            self.wait_for_step()  # the chunks still read these grads
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict (host tensors), after any step in flight.

        Raises:
            StepFailedError: the last step failed after writing some parameters.
        """
        self.wait_for_step()
        self._health.check("state_dict()")
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load into the wrapped optimizer, then move the state to host memory.

        This is also how to go on after a step that failed partway (load the
        model's state too). It is rank-local: no collective runs. Either all of
        ``state_dict`` is loaded or (on any error) nothing is.

        Raises:
            ConfigError: ``state_dict`` is not an optimizer state dict, or a
                per-element state tensor does not have its parameter's shape.
            ValueError: torch's own checks (a group of another size).
        """
        self.wait_for_step()
        self._readers.wait()
        if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= state_dict.keys():
            raise ConfigError("load_state_dict expects an optimizer state dict (a dict with "
                              f"'state' and 'param_groups'), got {type(state_dict).__name__}")
        # The wrapped optimizer's load_state_dict would move every state tensor
        # to its parameter's device, all at once: on a GPU, the whole optimizer
        # state this class exists to keep off it. Load the groups through it
        # (its checks, hooks and hyperparameters) and the state straight to host.
        saved = state_dict["state"]
        before = (self.inner.param_groups, self.inner.state)
        old_state = self.inner.state
        try:
            self.inner.load_state_dict({**state_dict, "state": {}})
            self.inner.state = old_state  # the layout checks below read it
            ids = itertools.chain.from_iterable(g["params"] for g in state_dict["param_groups"])
            params = itertools.chain.from_iterable(g["params"] for g in self.inner.param_groups)
            by_id = dict(zip(ids, params))
            group_of = {id(p): g for g in self.inner.param_groups for p in g["params"]}
            # Check everything before anything is written.
            entries: list[tuple[int, Any, Any, bool, tuple[str, ...]]] = []
            for pid, entry in saved.items():
                p = by_id.get(pid)
                if p is None:
                    entries.append((pid, None, entry, False, ()))
                    continue
                group = group_of[id(p)]
                on_device = bool(group.get("fused") or group.get("capturable"))
                keys = _update.state_keys(self.inner, group) if self._chunked else ()
                for k, v in entry.items():
                    check_loaded(p, k, v, k in keys)
                entries.append((pid, p, entry, on_device, keys))
            # The loaded state is cast to each parameter's dtype: check the rest.
            layout = self._checked_layout(check_state=False)
        except BaseException:
            self.inner.param_groups, self.inner.state = before  # nothing was loaded
            raise
        state: collections.defaultdict[Any, Any] = collections.defaultdict(dict)
        for pid, p, entry, on_device, keys in entries:
            if p is None:
                state[pid] = entry  # as torch does with ids it does not know
                continue
            reuse = old_state.get(p, {})
            state[p] = {k: loaded_value(p, k, v, step_on_device=on_device, element=k in keys,
                                        old=reuse.get(k), reserved=self._reserved)
                        for k, v in entry.items()}
        self.inner.state = state
        self._adopt(layout)
        self._health.torn = None

    def wait_for_step(self) -> None:
        """Block until the step in flight (if any) has finished.

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
            return
        try:
            st.execution.wait()
        except BaseException as err:
            if not is_failure_of(err, st.execution):
                # The wait was interrupted (Ctrl-C), not the step: it is still in
                # flight, and nothing has failed.
                err.add_note("pipeoff: interrupted while waiting for the optimizer step in "
                             "flight, which goes on: it has not failed and must not be "
                             "repeated. Call wait_for_step() to wait for it.")
                raise
            for p, g in st.restore.values():
                if p.grad is None:
                    p.grad = g
            self._end_step(st)
            written = sorted(st.written)
            failed = st.execution.failed_task
            if written:
                # The updates cannot be undone (that would need a copy of every
                # parameter): refuse to compound them rather than train on silently.
                self._health.torn_cause = err
                self._health.torn = (
                    f"a step failed in {failed!r} after chunk(s) "
                    f"{_ranges(written)} of {len(st.opt_tasks)} had written their parameters"
                )
                err.add_note(
                    f"pipeoff: {self._health.torn}; the parameters and optimizer state are partly "
                    "stepped. Load a checkpoint (model and optimizer load_state_dict) "
                    "before stepping again."
                )
            else:
                err.add_note(f"pipeoff: the step failed in {failed!r} before any chunk wrote "
                             "a parameter; no parameter was written and the step can be "
                             "retried.")
            raise
        self._end_step(st)
        self._emit_stats()  # the finished step's figures, to the hooks

    def _end_step(self, st: Step) -> None:
        self._inflight = None
        st.grads.clear()
        st.restore.clear()
        self._waits.end()

    def _writes_to(self, param: torch.Tensor) -> tuple[Execution | None, list[str]]:
        st = self._inflight
        # The step in flight indexes parameters by its own layout (param_groups may
        # have been edited since, and a read of `plan` re-plans).
        layout = self._step_layout if st is not None and self._step_layout else self._layout
        i = index_of(layout.params, param)
        if st is None or i not in st.updated:
            return None, []
        return st.execution, [n for c in layout.chunks_of[i] for n in (f"opt{c}", f"d2h{c}")]

    def _host_tensor(self, param: torch.Tensor, key: str) -> torch.Tensor:
        """The local host tensor of a per-element state ``key``; scalar state such as
        ``"step"`` is committed at the end of a step: read it after :meth:`wait_for_step`."""
        st = self._inflight
        layout = self._step_layout if st is not None and self._step_layout else self._layout
        i = index_of(layout.params, param)
        host = st.host_state.get(i, {}).get(key) if st is not None else None
        if host is None:
            value = self.inner.state.get(param, {}).get(key)
            if isinstance(value, torch.Tensor) and key in layout.keys[i]:
                host = _local(value)
        if host is None:
            raise ConfigError(
                f"{_describe(i, param)} has no per-element state {key!r} "
                f"(it has {sorted(layout.keys[i])}); scalar state such as 'step' is "
                "committed when a step ends: read opt.state after wait_for_step()")
        return host

    def _stepped_params(self) -> tuple[torch.Tensor, ...]:
        return self._current_layout().params

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
        return dataclasses.replace(trace, tasks=trace.tasks + waits) if waits else trace

    @property
    def plan(self) -> ChunkPlan:
        """The chunk plan of the live param groups.

        Raises:
            ConfigError: in ``single_pass`` (it has none), or the live groups are invalid.
        """
        if not self._chunked:
            raise ConfigError("mode='single_pass' has no chunk plan")
        layout = self._current_layout()
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

        On FSDP2 modules a ``prepend=True`` pre-forward hook on each FSDP module
        waits for the chunks of its own parameters and of the modules it
        prefetches; on a plain module tree each module that owns parameters,
        and the root, gets one; a module whose hook has not fired in a forward
        of the same kind (training or not, grad mode) has its parameters waited
        for by the nearest hooked ancestor that runs. Hooks run under
        ``torch.compile`` too (they are opaque to Dynamo, so they are graph
        breaks: not for ``fullgraph=True`` regions containing hooked modules).
        Code compiled before ``attach()`` is recompiled with the hooks in. A
        second call replaces the hooks. Either the hooks
        are all installed, or (on any error) the old ones stay. A model pickled
        or copied with the hooks carries inert ones.

        Raises:
            ConfigError: ``model`` is not a module, or some of the optimizer's
                parameters are not in it.
        """
        super().attach(model)
        root = _compat.compiled_original(model)
        self._fsdp_root = root if hasattr(root, "set_post_optim_event") else None

    def detach(self) -> None:
        """Remove the forward hooks that :meth:`attach` installed (after the step in
        flight)."""
        super().detach()
        self._fsdp_root = None

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
        if self._stats_pending is not None and self._stats_hooks:
            self.wait_for_step()  # (step() waits for it anyway, first thing)
            self._emit_stats()  # the previous step's figures, now that it has finished
        step = self._steps_called
        start = time.perf_counter_ns()
        # The training thread's "step N" span while a region is recorded.
        launched = self._last
        with train_span("step", step):
            try:
                return self._step(closure)
            finally:
                self._steps_called += 1
                if self._last is not launched:  # (a step that raised before launching has none)
                    self._stats_after_step(step, time.perf_counter_ns() - start)

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
        self.wait_for_step()
        self._health.check("step()")
        self._readers.wait()
        # A profiler range only while profiling: record_function costs about 0.5 ms
        # a step even when no profiler listens.
        with (torch.profiler.record_function("pipeoff::optim::step")
              if _compat.profiler_enabled() else contextlib.nullcontext()):
            layout = self._current_layout()
            if self.mode == "single_pass":
                ex, loss = _graph.single_pass(layout, self.inner, closure,
                                              lambda: offload_state(self.inner, layout,
                                                                    chunked=False,
                                                                    pin=self.pin_memory))
                self._last, self._last_waits = ex, []
                return loss  # type: ignore[no-any-return]
            self._step_layout = layout
            st = _graph.launch(layout, self.inner, pin_memory=self.pin_memory,
                               prefetch=self.prefetch, budget=self.device_budget_bytes,
                               reserved=lambda p, k: self._reserved.pop((id(p), k), None))
            self._inflight = st
            self._last = st.execution
            self._last_waits = []
            if self.mode == "chunked":
                self._wait_synchronously()  # the one host wait of a chunked step
            else:
                restore = st.restore  # lanes shrink it as chunks finish: read by key

                def grad_of(i: int) -> torch.Tensor | None:
                    pg = restore.get(i)
                    return None if pg is None else pg[1]

                self._last_waits = self._waits.begin(StepWrites(
                    execution=st.execution, write_tasks=st.opt_tasks, params=layout.params,
                    chunks_of=layout.chunks_of, device=layout.device, written=st.updated,
                    grad_of=grad_of))
                if _accel.current().is_device(layout.device):
                    root = self._fsdp_root
                    if root is not None:
                        set_post_optim_event(root, self.device)
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

        Returns:
            The bytes allocated.
        """
        if not self._chunked:
            return 0
        layout = self._current_layout()
        staged = 0
        plan = layout.plan
        if plan is not None and self._staging_reserved != plan.signature():
            local = [_local(p) for p in layout.params]
            reserved = reserve_for(*offload_step(
                layout.device, plan, itemsize=[t.element_size() for t in local],
                nkeys=[len(k) for k in layout.keys], local_numel=[t.numel() for t in local],
                present=[len(k) for k in layout.keys], updated=range(len(local)),
                prefetch=self.prefetch, budget=self.device_budget_bytes))
            staged = sum(reserved.values())
            self._staging_reserved = plan.signature()
        want = []
        for i, p in enumerate(layout.params):
            st = self.inner.state.get(p, {})
            want += [(i, k) for k in layout.keys[i]
                     if st.get(k) is None and (id(p), k) not in self._reserved]
        hosts = host_alloc([(_local(layout.params[i]).shape, _local(layout.params[i]).dtype,
                             layout.orders[i]) for i, _ in want], self.pin_memory)
        for (i, k), h in zip(want, hosts):
            self._reserved[(id(layout.params[i]), k)] = h
        return staged + sum(h.numel() * h.element_size() for h in hosts)

    # -- layout ---------------------------------------------------------------
    def _current_layout(self) -> Layout:
        """The layout of the live param groups, rebuilt (and checked) if they changed."""
        sig = fingerprint(self.inner, self._chunked)
        if sig == self._layout.signature:
            return self._layout
        self._adopt(self._checked_layout(sig))
        self._waits.forget()  # learn the reads of the new parameters too
        return self._layout

    def _adopt(self, layout: Layout) -> None:
        """Make ``layout`` the current one: existing host state, and host tensors
        reserved ahead, follow each parameter's memory order (it changes under
        ``model.to(memory_format=...)``; chunks are flat slices of both at once)."""
        # State with values is copied into the new order (offload_state keeps
        # each element's value); a reserved tensor holds none yet, so it is only
        # re-strided, and one whose parameter changed shape or dtype is dropped.
        offload_state(self.inner, layout, chunked=self._chunked, pin=self.pin_memory)
        for (pid, k), h in list(self._reserved.items()):
            i = layout.index.get(pid)
            if i is None or id(layout.params[i]) != pid:
                continue  # not a parameter now; kept in case it comes back
            loc = _local(layout.params[i])
            if h.shape != loc.shape or h.dtype != loc.dtype:
                del self._reserved[(pid, k)]
            elif memory_order(h) != layout.orders[i]:
                self._reserved[(pid, k)] = relaid(h, layout.orders[i])
        self._layout = layout

    def _checked_layout(self, sig: tuple[Any, ...] | None = None, *,
                        check_state: bool = True) -> Layout:
        layout = build_layout(self.inner, chunked=self._chunked, chunk_bytes=self.chunk_bytes,
                              signature=sig)
        if self._attached is not None:
            check_in_model(layout.params, self._attached)
        if self._chunked and check_state:
            check_state_dtypes(self.inner, layout)
        return layout

def _ranges(ks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    out: list[str] = []
    for k in ks:
        if out and k == int(out[-1].rsplit("-", 1)[-1]) + 1:
            out[-1] = f"{out[-1].split('-')[0]}-{k}"
        else:
            out.append(str(k))
    return ", ".join(out)
