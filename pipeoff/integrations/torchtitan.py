"""torchtitan's ``OptimizersContainer`` with pipeoff's optimizers inside it.

torchtitan builds its optimizers from ``config.optimizer`` (an
``OptimizersContainer.Config``) once the parallelisms are applied:
``config.optimizer.build(model_parts=...)``. :class:`PipeoffOptimizersContainer`
is a subclass of that container whose nested ``Config`` adds pipeoff's choices;
everything else (param groups by regex, ``implementation``, the flat FQN-keyed
checkpoints, the LR schedulers, torchtitan's gradient clipping) is torchtitan's.
Swap one of two things:

* in a trainer config, ``optimizer=PipeoffOptimizersContainer.Config(...)``
  (``param_groups=default_adamw(lr=...).param_groups`` works as it is);
* in a loop of your own, ``config.optimizer.build(model_parts=parts)`` for
  ``build_optimizers(parts, config.optimizer, full_offload=True)``.

Which optimizer it wraps (one per model part and optimizer name, as torchtitan's):

* ``full_offload=False`` (the default): :class:`~pipeoff.optim.OffloadOptimizer`
  around the ``torch.optim`` class torchtitan picks. The optimizer state (AdamW:
  8 bytes per parameter) lives in host memory and moves through the device in
  chunks each step; parameters and gradients stay on the device. Use it when the
  weights and gradients fit on the device but the state does not.
* ``full_offload=True``: :class:`~pipeoff.optim.FullOffloadOptimizer`: FP32
  masters, optimizer state and the gradient sums (16 bytes per parameter under
  AdamW) live in host memory and the CPU steps the masters; only the compute
  weights stay on the device. Use it when the device holds little more than the
  weights and activations; it moves every gradient to the host, so it is slower
  where the state would fit.

On CUDA, set torchtitan's ``training.disable_cuda_graphs=True``: a CUDA graph
replay of the forward and backward (torchtitan 0.3's default) runs none of the
Python hooks these optimizers put there.

torchtitan is imported when :class:`PipeoffOptimizersContainer` is first looked up
(a module ``__getattr__`` defines it then, once) or :func:`build_optimizers` is
first called: ``import pipeoff.integrations.torchtitan`` alone imports nothing of
torchtitan's.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch

from pipeoff._errors import ConfigError, UnsupportedOptimizerError

if TYPE_CHECKING:
    PipeoffOptimizersContainer: Any  # defined on first lookup, by __getattr__ below

__all__ = ["PipeoffOptimizersContainer", "build_optimizers"]

_OVERLAPS = ("forward", "none")
"""The ``overlap`` values the container takes (both optimizers' names)."""

# What the container passes itself, so a Config's offload_kwargs may not.
_SET_HERE = {
    "mode": "set overlap='forward' (overlap mode) or 'none' (chunked) instead",
    "overlap": "it is a Config field",
    "chunk_bytes": "it is a Config field",
    "max_norm": ("torchtitan's training.max_norm clips already (a FullOffloadOptimizer "
                 "refuses clipping twice)"),
    "optimizer": "the container builds it from param_groups",
    "optimizer_class": "param_groups' optimizer_name picks it",
    "params": "param_groups pick the parameters",
    "model": "the container passes each model part",
}


def __getattr__(name: str) -> Any:
    if name == "PipeoffOptimizersContainer":
        return _container_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def build_optimizers(
    model_parts: Sequence[torch.nn.Module],
    optimizer_config: Any,
    *,
    full_offload: bool | None = None,
    overlap: str | None = None,
    chunk_bytes: int | str | None = None,
    offload_kwargs: dict[str, Any] | None = None,
) -> Any:
    """``optimizer_config.build(model_parts=model_parts)``, with pipeoff's optimizers.

    Args:
        model_parts: the model parts torchtitan trains (a list of modules: one, or
            one per pipeline stage), after the parallelisms are applied.
        optimizer_config: torchtitan's ``OptimizersContainer.Config`` (for example
            ``default_adamw(lr=3e-4)``); its fields are copied. A
            ``PipeoffOptimizersContainer.Config`` keeps its own pipeoff fields
            where the arguments below are ``None``.
        full_offload: ``False`` (default): :class:`~pipeoff.optim.OffloadOptimizer`;
            ``True``: :class:`~pipeoff.optim.FullOffloadOptimizer` (see the module's
            docstring for which to choose).
        overlap: ``"forward"`` (default): ``step()`` returns with the step in
            flight and each read of a weight waits for it; ``"none"``: ``step()``
            returns when the step is done.
        chunk_bytes: the most bytes of one chunk's optimizer state
            (``OffloadOptimizer``) or FP32 masters (``FullOffloadOptimizer``), an int
            or a string such as ``"256MiB"``; ``None``: the optimizer's default.
        offload_kwargs: other keyword arguments of the chosen optimizer
            (``prefetch=``, ``accumulate="gpu"``, ``pin_memory=``...).

    Returns:
        A ``PipeoffOptimizersContainer`` (a torchtitan ``OptimizersContainer``).

    Raises:
        ConfigError: ``model_parts`` is not a non-empty list of modules,
            ``optimizer_config`` is not an ``OptimizersContainer.Config``, or a
            pipeoff field is refused (see ``PipeoffOptimizersContainer.Config``).
        UnsupportedOptimizerError: a param group's optimizer is not an element-wise
            ``torch.optim`` class (``DistMuon``).
        ModuleNotFoundError: torchtitan is not installed.
    """
    if isinstance(model_parts, torch.nn.Module) or not isinstance(model_parts, Sequence) or \
            not model_parts or not all(isinstance(m, torch.nn.Module) for m in model_parts):
        raise ConfigError("model_parts must be a non-empty list of torch.nn.Module (torchtitan's "
                          f"model parts, e.g. [model]), got {model_parts!r:.80}")
    container = _container_class()
    from torchtitan.components.optimizer import OptimizersContainer

    if not isinstance(optimizer_config, OptimizersContainer.Config):
        raise ConfigError("optimizer_config must be torchtitan's OptimizersContainer.Config "
                          "(e.g. default_adamw(lr=3e-4)), got "
                          f"{type(optimizer_config).__name__}")
    given = {"full_offload": full_offload, "overlap": overlap, "chunk_bytes": chunk_bytes,
             "offload_kwargs": offload_kwargs}
    ours = {f.name for f in dataclasses.fields(container.Config)}
    fields = {f.name: getattr(optimizer_config, f.name)
              for f in dataclasses.fields(optimizer_config) if f.init and f.name in ours}
    fields.update({k: v for k, v in given.items() if v is not None})
    return container.Config(**fields).build(model_parts=list(model_parts))


# -- the container ---------------------------------------------------------------------
@functools.cache
def _container_class() -> Any:
    """Define :class:`PipeoffOptimizersContainer` (importing torchtitan), once."""
    try:
        from torchtitan.components.optimizer import OptimizersContainer
    except ImportError as err:
        raise ModuleNotFoundError(
            "pipeoff.integrations.torchtitan needs torchtitan (pip install torchtitan): "
            f"{err}") from err
    try:
        # The one torchtitan private this overrides (torchtitan 0.3's factory, per
        # optimizer name): say so here rather than build torch's optimizers silently.
        resolve = OptimizersContainer._resolve_optimizer_factory
    except AttributeError as err:
        raise ImportError("pipeoff.integrations.torchtitan overrides torchtitan's "
                          "OptimizersContainer._resolve_optimizer_factory (torchtitan 0.3), "
                          "which this torchtitan does not have") from err

    from pipeoff.optim import FullOffloadOptimizer, OffloadOptimizer

    class PipeoffOptimizersContainer(OptimizersContainer):  # type: ignore[misc,valid-type]
        """torchtitan's ``OptimizersContainer`` building pipeoff's optimizers.

        torchtitan groups the parameters of each model part by ``param_groups``'
        regexes and builds one optimizer per part and ``optimizer_name``; here each
        is an :class:`~pipeoff.optim.OffloadOptimizer` around the ``torch.optim``
        class (``Config.full_offload=False``) or a
        :class:`~pipeoff.optim.FullOffloadOptimizer` of that class over the part
        (``True``). Results are bitwise those of torchtitan's own container.

        Checkpoints are torchtitan's: ``state_dict()`` is its flat dict keyed
        ``state.<fqn>.<name>`` and ``param_groups.<fqn>.<key>`` (creating state
        first with a zero-gradient, zero-lr step), with torchtitan's keys, so that
        either container loads (``torch.distributed.checkpoint.load``, strict as
        torchtitan's checkpointer calls it) what the other saved. Under full offload
        a parameter whose weight is not FP32 (BF16, say) also saves its FP32 master,
        as ``state.<fqn>.master``; an FP32 weight is its master bit for bit, and a
        master missing from a loaded dict is taken from the weight (load the model
        first, as torchtitan's checkpointer does).

        Clipping is torchtitan's: its train step's ``clip_grad_norm_`` sees the
        gradients (under full offload, :class:`~pipeoff.optim.HostGrad` placeholders
        for the host sums, scaled in the step).

        Args:
            config: a ``PipeoffOptimizersContainer.Config``.
            model_parts: the model parts, by keyword (and any other keyword a
                subclass's ``__init__`` in the MRO takes, passed on).

        Raises:
            ConfigError: ``config`` is not this class's ``Config`` (the ``Config``
                itself refuses its fields at construction, naming the field).
            UnsupportedOptimizerError: an ``optimizer_name`` builds something that is
                not an element-wise ``torch.optim`` class (``DistMuon``).
        """

        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(OptimizersContainer.Config):  # type: ignore[misc,name-defined]
            """torchtitan's ``OptimizersContainer.Config`` and pipeoff's choices (checked at
            construction: ``ConfigError`` names the field)."""

            full_offload: bool = False
            """``False``: ``OffloadOptimizer`` (state on the host); ``True``:
            ``FullOffloadOptimizer`` (masters, state and gradient sums on the host)."""

            overlap: Literal["forward", "none"] = "forward"
            """``"forward"``: ``step()`` returns with the step in flight, each read of a
            weight waits for the chunks writing it; ``"none"``: ``step()`` waits."""

            chunk_bytes: int | str | None = None
            """Bytes of one chunk's state (``OffloadOptimizer``) or FP32 masters
            (``FullOffloadOptimizer``), e.g. ``"256MiB"``; ``None``: the optimizer's
            default (1 GiB; 16 Mi elements)."""

            offload_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
            """Other keyword arguments of the chosen optimizer (``prefetch``,
            ``accumulate``, ``pin_memory``, ``slot_bytes``...)."""

            def __post_init__(self) -> None:
                _check(self)

        def __init__(self, config: Any, **kwargs: Any) -> None:
            if not isinstance(config, PipeoffOptimizersContainer.Config):
                raise ConfigError(
                    "config must be a PipeoffOptimizersContainer.Config, got "
                    f"{type(config).__name__} (build_optimizers() takes torchtitan's)")
            self._pipeoff = config
            super().__init__(config, **kwargs)

        def _resolve_optimizer_factory(self, name: str) -> Callable[..., Any]:
            # An instance method here: torchtitan's is a staticmethod, called on self.
            return functools.partial(self._build_optimizer, name, resolve(name))

        def _build_optimizer(self, name: str, cls: Any, groups: list[dict[str, Any]],
                             **kwargs: Any) -> torch.optim.Optimizer:
            """The optimizer torchtitan asks for: ``cls`` over ``groups`` (of one model
            part, each with torchtitan's ``param_names``), offloaded.

            Raises:
                UnsupportedOptimizerError: ``cls`` is not a ``torch.optim`` class.
            """
            if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
                raise UnsupportedOptimizerError(
                    f"param_groups' optimizer_name {name!r} builds {cls!r}, not a "
                    "torch.optim class: pipeoff steps element-wise torch.optim optimizers "
                    "(Adam, AdamW)")
            config = self._pipeoff
            options: dict[str, Any] = {"overlap": config.overlap, **config.offload_kwargs}
            if config.chunk_bytes is not None:
                options["chunk_bytes"] = config.chunk_bytes
            if not config.full_offload:
                return OffloadOptimizer(cls(groups, **kwargs), **options)
            first = groups[0]["params"][0]
            part = next(m for m in self.model_parts
                        if any(p is first for p in m.parameters()))
            # param_names stay on the groups: torchtitan's checkpoints key the state by them.
            return FullOffloadOptimizer(part, cls, params=groups, **options, **kwargs)

        def state_dict(self) -> dict[str, Any]:
            """torchtitan's flat, FQN-keyed state dict of every optimizer; under full
            offload with ``state.<fqn>.master`` for each parameter whose weight is not
            FP32."""
            out = dict(super().state_dict())  # (a copy: a subclass may cache its dict)
            for fqn in _masters_equal_to_weights(self.optimizers):
                out.pop(f"state.{fqn}.master", None)
            return out

        def wait_for_step(self) -> None:
            """Block until every optimizer's step in flight has written its parameters
            (``pipeoff.ft.LocalSGD`` calls it before a sync)."""
            for opt in self.optimizers:
                opt.wait_for_step()

        def refresh_masters(self, params: Any = None) -> None:
            """Make the FP32 masters of full offload the weights written from outside
            (``pipeoff.ft.LocalSGD`` calls it after a committed average; see
            :meth:`pipeoff.optim.FullOffloadOptimizer.refresh_masters`). Without
            full offload there are no masters and it does nothing.

            Args:
                params: the parameters written (default: all).
            """
            params = None if params is None else list(params)
            for opt in self.optimizers:
                if isinstance(opt, FullOffloadOptimizer):
                    opt.refresh_masters(params)

        def host_master(self, param: torch.Tensor) -> torch.Tensor:
            """``param``'s FP32 host master, from the full-offload optimizer that holds it
            (see :meth:`pipeoff.optim.FullOffloadOptimizer.host_master`).

            Raises:
                ConfigError: no full-offload optimizer of this container holds it.
            """
            for opt in self.optimizers:
                if isinstance(opt, FullOffloadOptimizer):
                    try:
                        return opt.host_master(param)
                    except ConfigError:
                        continue
            raise ConfigError("no FullOffloadOptimizer of this container holds the parameter")

    # Named as if defined at the top of this module (pickle, reprs, torchtitan's logs).
    for cls, qualname in ((PipeoffOptimizersContainer, "PipeoffOptimizersContainer"),
                          (PipeoffOptimizersContainer.Config,
                           "PipeoffOptimizersContainer.Config")):
        cls.__module__ = __name__
        cls.__qualname__ = qualname
    return PipeoffOptimizersContainer


def _check(config: Any) -> None:
    """Refuse a Config's pipeoff fields (and torchtitan's that pipeoff cannot honour).

    Raises:
        ConfigError: naming the field, the value and what is accepted.
    """
    if not isinstance(config.full_offload, bool):
        raise ConfigError(f"full_offload must be True or False, got {config.full_offload!r}")
    if config.overlap not in _OVERLAPS:
        hint = (" (overlap='backward' steps inside the backward, before torchtitan's train "
                "step clips)" if config.overlap == "backward" else "")
        raise ConfigError(f"overlap must be one of {_OVERLAPS}, got {config.overlap!r}{hint}")
    if config.chunk_bytes is not None:
        from pipeoff._validate import parse_bytes

        parse_bytes(config.chunk_bytes, name="chunk_bytes")
    if config.implementation == "fused_opt_states_bf16":
        raise ConfigError("implementation='fused_opt_states_bf16' keeps BF16 optimizer states "
                          "on the device; pipeoff's host state is FP32: use 'fused', 'foreach' "
                          "or 'for-loop'")
    kwargs = config.offload_kwargs
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise ConfigError(f"offload_kwargs must be a dict of keyword arguments, got {kwargs!r}")
    accepted = _keywords(config.full_offload)
    for key in kwargs:
        if key in _SET_HERE:
            raise ConfigError(f"offload_kwargs may not set {key!r}: {_SET_HERE[key]}")
        if key not in accepted:
            name = "FullOffloadOptimizer" if config.full_offload else "OffloadOptimizer"
            raise ConfigError(f"offload_kwargs: {name} takes no {key!r}; it takes "
                              f"{sorted(accepted)}")


def _keywords(full_offload: bool) -> set[str]:
    """The keyword arguments of the optimizer's constructor that offload_kwargs may set."""
    from pipeoff.optim import FullOffloadOptimizer, OffloadOptimizer

    cls = FullOffloadOptimizer if full_offload else OffloadOptimizer
    return {n for n, p in inspect.signature(cls.__init__).parameters.items()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            and n != "self" and n not in _SET_HERE}


def _masters_equal_to_weights(optimizers: Sequence[Any]) -> list[str]:
    """The FQNs of the full-offload parameters whose weights are FP32: each is its FP32
    master bit for bit (``FullOffloadOptimizer`` writes the weight from the master)."""
    from pipeoff.optim import FullOffloadOptimizer

    return [fqn for opt in optimizers if isinstance(opt, FullOffloadOptimizer)
            for group in opt.param_groups
            for fqn, p in zip(group["param_names"], group["params"])
            if p.dtype == torch.float32]
