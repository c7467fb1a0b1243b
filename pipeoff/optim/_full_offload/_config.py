"""The arguments of a :class:`~pipeoff.optim.FullOffloadOptimizer`, checked once."""

from __future__ import annotations

import inspect
import math
import re
import types
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from pipeoff import _compat
from pipeoff._errors import ConfigError, UnsupportedOptimizerError
from pipeoff._validate import check_int, check_process_group, parse_bytes, short_repr
from pipeoff.optim import _update
from pipeoff.optim._foreign import not_an_optimizer_class
from pipeoff.optim._full_offload import _accumulate
from pipeoff.optim._offload._args import check_fraction

__all__ = ["DEFAULT_CHUNK_NUMEL", "DEFAULT_SLOT_BYTES", "Accumulate", "FullOffloadConfig",
           "Overlap", "check_clip_args", "check_max_norm", "check_model", "chunk_numel_of",
           "model_and_params", "refuse_environment", "refuse_set"]

Accumulate = Literal["cpu", "gpu"]
Overlap = Literal["backward", "forward", "none"]

DEFAULT_CHUNK_NUMEL = 16 << 20
"""Most elements per optimizer chunk (whole parameters; prime-rl's figure)."""
DEFAULT_SLOT_BYTES = 64 << 20
"""Bytes of one pinned host slot a gradient travels through (a larger one goes in pieces)."""

_FLAGS = ("capturable", "differentiable")
"""Hyperparameters that cannot be on: the masters are stepped on the host."""


@dataclass(frozen=True, kw_only=True, slots=True)
class FullOffloadConfig:
    """How a :class:`~pipeoff.optim.FullOffloadOptimizer` runs (its constructor's arguments
    but the model and the parameters). See the optimizer for each one's meaning.

    Raises:
        ConfigError: an argument is out of range; ``max_norm`` with
            ``overlap="backward"``; ``capturable`` or ``differentiable`` on.
        UnsupportedOptimizerError: ``optimizer_class`` is not element-wise.
    """

    optimizer_class: type[torch.optim.Optimizer]
    """An element-wise ``torch.optim`` class (:data:`pipeoff.optim.ELEMENTWISE`)."""
    accumulate: Accumulate = "cpu"
    """Where non-final micro-steps' gradients are summed: ``"cpu"`` or ``"gpu"``."""
    overlap: Overlap = "forward"
    """What the host step hides behind: ``"forward"``, ``"backward"`` or ``"none"``."""
    max_norm: float | None = None
    """The global 2-norm gradients are clipped to, or ``None``."""
    chunk_numel: int = DEFAULT_CHUNK_NUMEL
    """Most elements in one optimizer chunk (whole parameters)."""
    slot_bytes: int = DEFAULT_SLOT_BYTES
    """Bytes of one pinned host slot."""
    pin_memory: bool = True
    """Page-lock the host state when an accelerator holds the weights."""
    slots: int = 4
    """Host slots in the ring."""
    num_threads: int | None = None
    """CPU threads of each host lane's kernels, or ``None`` (torch's default)."""
    process_group: Any = None
    """The group the clipping norm is all-reduced over (default: the world)."""
    timeout: float = 600.0
    """Seconds a wait for the step's work lasts before ``StepTimeoutError``."""
    defaults: Mapping[str, Any] = field(default_factory=dict)
    """The optimizer's hyperparameters (``lr``, ``weight_decay``...), read-only."""
    offload_fraction: float = 1.0
    """About this share of masters, optimizer state and gradient sums is in host memory
    (``_device_part.py``); the rest, the device part, steps on the device."""
    gradient_accumulation_steps: int | None = None
    """Backwards per step when every step has as many: the last one is then known to be
    final as it begins (as if the others were in ``no_sync()``), or ``None``."""

    def __post_init__(self) -> None:
        cls = self.optimizer_class
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise not_an_optimizer_class(
                cls, " (the optimizer takes the model, or its parameters)")
        if cls not in _update.ELEMENTWISE:
            names = ", ".join(f"torch.optim.{t.__name__}" for t in _update.ELEMENTWISE)
            raise UnsupportedOptimizerError(
                f"FullOffloadOptimizer steps the masters in chunks, exact only for element-wise "
                f"optimizers ({names}); {cls.__qualname__} is not one of them")
        if self.accumulate not in ("cpu", "gpu"):
            raise ConfigError(f"accumulate must be 'cpu' or 'gpu', got {self.accumulate!r}")
        if self.overlap not in ("backward", "forward", "none"):
            raise ConfigError(
                f"overlap must be 'backward', 'forward' or 'none', got {self.overlap!r}")
        if self.max_norm is not None:
            object.__setattr__(self, "max_norm", check_max_norm(self.max_norm, self.overlap))
        check_int("chunk_numel", self.chunk_numel, as_bound=True)
        check_int("slot_bytes", self.slot_bytes, minimum=16, unit="bytes",
                  also="or a size string such as '64MiB'")
        check_int("slots", self.slots, as_bound=True)
        if not isinstance(self.pin_memory, bool):
            raise ConfigError(f"pin_memory must be True or False, got {self.pin_memory!r}")
        check_int("num_threads", self.num_threads, optional=True, as_bound=True)
        check_int("gradient_accumulation_steps", self.gradient_accumulation_steps,
                  optional=True, as_bound=True)
        check_process_group(self.process_group)
        timeout = self.timeout
        if (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                or not 0 < timeout < math.inf):  # (refuses nan too)
            raise ConfigError(f"timeout must be a positive, finite number of seconds, "
                              f"got {timeout!r}")
        object.__setattr__(self, "timeout", float(timeout))
        for flag in _FLAGS:
            if self.defaults.get(flag):
                raise ConfigError(
                    f"{flag}=True is not for FullOffloadOptimizer: the masters are stepped on "
                    "the host, outside autograd and CUDA graphs")
        object.__setattr__(self, "defaults", types.MappingProxyType(dict(self.defaults)))
        object.__setattr__(self, "offload_fraction",
                           check_fraction(self.offload_fraction, "FullOffloadOptimizer"))
        if self.offload_fraction < 1.0:
            _refuse_device_part(self)

    def probe(self, **group: Any) -> torch.optim.Optimizer:
        """An optimizer of ``optimizer_class`` on a dummy parameter, with the defaults and
        ``group``'s hyperparameters: it checks them, and its ``defaults`` and state keys
        are the reference.

        Raises:
            ConfigError: the optimizer refused the hyperparameters.
        """
        for flag in _FLAGS:
            if group.get(flag):
                raise ConfigError(f"param group: {flag}=True is not for FullOffloadOptimizer")
        hyper = {**self.defaults, **accepted(self.optimizer_class, group)}
        try:
            return self.optimizer_class([torch.zeros(1, requires_grad=True)], **hyper)
        except (TypeError, ValueError) as err:
            unknown = re.search(r"unexpected keyword argument '(\w+)'", str(err))
            if unknown and not group:  # (the tester's lrr=: as OffloadOptimizer says it)
                raise ConfigError(
                    f"{unknown.group(1)}= is neither a FullOffloadOptimizer argument nor a "
                    f"hyperparameter of {self.optimizer_class.__name__}") from None
            what = "hyperparameters" if not group else "group's hyperparameters"
            raise ConfigError(f"{self.optimizer_class.__name__} refused the {what} "
                              f"{group or dict(self.defaults)}: {err}") from None

