"""Forward waits: pre-forward hooks that wait only for the chunks a module's forward reads.

On FSDP2 each FSDP module gets a ``prepend=True`` pre-forward hook (so it runs
before FSDP's own, which issues the all-gathers). It waits for the chunks of
the module's own parameters and of the modules it prefetches, whose
all-gathers FSDP issues inside this module's pre-forward. On a plain module
tree each module that owns parameters gets a hook for the parameters of its
subtree (a forward may read a child's parameters without calling the child);
so do the parameters of an FSDP2 model that no FSDP module manages.
torch.distributed is imported only when the model is an FSDP2 model.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from pipeoff._errors import ConfigError

if TYPE_CHECKING:
    from pipeoff.optim.offload import OffloadOptimizer

__all__ = ["install"]


def _fsdp_module_type() -> type[torch.nn.Module] | None:
    if "torch.distributed.fsdp" not in sys.modules and not torch.distributed.is_available():
        return None
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch built without distributed
        return None
    return FSDPModule  # type: ignore[return-value]  # a mixin of nn.Module subclasses


def install(opt: OffloadOptimizer, model: torch.nn.Module) -> list[Any]:
    """Install the forward waits of ``opt`` on ``model``; returns the hook handles.

    Raises:
        ConfigError: an optimizer parameter is not a parameter of ``model``.
    """
    from pipeoff.optim._tensors import describe

    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"attach() needs a torch.nn.Module, got {model!r}")
    index = {id(p): i for i, p in enumerate(opt._params)}
    owned = {id(p) for p in model.parameters()}
    for i, p in enumerate(opt._params):
        if id(p) not in owned:
            raise ConfigError(
                f"{describe(i, p)} of the optimizer is not a parameter of the "
                f"{type(model).__name__} given to attach(); attach the model whose "
                "parameters the optimizer updates"
            )
    fsdp = _fsdp_module_type()
    handles = []
    plain = index
    if fsdp is not None and any(isinstance(m, fsdp) for m in model.modules()):
        opt._fsdp_root = model if isinstance(model, fsdp) else None
        fsdp_modules = [(n, m) for n, m in model.named_modules() if isinstance(m, fsdp)]
        handles = [
            m.register_forward_pre_hook(_fsdp_hook(opt, index, n or "root"), prepend=True,
                                        with_kwargs=True)
            for n, m in fsdp_modules
        ]
        # Parameters no FSDP module manages (a plain head outside every
        # fully_shard unit, under a root that is not sharded) get plain hooks.
        managed = {i for _, m in fsdp_modules
                   for i in _owned(m._get_fsdp_state(), index)}  # type: ignore[operator]
        plain = {k: i for k, i in index.items() if i not in managed}
    names = {m: n or type(m).__name__ for n, m in model.named_modules()}
    for m in model.modules():
        if not any(id(p) in plain for p in m.parameters(recurse=False)):
            continue
        # Wait for the whole subtree, not only the module's own parameters: a
        # forward may read a child's parameters without calling the child
        # (nn.MultiheadAttention reads out_proj.weight), and that child's own
        # hook would then never run.
        mine = tuple(sorted({plain[id(p)] for p in m.parameters() if id(p) in plain}))
        handles.append(m.register_forward_pre_hook(_plain_hook(opt, mine, names[m]),
                                                   prepend=True))
    return handles


def _plain_hook(opt: OffloadOptimizer, params: tuple[int, ...], name: str) -> Any:
    cuda = opt.device.type == "cuda"

    def hook(module: torch.nn.Module, args: Any) -> None:
        if opt._inflight is None:
            return
        streams: Sequence[Any] = (torch.cuda.current_stream(opt.device),) if cuda else ()
        opt._wait_params(params, streams, name)

    return hook


def _owned(state: Any, index: dict[int, int]) -> list[int]:
    return [index[id(fp.sharded_param)] for g in state._fsdp_param_groups
            for fp in g.fsdp_params if id(fp.sharded_param) in index]


def _fsdp_hook(opt: OffloadOptimizer, index: dict[int, int], name: str) -> Any:
    cuda = opt.device.type == "cuda"

    def hook(module: Any, args: Any, kwargs: Any) -> None:
        if opt._inflight is None:
            return
        state = module._get_fsdp_state()
        # Read the prefetch list now: set_modules_to_forward_prefetch may change it.
        mine = set(_owned(state, index))
        for other in state._states_to_forward_prefetch:
            mine.update(_owned(other, index))
        streams: list[Any] = []
        if cuda:
            streams.append(torch.cuda.current_stream(opt.device))
            ctx = state._comm_ctx
            # The all-gathers read the shards on these streams, which do not
            # sync with the compute stream again after the root's pre-forward.
            for attr in ("all_gather_copy_in_stream", "all_gather_stream"):
                s = getattr(ctx, attr, None)
                if s is not None:
                    streams.append(s)
        opt._wait_params(tuple(sorted(mine)), streams, name)

    return hook
