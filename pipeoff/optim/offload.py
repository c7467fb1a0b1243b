"""OffloadOptimizer: optimizer state in pinned host memory, stepped in pipelined chunks."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch

from pipeoff._errors import ConfigError, StepFailedError
from pipeoff.execution import Execution
from pipeoff.optim import _graph, _update
from pipeoff.optim._graph import Step
from pipeoff.optim._plan import ChunkPlan, ParamMeta, plan_chunks, planned_numel, verify_plan
from pipeoff.optim._tensors import describe as _describe
from pipeoff.optim._tensors import host_alloc
from pipeoff.optim._tensors import local as _local
from pipeoff.optim._tensors import wrap_like as _wrap_like
from pipeoff.trace import TaskRecord, Trace, record_hook_wait
from pipeoff.trace._trace import HOOK_WAIT

__all__ = ["OffloadOptimizer"]

Mode = Literal["single_pass", "chunked", "overlap"]
_MODES = ("single_pass", "chunked", "overlap")
_FUSED_ALIGN = 128  # fused kernels vectorize from a tensor's start: split at multiples


class OffloadOptimizer(torch.optim.Optimizer):
    """Wraps an optimizer; keeps its state in (pinned) host memory and steps it in chunks.

    The flat parameter space is cut into chunks whose optimizer state is at most
    ``chunk_bytes`` (:func:`~pipeoff.optim.plan_chunks`; a parameter larger than a
    chunk is split into flat slices). A step is a task graph: per chunk, copy its
    state host-to-device into pooled staging, update the chunk's parameters with
    the wrapped optimizer's own kernels, copy the state back. Chunk k+1's copy in
    overlaps chunk k's update and chunk k-1's copy out.

    Memory: device optimizer state at most ``(lookahead + 1) * chunk_bytes``
    instead of all of it (AdamW: 8 bytes per fp32 parameter), plus, on a first
    step only, one chunk that the optimizer allocates while it initializes state.
    Host: all state (pinned). Traffic: the state of every parameter with a grad
    moves twice over the host link per step. Do not use it when the state fits on
    the device with room to spare: a plain optimizer moves nothing.

    Modes:
        ``"single_pass"``: the legacy path: all state moves to the device, the
        wrapped optimizer steps normally (any optimizer, closures allowed), and
        the state moves back. ``"chunked"``: bounded chunks, one host wait per
        step. ``"overlap"``: ``step()`` captures grads and hyperparameters,
        launches the chunks and returns; :meth:`attach` makes each module's
        forward wait only for the chunks holding its parameters.

    Results are bitwise equal to stepping the wrapped optimizer directly.

    Args:
        optimizer: the optimizer to wrap; its ``param_groups`` are shared.
        mode: ``"single_pass"``, ``"chunked"`` or ``"overlap"``.
        chunk_bytes: bound on each chunk's device state, or ``None`` for one chunk.
        pin_memory: page-lock the host state (ignored without an accelerator).
        lookahead: chunks staged ahead of the one being updated.
        process_group: the group whose ranks must agree on the chunk plan
            (default: the world, when torch.distributed is initialized).

    Raises:
        ConfigError: an argument is out of range, or parameters are on mixed devices.
        UnsupportedOptimizerError: a chunked mode was asked of an optimizer that
            is not element-wise.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        mode: Mode = "chunked",
        chunk_bytes: int | None = 1 << 30,
        pin_memory: bool = True,
        lookahead: int = 2,
        process_group: Any = None,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(
            optimizer, OffloadOptimizer
        ):
            raise ConfigError(
                f"optimizer must be a torch.optim.Optimizer to wrap, got {optimizer!r}"
            )
        if mode not in _MODES:
            raise ConfigError(f"mode must be one of {_MODES}, got {mode!r}")
        if chunk_bytes is not None and (
            isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0
        ):
            raise ConfigError(
                f"chunk_bytes must be a positive int (bytes) or None, got {chunk_bytes!r}"
            )
        if isinstance(lookahead, bool) or not isinstance(lookahead, int) or lookahead < 0:
            raise ConfigError(f"lookahead must be an int >= 0, got {lookahead!r}")
        if mode != "single_pass":
            _update.check_elementwise(optimizer, mode)
        self.inner = optimizer
        self.mode: Mode = mode
        self.chunk_bytes = chunk_bytes
        self.lookahead = lookahead
        self.process_group = process_group
        self.pin_memory = bool(pin_memory) and torch.cuda.is_available()
        # Optimizer.__init__ is not called (it wants parameters); set what the
        # base class's hooks, schedulers and repr need.
        self.defaults = optimizer.defaults
        for name in _update._HOOK_DICTS:
            setattr(self, name, collections.OrderedDict())
        self._patch_step_function()
        self._inflight: Step | None = None
        self._last: Execution | None = None
        self._last_waits: list[tuple[str, int, int]] = []
        self._torn: str | None = None  # why the parameters are partly stepped, if they are
        self._plan: ChunkPlan | None = None
        self._plan_layout: tuple[Any, ...] = ()
        self._verified = False
        self._shadows: list[torch.optim.Optimizer] = []
        self._hooks: list[Any] = []
        self._fsdp_root: Any = None  # set by attach() on an FSDP2 root
        self._model: torch.nn.Module | None = None
        self._params, self.device = self._index_params()
        self._offload_state()

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

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("OffloadOptimizer cannot be pickled; save state_dict() instead")

    def __repr__(self) -> str:
        return (f"OffloadOptimizer(mode={self.mode!r}, chunk_bytes={self.chunk_bytes}, "
                f"{self.inner!r})")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the wrapped optimizer; the chunk plan is rebuilt on the next step."""
        self.wait_for_step()
        self.inner.add_param_group(param_group)
        self._params, self.device = self._index_params()
        self._plan = None
        if self._model is not None:
            self.attach(self._model)  # the new parameters need forward waits too

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
        self._check_not_torn("state_dict()")
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load into the wrapped optimizer, then move the state to host memory.

        This is also how to go on after a step that failed partway (load the
        model's state too).
        """
        self.wait_for_step()
        if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= state_dict.keys():
            raise ConfigError("load_state_dict expects an optimizer state dict (a dict with "
                              f"'state' and 'param_groups'), got {type(state_dict).__name__}")
        # The wrapped optimizer's load_state_dict would move every state tensor
        # to its parameter's device, all at once: on a GPU, the whole optimizer
        # state this class exists to keep off it. Load the groups through it
        # (its checks, hooks and hyperparameters) and the state straight to host.
        saved = state_dict["state"]
        self.inner.load_state_dict({**state_dict, "state": {}})
        ids = itertools.chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = itertools.chain.from_iterable(g["params"] for g in self.inner.param_groups)
        by_id = dict(zip(ids, params))
        for pid, entry in saved.items():
            p = by_id.get(pid)
            if p is None:
                self.inner.state[pid] = entry  # as torch does with ids it does not know
                continue
            group = next(g for g in self.inner.param_groups if any(q is p for q in g["params"]))
            on_device = bool(group.get("fused") or group.get("capturable"))
            self.inner.state[p] = {k: _host_value(p, k, v, on_device) for k, v in entry.items()}
        self._offload_state()
        self._plan = None
        self._torn = None

    def wait_for_step(self) -> None:
        """Block until the step in flight (if any) has finished.

        Call it before anything but a forward reads the parameters: a checkpoint,
        a weight broadcast, evaluation without the attached hooks.

        Raises:
            BaseException: the exception a chunk raised, with its traceback. If
                chunks had already written their parameters, a note says which,
                and later steps raise :class:`~pipeoff.StepFailedError` until a
                checkpoint is loaded.
        """
        st = self._inflight
        if st is None:
            return
        self._inflight = None
        try:
            st.execution.wait()
        except BaseException as err:
            for p, g in st.restore.values():
                if p.grad is None:
                    p.grad = g
            written = _written_chunks(st)
            if written:
                # The updates cannot be undone (that would need a copy of every
                # parameter): refuse to compound them rather than train on silently.
                self._torn = (
                    f"a step failed in {st.execution.failed_task!r} after chunk(s) "
                    f"{_ranges(written)} of {len(st.opt_tasks)} had updated their parameters"
                )
                err.add_note(
                    f"pipeoff: {self._torn}; the parameters and optimizer state are partly "
                    "stepped. Load a checkpoint (model and optimizer load_state_dict) "
                    "before stepping again."
                )
            else:
                err.add_note("pipeoff: no parameter was written; the step can be retried.")
            raise
        finally:
            st.grads.clear()
            st.restore.clear()

    def _check_not_torn(self, what: str) -> None:
        if self._torn is not None:
            raise StepFailedError(
                f"{what} refused: {self._torn}, so the parameters and optimizer state are "
                "partly stepped. Load a checkpoint (the model's and this optimizer's "
                "load_state_dict) to go on."
            )

    def _wait_params(self, params: tuple[int, ...], streams: Sequence[Any] = (),
                     name: str = "") -> None:
        """Wait for the chunks of the step in flight that update ``params`` (indices).

        With ``streams`` (CUDA), those streams wait; otherwise the host blocks.
        """
        st = self._inflight
        if st is None:
            return
        todo = sorted({c for i in params for c in self._chunks_of[i]} - st.waited)
        if todo:
            t0 = time.perf_counter_ns()
            for comp in st.execution.events_for([st.opt_tasks[c] for c in todo]):
                if streams:
                    for s in streams:
                        # Hazard: this stream (compute, or FSDP's all-gather copy-in)
                        # reading parameter shards the chunk is still writing.
                        comp.wait(s)
                else:
                    comp.wait()  # host lanes: block until the chunk has written them
            t1 = time.perf_counter_ns()
            st.waited.update(todo)
            label = f"hook_wait:{name}" if name else "hook_wait"
            st.hook_waits.append((label, t0, t1))
            record_hook_wait(label, t0, t1)
        if st.execution.exception is not None:
            self.wait_for_step()  # raises the chunk's failure here

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
        origin = ex.origin_ns
        waits = tuple(
            TaskRecord(name=n, kind=HOOK_WAIT, lane="forward hooks", start_ns=a - origin,
                       end_ns=b - origin, enqueue_ns=a - origin,
                       rank=trace.metadata.get("rank", 0))
            for n, a, b in self._last_waits
        )
        return dataclasses.replace(trace, tasks=trace.tasks + waits) if waits else trace

    @property
    def plan(self) -> ChunkPlan:
        """The chunk plan (built on first use)."""
        return self._ensure_plan()

    def attach(self, model: torch.nn.Module) -> None:
        """Make ``model``'s forward wait for the chunks that update its parameters.

        On FSDP2 modules a ``prepend=True`` pre-forward hook on each FSDP module
        waits for the chunks of its own parameters and of the modules it
        prefetches; on a plain module tree each module that owns parameters
        gets one. A second call replaces the hooks.

        Raises:
            ConfigError: some of the optimizer's parameters are not in ``model``.
        """
        from pipeoff.optim._hooks import install

        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._hooks = install(self, model)
        self._model = model

    def detach(self) -> None:
        """Remove the forward hooks that :meth:`attach` installed."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._model = None

    # -- stepping -------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Step the wrapped optimizer: at once (``overlap``) or before returning.

        Raises:
            ConfigError: a closure outside ``single_pass``, a sparse grad, or a
                grad on another device.
            BaseException: the failure of the previous step in flight.
        """
        if closure is not None and self.mode != "single_pass":
            raise ConfigError(
                f"step(closure) is not supported in mode={self.mode!r}: the closure would run "
                "once per chunk; call it before step(), or use mode='single_pass'"
            )
        self.wait_for_step()
        self._check_not_torn("step()")
        with torch.profiler.record_function("pipeoff::optim::step"):
            if self.mode == "single_pass":
                return self._single_pass(closure)
            plan = self._ensure_plan()
            if not self._verified:
                verify_plan(plan, self.process_group)
                self._verified = True
            st = self._launch(plan)
            self._inflight = st
            self._last = st.execution
            self._last_waits = st.hook_waits
            if self.mode == "chunked":
                self.wait_for_step()  # the one host wait of a chunked step
            elif self.device.type == "cuda":
                self._set_post_optim_event()
        return None

    def _index_params(self) -> tuple[list[torch.Tensor], torch.device]:
        params = [p for g in self.inner.param_groups for p in g["params"]]
        if not params:
            raise ConfigError("the wrapped optimizer has no parameters")
        dev = _local(params[0]).device
        for i, p in enumerate(params):
            if _local(p).device != dev:
                raise ConfigError(
                    f"{_describe(i, p)} is on another device than {_describe(0, params[0])}; "
                    "an OffloadOptimizer needs all its parameters on one device"
                )
            if not _local(p).is_contiguous():
                raise ConfigError(f"{_describe(i, p)} is not contiguous; chunks are flat slices")
        return params, dev

    def _keys(self) -> list[tuple[str, ...]]:
        return [_update.state_keys(self.inner, g) for g in self.inner.param_groups
                for _ in g["params"]]

    def _layout(self) -> tuple[Any, ...]:
        """What the plan depends on besides shapes: state keys per param, fused kernels."""
        return (tuple(len(k) for k in self._keys()),
                any(g.get("fused") for g in self.inner.param_groups))

    def _ensure_plan(self) -> ChunkPlan:
        if self._plan is not None and self._plan_layout == self._layout():
            return self._plan
        if self.mode == "single_pass":
            raise ConfigError("mode='single_pass' has no chunk plan")
        self._plan_layout = self._layout()
        metas = []
        keys = self._keys()
        gi = [j for j, g in enumerate(self.inner.param_groups) for _ in g["params"]]
        for i, p in enumerate(self._params):
            metas.append(ParamMeta(numel=planned_numel(p), itemsize=_local(p).element_size(),
                                   nkeys=len(keys[i]), group=gi[i]))
        fused = any(g.get("fused") for g in self.inner.param_groups)
        self._plan = plan_chunks(metas, self.chunk_bytes, align=_FUSED_ALIGN if fused else 1)
        self._shadows = [_update.make_shadow(self.inner) for _ in self._plan.chunks]
        self._group_of = gi
        self._last_chunk = {s.param: c.index for c in self._plan.chunks for s in c.segments}
        chunks_of: dict[int, list[int]] = collections.defaultdict(list)
        for c in self._plan.chunks:
            for s in c.segments:
                chunks_of[s.param].append(c.index)
        self._chunks_of = {i: tuple(v) for i, v in chunks_of.items()}
        self._verified = False
        return self._plan

    def _offload_state(self) -> None:
        """Move per-element state that is not in host memory there (pooled, pinned)."""
        if self.mode == "single_pass":
            keys: list[tuple[str, ...]] | None = None
        else:
            keys = self._keys()
        todo: list[tuple[int, str, torch.Tensor]] = []
        for i, p in enumerate(self._params):
            st = self.inner.state.get(p)
            if not st:
                continue
            for k, v in st.items():
                if not isinstance(v, torch.Tensor):
                    continue
                loc = _local(v)
                element = k in keys[i] if keys is not None else (
                    k != "step" and loc.shape == _local(p).shape)
                if element and (loc.device.type != "cpu" or not loc.is_contiguous()
                                or (self.pin_memory and not loc.is_pinned())):
                    todo.append((i, k, loc))
        hosts = host_alloc([(t.shape, t.dtype) for _, _, t in todo], self.pin_memory)
        for (i, k, t), h in zip(todo, hosts):
            h.copy_(t)
            p = self._params[i]
            self.inner.state[p][k] = _wrap_like(p, h)

    def _launch(self, plan: ChunkPlan) -> Step:
        return _graph.launch(self, plan)

    def _set_post_optim_event(self) -> None:
        root = self._fsdp_root
        if root is None:
            return
        ev = torch.cuda.Event()
        # Hazard: FSDP's all-gather streams waiting on compute enqueued after the
        # step (a false dependency); the forward hooks carry the real ones.
        # Recorded on the parameters' device, whichever device is current.
        ev.record(torch.cuda.current_stream(self.device))
        root.set_post_optim_event(ev)

    def _single_pass(self, closure: Callable[[], float] | None) -> float | None:
        return _graph.single_pass(self, closure)


