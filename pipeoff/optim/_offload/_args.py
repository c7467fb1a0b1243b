"""OffloadOptimizer's arguments: the optimizer to wrap, given or built in torchao's form
(``OffloadOptimizer(params, optimizer_class, **kwargs)``), and the default of
``chunk_bytes``."""

from __future__ import annotations

import math
import numbers
import re
import warnings
from typing import Any

import torch

from pipeoff._errors import ConfigError
from pipeoff._validate import check_bytes, check_int, parse_bytes, short_repr
from pipeoff.optim._foreign import not_an_optimizer_class, optimizer_class_of, refuse_foreign
from pipeoff.optim._offloaded import Offloaded

__all__ = ["DEFAULT_CHUNK_BYTES", "MODES", "check_fraction", "mode_of", "staging_args",
           "wrapped"]

MODES = ("single_pass", "chunked", "overlap")
"""OffloadOptimizer's modes; ``overlap=`` names the last two as FullOffloadOptimizer does."""
_OVERLAP = {"forward": "overlap", "none": "chunked"}

DEFAULT_CHUNK_BYTES = 1 << 30
"""``chunk_bytes`` when neither it nor ``device_budget_bytes`` is given."""


class _Default:
    """The default of ``chunk_bytes``: 1 GiB, or a third of ``device_budget_bytes``."""

    def __repr__(self) -> str:
        return "DEFAULT_CHUNK_BYTES"


_DEFAULT = _Default()


def wrapped(params: Any, optimizer_class: Any, optimizer: Any,
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
                optimizer, Offloaded):
            raise ConfigError(
                f"optimizer must be a torch.optim.Optimizer to wrap, got {short_repr(optimizer)}")
        return optimizer
    if params is None:
        raise ConfigError("OffloadOptimizer needs an optimizer to wrap, or the parameters "
                          "and optimizer_class to build one (torchao's form)")
    if isinstance(params, torch.nn.Module):
        raise ConfigError(
            f"OffloadOptimizer takes an optimizer to wrap or parameters, got a module "
            f"({type(params).__name__}): OffloadOptimizer(torch.optim.AdamW("
            "model.parameters())), or OffloadOptimizer(model.parameters(), torch.optim.AdamW) "
            "(FullOffloadOptimizer is the one that takes the model)")
    refuse_foreign(kwargs, "OffloadOptimizer")
    kwargs.pop("offload_gradients", None)  # (False, torchao's default: what this does)
    cls = torch.optim.AdamW if optimizer_class is None else optimizer_class_of(optimizer_class)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)) or issubclass(
            cls, Offloaded):
        raise not_an_optimizer_class(cls)
    if isinstance(params, torch.Tensor):
        raise ConfigError("params must be an iterable of parameters or of param group "
                          f"dicts, got a single tensor of shape {tuple(params.shape)}")
    try:
        params = list(params)
    except TypeError:
        raise ConfigError("params must be an iterable of parameters or of param group dicts, "
                          f"got {short_repr(params)}") from None
    if not params:
        raise ConfigError("params is empty: OffloadOptimizer got no parameters to optimize")
    try:
        return cls(params, **kwargs)
    except (TypeError, ValueError) as err:
        unknown = re.search(r"unexpected keyword argument '(\w+)'", str(err))
        if unknown:
            raise ConfigError(
                f"{unknown.group(1)}= is neither an OffloadOptimizer argument nor a "
                f"hyperparameter of {cls.__name__}: {err}") from err
        raise ConfigError(f"{cls.__name__} refused {sorted(kwargs)}: {err}") from err


def mode_of(mode: Any, overlap: Any) -> Any:
    """The mode from ``mode=`` or from ``overlap=`` (the name both optimizers share:
    ``"forward"`` is ``mode="overlap"``, ``"none"`` is ``mode="chunked"``).

    Raises:
        ConfigError: an unknown value, or both given and disagreeing.
    """
    if overlap is None:
        if mode not in MODES:
            raise ConfigError(f"mode must be one of {MODES}, got {mode!r}")
        return mode
    if overlap not in _OVERLAP:
        hint = (" (OffloadOptimizer steps after the backward: its chunks overlap the "
                "next forward; overlap='backward' is FullOffloadOptimizer's)"
                if overlap == "backward" else "")
        raise ConfigError(f"overlap must be 'forward' or 'none', got {overlap!r}{hint}")
    if mode is not None and mode != _OVERLAP[overlap]:
        raise ConfigError(f"give overlap= or mode=, not both (got overlap={overlap!r}, "
                          f"mode={mode!r})")
    return _OVERLAP[overlap]


def staging_args(chunk_bytes: int | str | None | _Default, prefetch: int | None,
                 lookahead: int | None, device_budget_bytes: int | str | None,
                 ) -> tuple[int | None, int | None, int | None]:
    """``chunk_bytes`` and ``prefetch`` as the optimizer uses them: the default chunk
    (1 GiB, or a third of ``device_budget_bytes``), and ``prefetch`` (2 by default,
    ``None`` under a device budget); ``lookahead`` is its deprecated name; and the
    budget in bytes (sizes may be strings such as ``"256MiB"``).

    Raises:
        ConfigError: a value out of range, or both of ``prefetch`` and
            ``lookahead`` (or ``device_budget_bytes``), or a budget smaller than a chunk.
    """
    chunk_bytes_given = None if isinstance(chunk_bytes, _Default) else chunk_bytes
    if isinstance(chunk_bytes, _Default):
        chunk_bytes = DEFAULT_CHUNK_BYTES
    chunk_bytes = check_bytes("chunk_bytes", chunk_bytes, optional=True)
    prefetch_name = "prefetch"
    if lookahead is not None:
        if prefetch is not None:
            raise ConfigError("give prefetch (the new name of lookahead), not both")
        warnings.warn("OffloadOptimizer(lookahead=...) is now prefetch=...; lookahead will "
                      "be removed", FutureWarning, stacklevel=3)
        prefetch, prefetch_name = lookahead, "lookahead"
    check_int(prefetch_name, prefetch, minimum=0, optional=True)
    if device_budget_bytes is not None:
        device_budget_bytes = parse_bytes(device_budget_bytes, name="device_budget_bytes")
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
    if device_budget_bytes is not None:
        return chunk_bytes, None, device_budget_bytes
    return chunk_bytes, 2 if prefetch is None else prefetch, None


def check_fraction(value: Any, owner: str) -> float:
    """``offload_fraction`` as a float in [0, 1].

    Raises:
        ConfigError: naming ``offload_fraction``: not a real number (a bool, a
            string, NaN), outside [0, 1], or ``"auto"``, which ``owner`` does not
            offer yet.
    """
    share = ("the FP32 masters, optimizer state and gradient sums" if owner ==
             "FullOffloadOptimizer" else "the optimizer state")
    if isinstance(value, str) and value == "auto":
        raise ConfigError(
            f"offload_fraction='auto' is not available yet for {owner}; give a number in "
            f"[0, 1]: the share of {share} kept in host memory (1.0, the "
            "default: all of it; 0.0: none, all on the device)")
    if (isinstance(value, bool) or not isinstance(value, numbers.Real)
            or math.isnan(value) or not 0.0 <= float(value) <= 1.0):
        raise ConfigError(
            f"offload_fraction must be a number in [0, 1] (the share of {share} kept in "
            f"host memory: 1.0 all of it, 0.0 none), got {short_repr(value)}")
    return float(value) + 0.0  # (-0.0 is 0.0)