def accepted(optimizer_class: type[torch.optim.Optimizer],
             hyper: Mapping[str, Any]) -> dict[str, Any]:
    """``hyper`` less what ``optimizer_class``'s constructor does not take: torch keeps
    other keys in a group (a group's ``"name"``, a scheduler's ``"initial_lr"``), and its
    ``defaults`` may hold more than its signature."""
    try:
        taken = inspect.signature(optimizer_class).parameters
    except (TypeError, ValueError):
        return dict(hyper)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in taken.values()):
        return dict(hyper)
    return {k: v for k, v in hyper.items() if k in taken}


def _refuse_device_part(config: FullOffloadConfig) -> None:
    """The modes a device part (``offload_fraction < 1``) does not support yet.

    Raises:
        ConfigError: naming ``offload_fraction`` and the mode.
    """
    why = None
    if config.process_group is not None:
        why = ("a process_group (parameters sharded by hand: the clipping norm of the "
               "device part is not summed over ranks)")
    if why is not None:
        raise ConfigError(f"offload_fraction={config.offload_fraction} (a device part) is "
                          f"not available with {why}; use offload_fraction=1.0")


def check_max_norm(max_norm: Any, overlap: str, name: str = "max_norm") -> float:
    """``max_norm`` as a float.

    Raises:
        ConfigError: not a positive finite number, or ``overlap="backward"`` (the
            chunks step during the backward, before the global norm is known).
    """
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not (
            max_norm > 0 and max_norm != float("inf")):
        raise ConfigError(f"{name} must be a positive finite float, got {max_norm!r}")
    if overlap == "backward":
        raise ConfigError(
            f"{name} needs overlap='forward' (the default) or 'none': clipping scales "
            "every gradient by the global norm, which is known only after the last "
            "gradient of the backward has landed, so no chunk can step during the "
            "backward (overlap='backward')")
    return float(max_norm)


def chunk_numel_of(chunk_numel: Any, chunk_bytes: Any) -> int:
    """The most elements of one optimizer chunk, from one of ``chunk_numel`` and
    ``chunk_bytes`` (bytes of FP32 masters: 4 per element), or the default.

    Raises:
        ConfigError: both given, or one is not a positive integer.
    """
    if chunk_bytes is None:
        return DEFAULT_CHUNK_NUMEL if chunk_numel is None else chunk_numel
    if chunk_numel is not None:
        raise ConfigError(f"give chunk_numel or chunk_bytes, not both (got chunk_numel="
                          f"{chunk_numel!r}, chunk_bytes={chunk_bytes!r})")
    nbytes = parse_bytes(chunk_bytes, name="chunk_bytes")
    check_int("chunk_bytes", nbytes, minimum=4, unit="bytes",
              also="or a size string such as '256MiB' (one FP32 element at least)")
    return nbytes // 4


