"""The arguments pipeoff's torchft classes pass on to torchft's constructors (the
manager, the model or its fragments, the optimizers, DiLoCo's own knobs), checked
first, so that a wrong one is refused naming it rather than failing inside torchft
(often only at the first ``with`` or sync)."""

from __future__ import annotations

import numbers
from typing import Any

import torch
from torch import nn

from pipeoff._errors import ConfigError
from pipeoff._validate import short_repr

__all__ = ["check_diloco_knobs", "check_manager", "check_module", "check_optimizer"]

_MANAGER_METHODS = ("allreduce", "should_commit", "start_quorum", "errored")


def check_manager(manager: Any) -> Any:
    """``manager`` if it looks like a ``torchft.Manager`` (its methods; a
    ``create_autospec(Manager)`` mock passes, as in torchft's own tests).

    Raises:
        ConfigError: naming ``manager``.
    """
    if manager is None or not all(callable(getattr(manager, m, None))
                                  for m in _MANAGER_METHODS):
        raise ConfigError(f"manager must be a torchft.Manager, got {short_repr(manager)}")
    return manager


def check_module(name: str, value: Any) -> nn.Module:
    """``value`` if it is a ``torch.nn.Module``.

    Raises:
        ConfigError: naming ``name``.
    """
    if not isinstance(value, nn.Module):
        raise ConfigError(f"{name} must be a torch.nn.Module, got {short_repr(value)}")
    return value


def check_optimizer(name: str, value: Any) -> torch.optim.Optimizer:
    """``value`` if it is a ``torch.optim.Optimizer`` instance (pipeoff's offloading
    optimizers are).

    Raises:
        ConfigError: naming ``name`` (a class given for an instance says so).
    """
    if isinstance(value, type) and issubclass(value, torch.optim.Optimizer):
        raise ConfigError(f"{name} must be an optimizer instance, got the class "
                          f"{value.__qualname__}: build it over the parameters first")
    if not isinstance(value, torch.optim.Optimizer):
        raise ConfigError(f"{name} must be a torch.optim.Optimizer, got {short_repr(value)}")
    return value


def check_diloco_knobs(model_fragments: Any, inner_optimizer: Any, outer_optimizer: Any, *,
                       backup_device: Any, pin_memory: Any, use_bucketization: Any,
                       bucket_cap_mb: Any, should_quantize: Any) -> None:
    """torchft's ``DiLoCo`` arguments, in any mode.

    Raises:
        ConfigError: naming the argument and what it accepts.
    """
    if not isinstance(model_fragments, (list, tuple)):
        got = (f"a {type(model_fragments).__name__} module (one fragment: [model])"
               if isinstance(model_fragments, nn.Module) else short_repr(model_fragments))
        raise ConfigError(f"model_fragments must be a list of torch.nn.Module, got {got}")
    for j, m in enumerate(model_fragments):
        check_module(f"model_fragments[{j}]", m)
    check_optimizer("inner_optimizer", inner_optimizer)
    if isinstance(outer_optimizer, list):
        for j, o in enumerate(outer_optimizer):
            check_optimizer(f"outer_optimizer[{j}]", o)
    else:
        check_optimizer("outer_optimizer", outer_optimizer)
    for name, flag in (("pin_memory", pin_memory), ("use_bucketization", use_bucketization),
                       ("should_quantize", should_quantize)):
        if not isinstance(flag, bool):
            raise ConfigError(f"{name} must be True or False, got {flag!r}")
    if bucket_cap_mb is not None and (
            isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, numbers.Real)
            or not float(bucket_cap_mb) > 0):
        raise ConfigError(f"bucket_cap_mb must be a positive number of MiB or None, got "
                          f"{bucket_cap_mb!r}")
    if backup_device is not None:
        try:
            torch.device(backup_device)
        except (RuntimeError, TypeError) as err:
            raise ConfigError(f"backup_device must be a torch.device (or its name, such as "
                              f"'cpu') or None, got {backup_device!r}: {err}") from None
