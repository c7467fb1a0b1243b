"""DiLoCo's outer SGD step in one native pass, bitwise torch's CPU ``torch.optim.SGD``.

torch's CPU SGD (its for-loop, the default for CPU tensors) is four or five
element-wise ops per parameter, each a pass over the pseudo-gradient, the
parameter or the momentum buffer: about 44 bytes per element with Nesterov
momentum. ``pipeoff_sgd_step`` (``pipeoff/_native/hoststep.c``) does the same IEEE
operations in one pass, 20 bytes per element with momentum (12 without), over the
rank's cores. Its fused
multiply-adds are where aten's ufunc ``add(..., alpha=)`` has them at each CPU
dispatch level (:data:`SGD_FMA`), and :func:`outer_kernel` checks that against
torch at first use: a kernel that differs is not used (a ``RuntimeWarning``), a
machine without a compiler or at an unknown level runs torch's step (said once
on the ``pipeoff`` logger). ``PIPEOFF_NATIVE=0`` turns it off.

Which groups take it (:func:`sgd_hyper`): ``torch.optim.SGD`` itself with plain
numbers for its hyperparameters, ``foreach`` and ``fused`` unset or ``False``
(torch's for-loop, which is what a CPU SGD runs by default), no
``differentiable``. Others run torch's own step, as before.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import increment_version

from pipeoff import _accel, _happens, _native

__all__ = ["SGD_FMA", "OuterKernel", "SgdHyper", "native_takes", "outer_kernel",
           "outer_step_status", "sgd_hyper"]

SGD_FMA: Mapping[str, int] = {"DEFAULT": 0, "AVX2": 1, "AVX512": 1}
"""Per torch CPU dispatch level, whether aten's ``a.add(b, alpha=x)`` is one fused
multiply-add (1: its vector body's ``fmadd`` and its scalar loop, contracted by
the compiler) or a multiply then an add (0). Found on torch 2.13 (DEFAULT and
AVX2 measured; AVX512 is its vector body's ``fmadd``, which the self-test checks
on the first machine that has it)."""

_log = logging.getLogger("pipeoff")


@dataclass(frozen=True, slots=True)
class SgdHyper:
    """One SGD param group's hyperparameters, as the kernel takes them."""

    lr: float
    momentum: float
    dampening: float
    weight_decay: float
    nesterov: bool
    maximize: bool


def sgd_hyper(optimizer_class: type[torch.optim.Optimizer],
              group: Mapping[str, Any]) -> SgdHyper | None:
    """``group``'s hyperparameters if the native step is bitwise what
    ``optimizer_class`` does with them (``torch.optim.SGD``'s for-loop step with
    plain numbers), else ``None`` (torch's step)."""
    if optimizer_class is not torch.optim.SGD:
        return None
    if group.get("foreach") or group.get("fused") or group.get("differentiable"):
        return None
    values = [group.get(k) for k in ("lr", "momentum", "dampening", "weight_decay")]
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return None  # a Tensor lr or weight decay: torch's path
    lr, momentum, dampening, weight_decay = (float(v) for v in values)  # type: ignore[arg-type]
    return SgdHyper(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                    nesterov=bool(group.get("nesterov", False)),
                    maximize=bool(group.get("maximize", False)))


def _fp32_1d(t: Any, n: int) -> bool:
    return (isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.is_contiguous()
            and t.numel() == n and t.device.type == "cpu" and t.layout == torch.strided)


def native_takes(param: torch.Tensor, grad: torch.Tensor,
                 state: Mapping[str, Any] | None) -> bool:
    """Whether :meth:`OuterKernel.sgd_step` takes these tensors: contiguous FP32 CPU
    ``param`` and ``grad`` of one size, and a momentum buffer (if any) alike. BF16
    backups, say, run torch's step."""
    n = param.numel()
    buf = None if state is None else state.get("momentum_buffer")
    tensors = (param, grad) if buf is None else (param, grad, buf)
    # Host memory as the accelerator sees it too: the simulated device counts a
    # CPU tensor it did not see allocated as host (torchft's unpinned backups) as
    # device memory, which native code must not touch; torch's step runs there.
    accel = _accel.current()
    return (_fp32_1d(param, n) and _fp32_1d(grad, n) and grad.shape == param.shape
            and (buf is None or _fp32_1d(buf, n))
            and not any(accel.on_device(t) for t in tensors))


