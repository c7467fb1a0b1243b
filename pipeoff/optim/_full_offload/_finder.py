"""Finding the model of a full-offload optimizer built from parameters only.

The HF Trainer builds its optimizer as ``optimizer_cls(grouped_params, **kwargs)``,
and torchao's convention is ``CPUOffloadOptimizer(params, optimizer_class)``: no
model. Full offload wants one (the forward that tells a micro-step of DDP or
FSDP2 apart, the forward waits, the train spans, parameter names), so it
watches forwards (``torch.nn.modules.module.register_module_forward_pre_hook``,
a global forward pre-hook) until one runs a module that holds every parameter
it optimizes, and takes that module, unwrapped from DDP and ``torch.compile``.
Each module is looked at once; the hook goes once the model is found (or with
the optimizer).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from pipeoff import _compat

__all__ = ["ModelFinder", "unwrap_model"]


def unwrap_model(module: torch.nn.Module) -> torch.nn.Module:
    """The module a DDP wrapper or a ``torch.compile`` wrapper runs, else ``module``."""
    while True:
        inner = _compat.compiled_original(module)
        if _compat.data_parallel(inner) is inner and isinstance(
                getattr(inner, "module", None), torch.nn.Module):
            inner = inner.module
        if inner is module:
            return module
        module = inner


class ModelFinder:
    """A global forward pre-hook looking for the module that holds ``params``.

    Args:
        params: the parameters the module must hold (called when a forward runs: the
            optimizer's live ones).
        found: called with the module (unwrapped) once, on the thread running the
            forward; returns whether it took it (it may decline, mid-step, and is
            then asked again at a later forward).
    """

    def __init__(self, params: Callable[[], list[torch.Tensor]],
                 found: Callable[[torch.nn.Module], bool]) -> None:
        self._params = params
        self._found = found
        self._seen: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        ref = weakref.ref(self)
        handle: Any = None

        def hook(module: torch.nn.Module, args: Any) -> None:
            finder = ref()
            if finder is not None:
                finder._look(module)
            elif handle is not None:
                handle.remove()  # (its optimizer is gone)

        handle = torch.nn.modules.module.register_module_forward_pre_hook(
            _compat.dynamo_disable(hook))
        self._handle: Any = handle
        weakref.finalize(self, handle.remove)

    @property
    def searching(self) -> bool:
        return self._handle is not None

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _look(self, module: torch.nn.Module) -> None:
        if self._handle is None or module in self._seen:
            return
        wanted = self._params()
        if not wanted:
            return
        held = {id(p) for p in module.parameters()}
        if not all(id(p) in held for p in wanted):
            self._seen.add(module)  # (a part of the model, or another one)
            return
        if self._found(unwrap_model(module)):
            self.stop()