def _host_value(p: torch.Tensor, key: str, value: Any, step_on_device: bool) -> Any:
    """A loaded state value in host memory, with torch's dtype policy.

    ``step`` follows torch: kept as it is, or a float32 tensor on the
    parameter's device for fused and capturable optimizers.
    """
    if not isinstance(value, torch.Tensor):
        return value
    if key == "step":
        return value.to(dtype=torch.float32, device=p.device) if step_on_device else value
    local = _local(value).detach()
    dtype = _local(p).dtype if p.is_floating_point() else local.dtype
    local = local.to(device="cpu", dtype=dtype, copy=True)
    return _wrap_like(p, local) if hasattr(value, "placements") else local


def _written_chunks(st: Step) -> list[int]:
    """The chunks of a finished step whose update ran (wholly or until it raised)."""
    index = {name: k for k, name in enumerate(st.opt_tasks)}
    return sorted(index[t.name] for t in st.execution.trace.tasks
                  if t.name in index and t.status != "cancelled")


def _ranges(ks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    out: list[str] = []
    for k in ks:
        if out and k == int(out[-1].rsplit("-", 1)[-1]) + 1:
            out[-1] = f"{out[-1].split('-')[0]}-{k}"
        else:
            out.append(str(k))
    return ", ".join(out)