class OuterKernel:
    """The native SGD step at one dispatch level's rounding (:data:`SGD_FMA`)."""

    def __init__(self, lib: Any, level: str) -> None:
        self.lib = lib
        self.level = level
        self.fma = SGD_FMA[level]

    def sgd_step(self, param: torch.Tensor, grad: torch.Tensor,
                 state: MutableMapping[str, Any], hyper: SgdHyper, *, threads: int,
                 announce: bool = True) -> None:
        """One ``torch.optim.SGD`` step of ``param`` with gradient ``grad`` (not written),
        and of ``state["momentum_buffer"]``, created on the first step as torch
        creates it (a clone of the gradient; no state without momentum).

        ``param`` and ``grad``: contiguous FP32 CPU tensors of one shape, not
        overlapping. ``announce=False`` keeps the access from a checker
        (:func:`pipeoff._happens.native_access`; the self-test's tensors, which it
        does not know).

        Raises:
            ValueError: the tensors are not of that kind.
        """
        n = param.numel()
        for name, t in (("param", param), ("grad", grad)):
            if t.dtype != torch.float32 or not t.is_contiguous() or t.numel() != n \
                    or t.device.type != "cpu":
                raise ValueError(f"{name} must be a contiguous FP32 CPU tensor of {n} elements, "
                                 f"got {t.dtype} {tuple(t.shape)} on {t.device}")
        h = hyper
        buf: torch.Tensor | None = None
        mode = 0
        if h.momentum != 0:
            buf = state.get("momentum_buffer")
            if buf is None:
                # made as torch's SGD makes it, a clone of the gradient (host memory
                # by its origin, for a checker too); the kernel writes it again
                buf, mode = grad.clone(memory_format=torch.contiguous_format), 1
            else:
                mode = 2
                if buf.dtype != torch.float32 or not buf.is_contiguous() or buf.numel() != n \
                        or buf.device.type != "cpu":
                    raise ValueError("momentum_buffer must be a contiguous FP32 CPU tensor of "
                                     f"{n} elements, got {buf.dtype} {tuple(buf.shape)}")
        reads = (grad,) if buf is None or mode == 1 else (grad, buf)
        writes = (param,) if buf is None else (param, buf)
        if announce:
            _happens.native_access("pipeoff_sgd_step", reads=reads, writes=writes)
        # As aten's in-place ops do: the writes show in the version counters.
        increment_version(list(writes))
        # The scalars as torch's kernels round them: float(x) of the Python double
        # (1 - dampening and -lr computed in double first, as torch's Python does).
        rc = 0 if n == 0 else self.lib.pipeoff_sgd_step(  # (an empty one has no storage)
            param.data_ptr(), None if buf is None else buf.data_ptr(), grad.data_ptr(), n,
            -1.0 if h.maximize else 1.0, h.weight_decay, h.momentum, 1.0 - h.dampening,
            -h.lr, int(h.weight_decay != 0), mode, int(h.nesterov), self.fma, threads)
        if rc != 0:
            raise RuntimeError(f"pipeoff_sgd_step refused its arguments (rc={rc})")
        if mode == 1:
            state["momentum_buffer"] = buf


_lock = threading.Lock()
_kernel: OuterKernel | None = None
_why: str | None = None
_decided = False
_said = False


def outer_kernel() -> OuterKernel | None:
    """The native outer SGD step, or ``None`` (torch's step; :func:`outer_step_status`
    says why). Built, checked against torch and decided once per process; the
    first call on a machine builds the library (about 15 s on 2 cores, once)."""
    global _said
    if not _decided:
        with _lock:
            if not _decided:
                _decide()
    if _kernel is None and not _said and not _native.turned_off():
        _said = True
        what = f"pipeoff: DiLoCo's native outer SGD step is off, {_why}; torch's step runs"
        if _why is not None and "self-test" in _why:  # other bits than torch: a bug
            warnings.warn(what + " (the same bits, more passes); please report it",
                          RuntimeWarning, stacklevel=2)
        else:
            _log.info(what)
    return _kernel


