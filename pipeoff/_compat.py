"""The private APIs of torch, FSDP2 and torchft that pipeoff relies on, in one place.

Every use of a private name goes through a helper here, and every private name
is listed in :data:`PRIVATE_APIS` with the versions it was tested on
(:data:`TESTED`, also the upper bounds in ``pyproject.toml``).
``tests/test_compat.py`` resolves each one against the installed packages, so
a release that moves one fails that test, naming the API, instead of a
feature failing deep inside a training step.
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

__all__ = ["active_data_parallel", "backward_id", "check_private_apis",
           "compiled_autograd_active", "compiled_original", "cuda_sleep", "data_parallel",
           "ddp_gradient_sync", "dispatch_mode_active", "dtensor_box", "dynamo_disable",
           "eager_math", "force_eager", "fsdp_all_gather_streams", "fsdp_cpu_offload",
           "fsdp_gradient_sync", "fsdp_prefetch_states", "fsdp_sharded_params", "fsdp_state",
           "fused_adam_kernel", "hookless", "init_optimizer_hooks", "installed_version",
           "is_compiling", "issue_on_group", "local_tensor", "make_wrapper_subclass",
           "note_step_called", "outer_backward_frame", "outermost_backward_frame",
           "post_accumulate_grad_hooks", "PRIVATE_APIS", "PrivateAPI", "profiler_enabled",
           "queue_backward_callback", "recompile_with_hooks", "restore_stance",
           "runs_compiled", "set_torch_function_stack", "skipped_by_torchft", "step_body",
           "TESTED", "torch_function_stack", "uncompiled_name"]

TESTED: dict[str, tuple[str, str]] = {"torch": ("2.9", "2.13"), "torchft": ("0.2", "0.2")}
"""Per package, the oldest and newest minor versions pipeoff was tested on; the
upper bounds of ``pyproject.toml`` admit these and nothing newer."""


_HOOK_DICTS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
               "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
               "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks")


@dataclass(frozen=True, slots=True)
class PrivateAPI:
    """One private name pipeoff uses: where it lives and what uses it."""

    package: str  # "torch" or "torchft"
    path: str  # module:attribute.attribute (resolved by check_private_apis)
    used_for: str


PRIVATE_APIS: tuple[PrivateAPI, ...] = (
    PrivateAPI("torch", "torch._dynamo.eval_frame:_set_stance",
               "force_eager / restore_stance: compiled optimizer steps run eagerly"),
    PrivateAPI("torch", "torch._dynamo.eval_frame:DynamoStance", "force_eager"),
    PrivateAPI("torch", "torch._dynamo.config:skip_nnmodule_hook_guards",
               "recompile_with_hooks: compiled code sees attach()'s hooks"),
    PrivateAPI("torch", "torch._C._dynamo.eval_frame:reset_code", "recompile_with_hooks"),
    PrivateAPI("torch", "torch._dynamo.external_utils:wrap_inline", "recompile_with_hooks"),
    PrivateAPI("torch", "torch.compiler:_compile_session_context",
               "eager_math: a chunk's math never overlaps a compile session"),
    PrivateAPI("torch", "torch._C:_len_torch_function_stack",
               "torch_function_stack: the read guard sits below the user's modes"),
    PrivateAPI("torch", "torch._C:_get_function_stack_at", "torch_function_stack"),
    PrivateAPI("torch", "torch._C:_pop_torch_function_stack", "set_torch_function_stack"),
    PrivateAPI("torch", "torch._C:_push_on_torch_function_stack", "set_torch_function_stack"),
    PrivateAPI("torch", "torch.autograd:_profiler_enabled",
               "profiler_enabled: tasks show in torch.profiler traces only when profiling"),
    PrivateAPI("torch", "torch.cuda:_sleep", "cuda_sleep: pipeoff.testing delays on streams"),
    PrivateAPI("torch", "torch:_fused_adamw_",
               "fused_adam_kernel: the native host step's self-test (the reference bits)"),
    PrivateAPI("torch", "torch:_fused_adam_", "fused_adam_kernel"),
    PrivateAPI("torch", "torch.utils._python_dispatch:TorchDispatchMode",
               "pipeoff.testing's simulated CUDA device checks every access"),
    PrivateAPI("torch", "torch.utils._pytree:tree_flatten", "pipeoff.testing (the same)"),
    PrivateAPI("torch", "torch.utils._python_dispatch:_get_current_dispatch_mode",
               "dispatch_mode_active: foreach writes under a mode bump no version counter"),
    PrivateAPI("torch", "torch.distributed.tensor._utils:compute_local_shape_and_global_offset",
               "dtensor_box: the box of the global index space a DTensor shard holds "
               "(pipeoff.transfer.LiveTensor.from_dtensor)"),
    PrivateAPI("torch", "torch.distributed.fsdp:FSDPModule._get_fsdp_state",
               "fsdp_state: FSDP2 forward waits"),
    PrivateAPI("torch", "torch.distributed.fsdp._fully_shard._fsdp_state:FSDPState"
               "._fsdp_param_groups", "fsdp_sharded_params"),
    PrivateAPI("torch", "torch.distributed.fsdp._fully_shard._fsdp_state:FSDPState"
               "._states_to_forward_prefetch", "fsdp_prefetch_states"),
    PrivateAPI("torch", "torch.distributed.fsdp._fully_shard._fsdp_param_group:FSDPParamGroup"
               ".offload_policy",
               "fsdp_cpu_offload: FullOffloadOptimizer refuses CPUOffloadPolicy"),
    PrivateAPI("torch", "torch.autograd.graph:_engine_run_backward",
               "outer_backward_frame: a reentrant backward inside a backward"),
    PrivateAPI("torch", "torch._C:_current_graph_task_id",
               "backward_id: FullOffloadOptimizer tells one backward from the next"),
    PrivateAPI("torch", "torch._C:_ImperativeEngine.queue_callback",
               "queue_backward_callback: FullOffloadOptimizer sees each backward end"),
    PrivateAPI("torch", "torch._dynamo.compiled_autograd:compiled_autograd_enabled",
               "compiled_autograd_active: FullOffloadOptimizer refuses compiled autograd"),
    PrivateAPI("torch", "torch._dynamo.compiled_autograd:in_compiled_autograd_region",
               "compiled_autograd_active"),
    PrivateAPI("torch", "torch.distributed.fsdp._fully_shard._fsdp_state:FSDPState._comm_ctx",
               "fsdp_all_gather_streams"),
    PrivateAPI("torch", "torch.distributed.fsdp._fully_shard._fsdp_param_group:"
               "FSDPCommContext.all_gather_copy_in_stream", "fsdp_all_gather_streams"),
    PrivateAPI("torch", "torch.distributed.fsdp._fully_shard._fsdp_param_group:"
               "FSDPCommContext.all_gather_stream", "fsdp_all_gather_streams"),
    PrivateAPI("torch", "torch.optim.optimizer:Optimizer._patch_step_function",
               "init_optimizer_hooks: OffloadOptimizer fires step hooks like any optimizer"),
    PrivateAPI("torch", "torch.optim.optimizer:Optimizer.profile_hook_step",
               "step_body: the wrapper _patch_step_function installs (marked hooked, "
               "wrapping the class's step as __wrapped__)"),
    *(PrivateAPI("torch", f"torch.optim.optimizer:Optimizer.{name}",
                 "init_optimizer_hooks / hookless: the hook registries of an optimizer")
      for name in _HOOK_DICTS),
    PrivateAPI("torch", "torch.distributed.tensor:DTensor._local_tensor",
               "local_tensor: the shard a DTensor holds, the very tensor (its identity is "
               "what forward waits and the read guard key on)"),
    PrivateAPI("torch", "torch._dynamo.eval_frame:OptimizedModule._orig_mod",
               "compiled_original / runs_compiled: the module torch.compile wraps"),
    PrivateAPI("torch", "torch.nn.modules.module:Module._compiled_call_impl",
               "runs_compiled: a module compiled in place (module.compile())"),
    PrivateAPI("torch", "torch.nn.parallel.distributed:DistributedDataParallel._active_ddp_module",
               "active_data_parallel: a DDP wrapper put around a model after its "
               "FullOffloadOptimizer was built (seen in the model's forward)"),
    PrivateAPI("torch", "torch:Tensor._post_accumulate_grad_hooks", "post_accumulate_grad_hooks"),
    PrivateAPI("torch", "torch:Tensor._make_wrapper_subclass",
               "make_wrapper_subclass: FullOffloadOptimizer's gradient placeholders "
               "(param.grad stands for the host sum; the loop's clip calls see it)"),
    PrivateAPI("torch", "torch.optim.lr_scheduler:LRScheduler.step",
               "note_step_called: the flag (_opt_called) its order check reads"),
    PrivateAPI("torchft", "torchft.manager:Manager._pg",
               "issue_on_group: a failed replica still joins its peers' collectives"),
    PrivateAPI("torchft", "torchft.manager:_DummyWork", "skipped_by_torchft"),
    PrivateAPI("torchft", "torchft.local_sgd:LocalSGD._perform_sync",
               "pipeoff.ft.LocalSGD overrides it (torchft's extension point)"),
    PrivateAPI("torchft", "torchft.local_sgd:_StreamingDiLoCoFragment",
               "DiLoCo's offloaded fragment subclasses it (backups, hooks, settings)"),
    *(PrivateAPI("torchft", f"torchft.local_sgd:_StreamingDiLoCoFragment.{name}",
                 f"DiLoCo: {used}") for name, used in (
        ("_fragment_id", "which fragment a sync is (spans, stats)"),
        ("_fragment_sync_delay", "the formation goes first when > 0"),
        ("_fragment_update_alpha", "the merge's lerp weight"),
        ("_model_fragment", "the fragment's parameters"),
        ("_outer_optimizer", "the host mirror of the outer optimizer"),
        ("_local_optimizer", "the inner optimizer waited for before a sync"),
        ("_manager", "the all-reduces and the commit"))),
    PrivateAPI("torchft", "torchft.local_sgd:DiLoCo._fragments",
               "DiLoCo: its fragments, replaced by offloaded ones"),
    PrivateAPI("torchft", "torchft.local_sgd:DiLoCo._current_fragment",
               "pipeoff.ft.DiLoCo overrides it: torchft's choice of the fragment to sync, and the "
               "inner optimizer's wait before it"),
    *(PrivateAPI("torchft", f"torchft.local_sgd:DiLoCo.{name}", "DiLoCo: the sync schedule")
      for name in ("_fragment_sync_delay", "_sync_every")),
    PrivateAPI("torchft", "torchft.local_sgd:DiLoCo._local_step",
               "DiLoCo: the sync schedule (reset to 0 after a fragment sync)"),
    PrivateAPI("torchft", "torchft.local_sgd:DiLoCo._local_optimizer",
               "DiLoCo: the inner optimizer (its step count, waits)"),
    PrivateAPI("torchft", "torchft.local_sgd:DiLoCo._manager", "DiLoCo: the replica's Manager"),
    *(PrivateAPI("torchft", f"torchft.local_sgd:DiLoCo.{name}",
                 "pipeoff.ft.DiLoCo overrides it (its spans and waits)")
      for name in ("_step_pre_hook", "_step_post_hook")),
    PrivateAPI("torchft", "torchft.local_sgd:DiLoCo._register_state_dict_fn",
               "pipeoff.ft.DiLoCo overrides it (the host outer state)"),
    PrivateAPI("torchft", "torchft.local_sgd:LocalSGD._local_optimizer",
               "LocalSGD: the inner optimizer (its step count, waits)"),
    PrivateAPI("torchft", "torchft.local_sgd:LocalSGD._manager", "LocalSGD: its Manager"),
    PrivateAPI("torchft", "torchft.local_sgd:LocalSGD._model", "LocalSGD: the averaged params"),
    PrivateAPI("torchft", "torchft.local_sgd:LocalSGD._step_post_hook", "LocalSGD overrides it"),
)
"""Every private name pipeoff uses."""


def _resolve(path: str) -> None:
    module, _, attrs = path.partition(":")
    obj: Any = importlib.import_module(module)
    for i, name in enumerate(attrs.split(".")):
        if hasattr(obj, name):
            obj = getattr(obj, name)
            continue
        # An instance attribute (FSDPState._comm_ctx): the class annotates it,
        # or one of its methods sets it (``self.name = ...``).
        if isinstance(obj, type) and i == len(attrs.split(".")) - 1 and (
                name in getattr(obj, "__annotations__", {})
                or any(name in f.__code__.co_names for f in vars(obj).values()
                       if hasattr(f, "__code__"))):
            return
        raise AttributeError(f"{'.'.join(attrs.split('.')[:i]) or module} has no {name!r}")


def installed_version(package: str) -> str | None:
    """The installed version of ``package`` (its distribution's), or ``None``."""
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def check_private_apis(package: str | None = None) -> list[str]:
    """Resolve every private API (of ``package``, or all); the problems found, each
    naming the API, the installed version and the tested range."""
    problems = []
    for api in PRIVATE_APIS:
        if package is not None and api.package != package:
            continue
        version = installed_version(api.package)
        if version is None:
            continue  # an optional package (torchft) that is not installed
        try:
            _resolve(api.path)
        except (ImportError, AttributeError) as err:
            lo, hi = TESTED[api.package]
            problems.append(
                f"{api.path} (used for {api.used_for}) is gone in {api.package} {version} "
                f"(tested {lo} to {hi}): {err}")
    return problems

F = TypeVar("F", bound=Callable[..., Any])


def dynamo_disable(fn: F) -> F:
    """``fn`` made opaque to Dynamo (``torch.compiler.disable``): under ``torch.compile``
    it runs eagerly at every call, where the compiled code would call it.

    Imported lazily: ``torch.compiler.disable`` loads Dynamo (and with it
    torch.distributed), which ``import pipeoff`` must not.
    """
    return torch.compiler.disable(fn)  # type: ignore[no-any-return]


def dispatch_mode_active() -> bool:
    """Whether a ``TorchDispatchMode`` is active on this thread (``FlopCounterMode``)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return _get_current_dispatch_mode() is not None


def is_compiling() -> bool:
    """Whether Dynamo is tracing the calling code (``torch.compiler.is_compiling``)."""
    return torch.compiler.is_compiling()


def force_eager() -> Any:
    """Make every ``torch.compile``d function run eagerly until :func:`restore_stance`.

    Returns the prior stance, or ``None`` if the stance cannot be set here
    (inside a compiled region). Uses ``torch._dynamo.eval_frame._set_stance``
    (the function behind ``torch.compiler.set_stance``, which returns the prior
    stance only through this private path).
    """
    from torch._dynamo import eval_frame

    try:
        return eval_frame._set_stance(eval_frame.DynamoStance(stance="force_eager"))
    except RuntimeError:  # "attempted to set_stance in a torch.compile region"
        return None


def restore_stance(prior: Any) -> bool:
    """Put back a stance :func:`force_eager` returned; whether it could be done here."""
    if prior is None:
        return True
    from torch._dynamo import eval_frame

    try:
        eval_frame._set_stance(prior)
    except RuntimeError:
        return False
    return True


def recompile_with_hooks(modules: Iterable[torch.nn.Module]) -> None:
    """Make ``torch.compile`` see forward hooks added to ``modules`` now.

    Dynamo skips guarding on module hook dicts by default
    (``torch._dynamo.config.skip_nnmodule_hook_guards``): code compiled before a
    hook was added keeps running without it, silently. This turns the guard on
    (process-wide; a small guard cost per compiled frame) and drops the code
    compiled for these modules' ``forward``, ``nn.Module``'s call path and the
    frame a compiled ``torch.nn.*`` root runs in (``wrap_inline``'s ``inner``)
    (``reset_code``), so the next call recompiles with the hooks in.
    """
    import torch._dynamo
    import torch._dynamo.external_utils as eu
    from torch._C._dynamo.eval_frame import reset_code

    torch._dynamo.config.skip_nnmodule_hook_guards = False
    inline = getattr(eu, "wrap_inline", None)
    codes = {torch.nn.Module._call_impl.__code__, torch.nn.Module._wrapped_call_impl.__code__,
             *(c for c in (inline.__code__.co_consts if inline else ()) if hasattr(c, "co_code"))}
    for m in modules:
        code = getattr(getattr(type(m), "forward", None), "__code__", None)
        if code is not None:
            codes.add(code)
    for code in codes:
        reset_code(code)


_eager_math_lock = threading.RLock()
_session_patched = False
_patch_lock = threading.Lock()


def eager_math() -> contextlib.AbstractContextManager[Any]:
    """Hold off ``torch.compile`` sessions while torch's optimizer kernels run on this thread.

    ``torch.compiler.is_compiling()`` reads one process-wide flag that Dynamo
    sets for the whole of a compile session, on whichever thread compiles
    (``torch.compiler._compile_session_context``). torch's optimizers branch on
    it (``torch.optim.optimizer._get_value`` keeps ``step`` a tensor while
    compiling), so an optimizer stepping on a lane thread while the training
    thread compiles its next forward takes the compiled code path and gives
    different bits. pipeoff wraps the session context so that a compile session
    and a chunk's math never overlap: the session waits for the chunk's math
    (milliseconds), the chunk waits for the session. ``torch.export`` sets the
    flag without that context and is not covered.
    """
    global _session_patched
    if not _session_patched:
        with _patch_lock:
            if not _session_patched:
                original = torch.compiler._compile_session_context

                @contextlib.contextmanager
                def session() -> Iterator[None]:
                    with _eager_math_lock, original():
                        yield

                session.__wrapped__ = original  # type: ignore[attr-defined]
                torch.compiler._compile_session_context = session
                _session_patched = True
    return _eager_math_lock


def issue_on_group(manager: Any, tensor: torch.Tensor) -> Any:
    """Issue a SUM all-reduce of ``tensor`` in place on ``manager``'s process group
    (``Manager._pg``), bypassing the manager (a no-op once an error was reported), as
    ``pipeoff/ft/_collective.py`` joins a failed replica's collectives. Its work, or
    ``None`` without a torch process group (a test's mock: no peers). Raises what
    issuing it raised (not joined)."""
    from torch.distributed import AllreduceOptions, ProcessGroup, ReduceOp

    pg = getattr(manager, "_pg", None)
    if not isinstance(pg, ProcessGroup):
        return None
    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp(ReduceOp.SUM)
    return pg.allreduce([tensor], opts)


def skipped_by_torchft(work: Any) -> bool:
    """Whether torchft's ``Manager.allreduce`` returned without joining the collective."""
    return isinstance(work, importlib.import_module("torchft.manager")._DummyWork)


def cuda_sleep(cycles: int) -> None:
    """Spin the current CUDA stream for ``cycles`` GPU clock cycles (``torch.cuda._sleep``)."""
    torch.cuda._sleep(cycles)


def fused_adam_kernel(decoupled: bool) -> Callable[..., None]:
    """torch's fused multi-tensor Adam (``decoupled=False``) or AdamW kernel, the one
    ``torch.optim.AdamW(fused=True)`` runs (``torch._fused_adam_`` / ``_fused_adamw_``)."""
    fn: Callable[..., None] = (torch._fused_adamw_ if decoupled  # type: ignore[attr-defined]
                               else torch._fused_adam_)  # type: ignore[attr-defined]
    return fn


def profiler_enabled() -> bool:
    """Whether torch.profiler is recording (``torch.autograd._profiler_enabled``)."""
    return bool(torch.autograd._profiler_enabled())  # type: ignore[attr-defined]


def torch_function_stack() -> list[Any]:
    """This thread's ``TorchFunctionMode`` stack, bottom first (``torch._C``'s stack API)."""
    n = torch._C._len_torch_function_stack()
    return [torch._C._get_function_stack_at(k) for k in range(n)]


def set_torch_function_stack(modes: list[Any]) -> None:
    """Replace this thread's ``TorchFunctionMode`` stack with ``modes``, bottom first."""
    while torch._C._len_torch_function_stack():
        torch._C._pop_torch_function_stack()
    for m in modes:
        torch._C._push_on_torch_function_stack(m)


def fsdp_state(module: Any) -> Any:
    """An FSDP2 module's state (``FSDPModule._get_fsdp_state``)."""
    return module._get_fsdp_state()


def fsdp_sharded_params(state: Any) -> list[torch.Tensor]:
    """The sharded parameters (DTensors) an FSDP2 state manages."""
    return [fp.sharded_param for g in state._fsdp_param_groups for fp in g.fsdp_params]


def fsdp_prefetch_states(state: Any) -> list[Any]:
    """The states whose all-gather this one's forward prefetches
    (``set_modules_to_forward_prefetch``)."""
    return list(state._states_to_forward_prefetch)


def fsdp_all_gather_streams(state: Any) -> tuple[Any, ...]:
    """The streams FSDP2's all-gathers read the shards on (copy-in, and the collective)."""
    ctx = state._comm_ctx
    return tuple(s for s in (getattr(ctx, a, None) for a in ("all_gather_copy_in_stream",
                                                            "all_gather_stream"))
                 if s is not None)


def fsdp_gradient_sync(module: Any) -> bool | None:
    """Whether an FSDP2 module reduces gradients this backward
    (``set_requires_gradient_sync``); ``None`` for a module FSDP2 does not manage."""
    try:
        state = module._get_fsdp_state()
    except AttributeError:
        return None
    groups = getattr(state, "_fsdp_param_groups", None) or []
    if not groups:
        return None
    return all(getattr(g, "reduce_grads", True) for g in groups)


def data_parallel(model: Any) -> Any:
    """The ``DistributedDataParallel`` (torch's, or a subclass such as torchft's) that is
    ``model`` or one of its modules, or ``None``."""
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    for m in model.modules():
        if isinstance(m, DistributedDataParallel):
            return m
    return None


def active_data_parallel() -> Any:
    """The ``DistributedDataParallel`` whose forward is running (it calls its module's
    forward inside), or ``None``."""
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:  # pragma: no cover
        return None
    return getattr(DistributedDataParallel, "_active_ddp_module", None)


def ddp_gradient_sync(ddp: Any) -> bool:
    """Whether a ``DistributedDataParallel`` reduces gradients in this backward (not
    inside its ``no_sync()``)."""
    return bool(getattr(ddp, "require_backward_grad_sync", True))


def fsdp_cpu_offload(module: Any) -> bool:
    """Whether an FSDP2 module keeps its parameters under ``CPUOffloadPolicy``."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    try:
        state = module._get_fsdp_state()
    except AttributeError:
        return False
    return any(isinstance(getattr(g, "offload_policy", None), CPUOffloadPolicy)
               for g in getattr(state, "_fsdp_param_groups", None) or [])


def backward_id() -> int:
    """The id of the autograd graph task running on this thread, or -1 outside a backward."""
    return int(torch._C._current_graph_task_id())


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the backward running on this thread ends (as FSDP2 does)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)  # type: ignore[attr-defined]


def post_accumulate_grad_hooks(p: torch.Tensor) -> list[Callable[..., Any]]:
    """The post-accumulate-grad hooks registered on ``p``, in order."""
    return list((p._post_accumulate_grad_hooks or {}).values())


def compiled_autograd_active() -> bool:
    """Whether compiled autograd is on (it skips post-accumulate-grad hooks)."""
    try:
        from torch._dynamo import compiled_autograd as ca
    except ImportError:  # pragma: no cover - torch without dynamo
        return False
    return bool(getattr(ca, "compiled_autograd_enabled", False)
                or getattr(ca, "in_compiled_autograd_region", False))


def _engine_frames() -> list[Any]:
    import sys

    from torch.autograd import graph

    code = graph._engine_run_backward.__code__
    out = []
    f: Any = sys._getframe(2)
    while f is not None:
        if f.f_code is code:
            out.append(f)
        f = f.f_back
    return out


def outermost_backward_frame() -> Any:
    """The Python frame of the outermost backward running on this thread, or ``None``."""
    frames = _engine_frames()
    return frames[-1] if frames else None


def outer_backward_frame() -> Any:
    """If this runs inside a backward nested in another (a reentrant checkpoint's
    recomputation), the outermost backward's frame; else ``None``."""
    frames = _engine_frames()
    return frames[-1] if len(frames) > 1 else None


def optimizer_hooks(opt: torch.optim.Optimizer, kind: str) -> list[Callable[..., Any]]:
    """``opt``'s own hooks of one ``kind`` (``"step_pre"``, ``"state_dict_post"``...), a list."""
    return list(getattr(opt, f"_optimizer_{kind}_hooks", {}).values())


def note_step_called(opt: torch.optim.Optimizer) -> None:
    """Set what an LR scheduler's wrapper of ``opt.step`` sets (pipeoff steps around it)."""
    opt._opt_called = True  # type: ignore[attr-defined]


def init_optimizer_hooks(opt: torch.optim.Optimizer) -> None:
    """Give ``opt`` (no ``__init__`` ran) hook registries, its class the hooks' step wrapper."""
    hookless(opt)
    opt._patch_step_function()


def hookless(opt: torch.optim.Optimizer) -> None:
    """Give ``opt`` (built without ``__init__``) empty hook registries of its own."""
    for name in _HOOK_DICTS:
        opt.__dict__[name] = collections.OrderedDict()


def step_body(cls: type[torch.optim.Optimizer]) -> Callable[..., Any]:
    """The body of ``cls.step`` without the wrapper that fires the step hooks (and the
    profiler range) around it, as ``_patch_step_function`` installed it."""
    step = cls.step
    if getattr(step, "hooked", False):
        return step.__wrapped__  # type: ignore[attr-defined, no-any-return]
    return step


def make_wrapper_subclass(cls: type[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """A tensor of class ``cls`` with ``like``'s shape, strides, dtype and device and no
    storage (``Tensor._make_wrapper_subclass``, as DTensor and FakeTensor build theirs):
    ``cls.__torch_dispatch__`` answers every operation on it."""
    return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined, no-any-return]
        cls, like.shape, strides=like.stride(), dtype=like.dtype, device=like.device,
        layout=like.layout, requires_grad=False)


def local_tensor(t: torch.Tensor, *, data: bool = False) -> torch.Tensor:
    """The local shard of a DTensor (the tensor object it holds, not a view), or ``t``:
    pipeoff's one local-shard helper. ``data=True``: of ``t.data``, sharing its storage
    outside autograd (what LocalSGD and DiLoCo read and write of a parameter)."""
    if data:
        t = t.data
    return getattr(t, "_local_tensor", t) if hasattr(t, "placements") else t


def compiled_original(module: torch.nn.Module) -> torch.nn.Module:
    """The module a ``torch.compile`` wrapper (``OptimizedModule``) compiles, else ``module``."""
    while isinstance(getattr(module, "_orig_mod", None), torch.nn.Module):
        module = module._orig_mod  # type: ignore[assignment]
    return module


def uncompiled_name(name: str) -> str:
    """A module or parameter name without the ``_orig_mod`` levels ``torch.compile``'s
    wrappers add (``_orig_mod.layers.0`` -> ``layers.0``)."""
    import re

    return re.sub(r"(^|\.)_orig_mod(\.|$)", r"\1", name).strip(".")


def runs_compiled(model: torch.nn.Module) -> bool:
    """Whether ``model`` (or a module in it) runs ``torch.compile``'d code: a wrapper
    (``torch.compile(model)``) or a module compiled in place (``module.compile()``)."""
    return any(hasattr(m, "_orig_mod") or getattr(m, "_compiled_call_impl", None) is not None
               for m in model.modules())


def dtensor_box(dt: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(offsets, sizes)``: the box of ``dt``'s global index space that this rank's
    local tensor holds (any mesh, ``Shard`` and ``Replicate`` placements)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    sizes, offsets = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh,
                                                           dt.placements)
    return tuple(int(o) for o in offsets), tuple(int(s) for s in sizes)