def refuse_environment() -> None:
    """Refuse what would make results differ from the reference, or gradients not come.

    Raises:
        ConfigError: flush-to-zero or compiled autograd is on.
    """
    if _accumulate.flush_to_zero():
        raise ConfigError(
            "flush-to-zero is on (torch.set_flush_denormal(True)): subnormal gradients "
            "would become 0 on the host and results would differ from the reference; "
            "call torch.set_flush_denormal(False)")
    if _compat.compiled_autograd_active():
        raise ConfigError(
            "compiled autograd is on: FullOffloadOptimizer's gradient hooks need the "
            "end-of-backward callbacks it does not give (unless fullgraph=True, and then "
            "the hooks are traced, not run as each gradient lands); compile the model, not "
            "the backward (torch._dynamo.config.compiled_autograd = False)")


def check_model(model: Any) -> None:
    """Refuse a model that is no module, that FSDP2 keeps on the host, or that torchft's
    PureDistributedDataParallel reduces from gradient hooks.

    Raises:
        ConfigError: naming what was given.
    """
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module, got {short_repr(model)}")
    for m in model.modules():
        cls = type(m)
        if cls.__name__ == "PureDistributedDataParallel" and cls.__module__.startswith("torchft"):
            raise ConfigError(
                "torchft's PureDistributedDataParallel all-reduces each gradient from its "
                "own post-accumulate-grad hook, asynchronously, where full offload takes it: "
                "use torchft.ddp.DistributedDataParallel (a DDP whose reduced gradient "
                "FullOffloadOptimizer takes at the end of the backward)")
        if _compat.fsdp_cpu_offload(m):
            raise ConfigError(
                "the model is under FSDP2's CPUOffloadPolicy, which already keeps "
                "parameters and gradients on the host (and copies them synchronously); "
                "FullOffloadOptimizer needs the compute weights on the device: shard "
                "without offload_policy")


def model_and_params(model: Any, params: Any) -> tuple[Any, torch.nn.Module | None]:
    """The optimizer's two forms: ``(model, params=None)`` (the model's parameters, or
    ``params`` of it), or torchao's ``(params)`` alone (parameters or param groups; the
    HF Trainer's ``optimizer_cls(grouped_params, ...)``), whose model is found at its
    first forward. Returns the params (``None``: the model's) and the model, if given.

    Raises:
        ConfigError: both forms mixed; a single tensor; not a module nor an iterable;
            the model is refused (:func:`check_model`).
    """
    if not isinstance(model, torch.nn.Module):
        if params is not None:
            raise ConfigError("give the model and params=, or the parameters alone "
                              "(FullOffloadOptimizer(params, optimizer_class)), not both")
        if isinstance(model, torch.Tensor):
            raise ConfigError(
                "params must be an iterable of parameters or of param group dicts, got "
                f"a single tensor of shape {tuple(model.shape)}")
        if isinstance(model, torch.optim.Optimizer):
            wrapped = type(getattr(model, "inner", model)).__name__  # (OffloadOptimizer's)
            raise ConfigError(
                f"FullOffloadOptimizer builds its optimizer (it steps the FP32 masters on the "
                f"host): pass the model (or parameters), the class and its hyperparameters, "
                f"FullOffloadOptimizer(model, torch.optim.{wrapped}, lr=...), "
                f"not a {type(model).__name__} instance (OffloadOptimizer wraps one)")
        if not isinstance(model, Iterable) or isinstance(model, (str, bytes, dict)):
            raise ConfigError(f"model must be a torch.nn.Module, or the parameters (or "
                              f"param groups) to optimize, got {short_repr(model)}")
        refuse_set(model)
        return list(model), None
    check_model(model)
    refuse_set(params)
    if isinstance(params, torch.Tensor):
        raise ConfigError("params must be an iterable of parameters or of param group "
                          f"dicts, got a single tensor of shape {tuple(params.shape)}")
    return params, model


def refuse_set(params: Any, what: str = "params") -> None:
    """Refuse a set of parameters, as torch does (a tester's find: they were taken).

    Raises:
        ConfigError: ``params`` (``what``) is a set, whose order changes between runs.
    """
    if isinstance(params, (set, frozenset)):
        raise ConfigError(f"{what} is a set, whose order changes between runs (and with it "
                          "the state dict's indices): use a list")


def check_clip_args(max_norm: Any, norm_type: Any, overlap: str) -> tuple[float, bool]:
    """``clip_grad_norm_()``'s arguments: the norm to clip to, and whether it is ``inf``
    (only the norm, as the HF Trainer asks to log it).

    Raises:
        ConfigError: ``max_norm`` not a positive number (or refused under ``overlap``),
            ``norm_type`` other than 2.
    """
    unbounded = isinstance(max_norm, (int, float)) and max_norm == float("inf")
    if not unbounded:
        max_norm = check_max_norm(max_norm, overlap)
    if float(norm_type) != 2.0:
        raise ConfigError(f"norm_type must be 2.0: FullOffloadOptimizer computes the "
                          f"2-norm of the gradients, got {norm_type!r}")
    return float(max_norm), unbounded