def _decide() -> None:
    global _kernel, _why, _decided
    lib = _native.library()
    level = torch.backends.cpu.get_cpu_capability()
    if lib is None:
        _why = f"the native kernels are unavailable: {_native.unavailable_reason()}"
    elif level not in SGD_FMA:
        _why = (f"torch's CPU dispatch level here is {level}, whose rounding of SGD pipeoff "
                f"does not know (it knows {', '.join(SGD_FMA)})")
    else:
        kernel = OuterKernel(lib, level)
        try:
            mismatch = _apart(self_test, kernel)
        except Exception as err:  # decided, not retried at every sync
            mismatch = f"it raised {type(err).__name__}: {err}"
        if mismatch is None:
            _kernel = kernel
        else:
            _why = f"its self-test against torch.optim.SGD failed: {mismatch}"
    _decided = True


def outer_step_status() -> str:
    """How DiLoCo steps a ``torch.optim.SGD`` outer optimizer in host memory:
    ``"native (AVX2, 8 threads)"``, or ``"torch: <why not native>"``."""
    from pipeoff.optim._full_offload._host_kernel import default_threads

    kernel = outer_kernel()
    if kernel is None:
        return f"torch: {_why}"
    return f"native ({kernel.level}, {default_threads()} threads)"


def _reset_for_tests() -> None:
    global _kernel, _why, _decided, _said
    with _lock:
        _kernel, _why, _decided, _said = None, None, False, False


# -- the self-test ----------------------------------------------------------------------
_HYPER = (
    SgdHyper(lr=0.7, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=True,
             maximize=False),  # DiLoCo's outer optimizer
    SgdHyper(lr=0.1, momentum=0.5, dampening=0.3, weight_decay=1e-2, nesterov=False,
             maximize=True),
    SgdHyper(lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.1, nesterov=False,
             maximize=False),
)


def _apart(fn: Any, kernel: OuterKernel) -> str | None:
    """``fn(kernel)`` on a thread of its own: outside the dispatch modes (a profiler's,
    the simulated device's) of the thread that asked, which are per thread."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn(kernel))
        except BaseException as err:  # re-raised on the asking thread
            out.append(err)

    t = threading.Thread(target=run, name="pipeoff-self-test", daemon=True)
    t.start()
    t.join()
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]  # type: ignore[no-any-return]


def self_test(kernel: OuterKernel, *, steps: int = 3) -> str | None:
    """``None`` if ``kernel`` gives ``torch.optim.SGD``'s bits on this machine (value
    classes from subnormals to NaNs, lengths on both sides of the vector widths, one
    that torch splits over its threads, ``steps`` steps of each configuration);
    else what differed."""
    from pipeoff.optim._full_offload._host_kernel import _values

    gen = torch.Generator().manual_seed(4321)
    for h in _HYPER:
        for n in (1, 2, 7, 8, 9, 15, 16, 17, 31, 32, 33, 100_003):  # every tail class
            p0 = _values(n, gen)[0]
            ref = p0.clone()
            opt = torch.optim.SGD([ref], lr=h.lr, momentum=h.momentum, dampening=h.dampening,
                                  weight_decay=h.weight_decay, nesterov=h.nesterov,
                                  maximize=h.maximize, foreach=False)
            mine, state = p0.clone(), {}  # type: ignore[var-annotated]
            for step in range(steps):
                grad = _values(n, gen)[1]
                ref.grad = grad
                opt.step()
                kernel.sgd_step(mine, grad, state, h, threads=2, announce=False)
                pairs = [("param", mine, ref)]
                if h.momentum != 0:
                    pairs.append(("momentum_buffer", state["momentum_buffer"],
                                  opt.state[ref]["momentum_buffer"]))
                for what, a, b in pairs:
                    apart = (a.view(torch.int32) != b.view(torch.int32)).nonzero()
                    if len(apart):
                        i = int(apart[0])
                        return (f"{what} differs in {len(apart)} of {n} elements at step "
                                f"{step + 1} of {h} (first at {i}: {float(a[i])!r} vs torch "
                                f"{float(b[i])!r})")
    return None
