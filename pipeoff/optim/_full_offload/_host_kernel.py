"""The fused host step of full offload: one pass over memory per job, bitwise equal to torch.

Two jobs run in pipeoff's native kernels (``pipeoff/_native/hoststep.c``) when
they are to be had:

* :func:`fold`: a gradient piece (BF16 or FP32) folded into the FP32 sum in one
  pass (torch's mixed-dtype add makes an FP32 temporary of the gradient first).
  IEEE widening and adds, so the bits are those of ``acc.add_(grad)`` anywhere.
* :meth:`HostKernel.adam_step`: the AdamW/Adam update of the master, ``exp_avg``
  and ``exp_avg_sq`` from the FP32 sum (times the clip coefficient, if any), and
  the cast of the new master into the weight buffer, in one pass: 30 bytes per
  element against the three passes' 42 (scale, step, cast).

The step replaces ``torch.optim.AdamW(fused=True)`` (or ``Adam``) only, and is
bitwise equal to it *at the dispatch level torch runs on here*
(``torch.backends.cpu.get_cpu_capability()``): torch's own bits change with it,
because its AVX2/AVX-512 binary fuses some multiply-adds (:data:`CONTRACTIONS`).
No kernel can be bitwise equal to the for-loop or foreach AdamW, whose CPU
``sqrt`` is not correctly rounded, so those (and SGD, amsgrad, a tensor ``lr``)
keep torch's path. Where a result is NaN it is NaN on both paths, but its sign and
payload may differ (operand order of commutative operations is the compiler's).
:func:`host_kernel` checks the kernel against
torch's fused kernel at first use on each machine (:func:`self_test`) and
warns, naming why, when it falls back to torch's path.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import threading
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import increment_version

from pipeoff import _compat, _happens, _native

__all__ = ["CONTRACTIONS", "AdamHyper", "HostKernel", "adam_hyper", "default_threads", "fold",
           "host_kernel", "host_step_status", "self_test", "warn_if_off"]

FMA_LERP, FMA_SQ_V, FMA_SQ_G, FMA_WD = 1, 2, 4, 8
"""Where torch's binary fuses a multiply-add (``hoststep.c`` names each)."""

CONTRACTIONS: Mapping[str, tuple[int, int, int, int]] = {
    # level: (vector body's fmas, scalar tail's fmas, tail = last n % this, BF16 NaN bits)
    "DEFAULT": (0, 0, 8, 0x7FC0),
    "AVX2": (FMA_LERP | FMA_SQ_G | FMA_WD, FMA_LERP | FMA_SQ_V | FMA_WD, 8, 0xFFFF),
    # torch's AVX-512 tail loop is itself vectorized 8 wide with the body's
    # contractions, so its scalar remainder is the last n % 8 too.
    "AVX512": (FMA_LERP | FMA_SQ_G | FMA_WD, FMA_LERP | FMA_SQ_V | FMA_WD, 8, 0xFFFF),
}
"""Per torch CPU dispatch level, how its fused Adam kernel rounds (found by
taking each fma away until the bits matched, on torch 2.13; :func:`self_test`
re-checks it on every machine)."""

_KINDS = {torch.bfloat16: 1, torch.float32: 2}


def default_threads() -> int:
    """This rank's share of the CPUs it may run on: the CPUs of its affinity mask
    divided by the ranks on this host (``LOCAL_WORLD_SIZE``, as torchrun sets it)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return max(1, cpus // local)


def fold(acc: torch.Tensor, grad: torch.Tensor, *, first: bool, threads: int) -> bool:
    """``acc = grad`` (widened) if ``first``, else ``acc += grad``, in one native pass;
    1-D contiguous tensors of one length, ``acc`` FP32, ``grad`` BF16 or FP32.

    Returns ``False`` (and does nothing) when the kernels are unavailable or the
    tensors are of other kinds: the caller then runs torch's fold.
    """
    lib = _native.library()
    kind = _KINDS.get(grad.dtype)
    if (lib is None or kind is None or acc.dtype != torch.float32 or acc.device.type != "cpu"
            or grad.device.type != "cpu" or not acc.is_contiguous()
            or not grad.is_contiguous() or acc.numel() != grad.numel()):
        return False
    _happens.native_access("pipeoff_fold", reads=(grad,) if first else (acc, grad), writes=(acc,))
    rc = lib.pipeoff_fold(acc.data_ptr(), grad.data_ptr(), kind, acc.numel(), int(first),
                          threads)
    if rc != 0:
        raise RuntimeError(f"pipeoff_fold refused its arguments (rc={rc})")
    return True


@dataclass(frozen=True, slots=True)
class AdamHyper:
    """The hyperparameters of one Adam/AdamW param group the kernel takes, as floats."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool
    """AdamW's decay of the weights (``True``) or Adam's L2 term in the gradient."""
    maximize: bool


def adam_hyper(optimizer_class: type[torch.optim.Optimizer],
               group: Mapping[str, Any]) -> AdamHyper | None:
    """``group``'s hyperparameters if the native step is bitwise what
    ``optimizer_class`` does with them: ``Adam``/``AdamW`` with ``fused=True``, no
    ``amsgrad``, plain float ``lr`` and betas; else ``None`` (torch's path)."""
    if optimizer_class not in (torch.optim.Adam, torch.optim.AdamW):
        return None
    if group.get("fused") is not True or group.get("amsgrad") or group.get("capturable") \
            or group.get("differentiable"):
        return None
    lr, betas = group.get("lr"), group.get("betas")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        return None
    values = (lr, *betas, group.get("eps"), group.get("weight_decay", 0.0))
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return None  # a Tensor lr or beta: torch's path
    decoupled = group.get("decoupled_weight_decay", optimizer_class is torch.optim.AdamW)
    return AdamHyper(lr=float(lr), beta1=float(betas[0]), beta2=float(betas[1]),  # type: ignore[arg-type,index]
                     eps=float(group["eps"]), weight_decay=float(group.get("weight_decay", 0.0)),
                     decoupled=bool(decoupled), maximize=bool(group.get("maximize", False)))


class HostKernel:
    """The native Adam/AdamW step at one dispatch level's rounding (:data:`CONTRACTIONS`)."""

    def __init__(self, lib: Any, level: str) -> None:
        self.lib = lib
        self.level = level
        self.body, self.tail, self.vec, self.nan_bits = CONTRACTIONS[level]

    def adam_step(self, param: torch.Tensor, grad: torch.Tensor | None, exp_avg: torch.Tensor,
                  exp_avg_sq: torch.Tensor, out: torch.Tensor | None, hyper: AdamHyper, *,
                  step: float, scale: float | None, threads: int, announce: bool = True,
                  last_grad: torch.Tensor | None = None, sumsq: bool = False) -> float | None:
        """One step of ``param`` (the FP32 master), ``exp_avg`` and ``exp_avg_sq`` in place,
        with gradient ``grad * scale`` (``grad`` is not written), and ``out`` (BF16 or
        FP32, or ``None``) set to the new ``param``: what ``torch._fused_adamw_`` (or
        ``_fused_adam_``) and ``out.copy_(param)`` give after ``grad.mul_(scale)``.

        With ``last_grad`` (BF16), the gradient is ``grad + last_grad`` (``grad``, the
        FP32 sum of the earlier micro-steps, or ``None`` for ``last_grad`` alone), folded
        inside the same pass with the bits of :func:`fold` and then the step: a final
        micro-step in one pass over memory (32 bytes per element, not fold's 10 plus
        the step's 30). Neither gradient is written.

        With ``sumsq``, returns the sum of squares of the gradient (``grad +
        last_grad``, before ``scale`` and ``maximize``'s sign), taken inside the same
        pass in double: the norm a one-pass step logs. Not torch's bits (nor bitwise
        the same across thread counts: each chunk of the call's region sums its part);
        never a clip coefficient. Without it, returns ``None``.

        All 1-D, contiguous, on the CPU, of one length, not overlapping; ``step`` is
        the step count after this step (torch's ``state["step"]``, already
        incremented). ``announce=False`` keeps the access from a checker
        (:func:`pipeoff._happens.native_access`), for tensors it does not know.

        Raises:
            ValueError: the tensors are not of those kinds, or neither gradient is given.
        """
        n = param.numel()
        if grad is None and last_grad is None:
            raise ValueError("adam_step needs grad, last_grad or both")
        for name, t in (("param", param), ("grad", grad), ("exp_avg", exp_avg),
                        ("exp_avg_sq", exp_avg_sq)):
            if t is None:
                continue
            if t.dtype != torch.float32 or not t.is_contiguous() or t.numel() != n \
                    or t.device.type != "cpu":
                raise ValueError(f"{name} must be a contiguous FP32 CPU tensor of {n} elements, "
                                 f"got {t.dtype} {tuple(t.shape)} on {t.device}")
        if last_grad is not None and (
                last_grad.dtype != torch.bfloat16 or not last_grad.is_contiguous()
                or last_grad.numel() != n or last_grad.device.type != "cpu"):
            raise ValueError(f"last_grad must be a contiguous BF16 CPU tensor of {n} elements, "
                             f"got {last_grad.dtype} {tuple(last_grad.shape)} on "
                             f"{last_grad.device}")
        grads = tuple(t for t in (grad, last_grad) if t is not None)
        kind = 0
        if out is not None:
            kind = _KINDS.get(out.dtype, -1)
            if kind < 0 or not out.is_contiguous() or out.numel() != n:
                raise ValueError(f"out must be a contiguous BF16 or FP32 tensor of {n} elements,"
                                 f" got {out.dtype} {tuple(out.shape)}")
        if announce:
            _happens.native_access("pipeoff_adam_step", reads=grads,
                                   writes=(param, exp_avg, exp_avg_sq)
                                   + ((out,) if out is not None else ()))
        h = hyper
        # The scalars as torch's kernel rounds them: computed in double (IEEE, as
        # C++ does: a beta of 1 edited into param_groups gives inf, not an error),
        # then each rounded to float once (ctypes.c_float rounds to nearest).
        bc1 = 1.0 - _pow(h.beta1, step)
        bc2 = 1.0 - _pow(h.beta2, step)
        wd = h.weight_decay
        args = (int(not h.decoupled and wd != 0), wd,
                (1.0 - h.lr * wd) if h.decoupled and wd != 0 else 1.0,
                -1.0 if h.maximize else 1.0, 1.0 if scale is None else scale,
                1.0 - h.beta1, h.beta2, 1.0 - h.beta2, _sqrt(bc2), h.eps, _div(h.lr, bc1),
                self.body, self.tail, self.vec, self.nan_bits, threads)
        # As aten's in-place ops do: a write shows in the version counters (a chunk
        # that fails after this call knows it stepped this master: torn, not dirty).
        # Bumped before the call: the C function writes all or (rc != 0) nothing.
        increment_version([t for t in (param, exp_avg, exp_avg_sq, out) if t is not None])
        out_ptr = None if out is None else out.data_ptr()
        if sumsq:
            total = ctypes.c_double(0.0)
            rc = self.lib.pipeoff_adam_step_norm(
                param.data_ptr(), None if grad is None else grad.data_ptr(),
                None if last_grad is None else last_grad.data_ptr(), exp_avg.data_ptr(),
                exp_avg_sq.data_ptr(), out_ptr, kind, n, *args, ctypes.byref(total))
            if rc != 0:
                raise RuntimeError(f"pipeoff_adam_step_norm refused its arguments (rc={rc})")
            return total.value
        if last_grad is None:
            assert grad is not None
            rc = self.lib.pipeoff_adam_step(
                param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
                out_ptr, kind, n, *args)
        else:
            rc = self.lib.pipeoff_adam_fold_step(
                param.data_ptr(), None if grad is None else grad.data_ptr(),
                last_grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(), out_ptr,
                kind, n, *args)
        if rc != 0:
            raise RuntimeError(f"pipeoff_adam_step refused its arguments (rc={rc})")
        return None


def _pow(base: float, exp: float) -> float:
    """C's ``pow``: overflow is an infinity, a domain error NaN."""
    try:
        return math.pow(base, exp)
    except OverflowError:
        return -math.inf if base < 0 and exp % 2 == 1 else math.inf
    except ValueError:
        return math.nan


def _div(a: float, b: float) -> float:
    """IEEE division: by zero, an infinity (or NaN for 0/0)."""
    if b != 0:
        return a / b
    if a == 0 or a != a:
        return math.nan
    return math.copysign(math.inf, a) * math.copysign(1.0, b)


def _sqrt(x: float) -> float:
    """IEEE square root: NaN below zero."""
    return math.sqrt(x) if x >= 0 or x != x else math.nan


_lock = threading.Lock()
_kernel: HostKernel | None = None
_why: str | None = None
_decided = False
_warned = False
_broken = False  # the kernel built but failed its self-test: a bug to report
_log = logging.getLogger("pipeoff")


def host_kernel(*, warn: bool = True, stacklevel: int = 2) -> HostKernel | None:
    """The native step, checked against torch on this machine at first call, or
    ``None`` when it is not to be had or does not match torch: then, with ``warn``,
    one ``RuntimeWarning`` per process naming why (a lane thread passes
    ``warn=False``: a warning turned error there would fail the step; the
    optimizer warns on the caller's thread, :func:`warn_if_off`).
    ``PIPEOFF_NATIVE=0`` turns it off silently."""
    global _kernel, _why, _decided, _warned
    if not _decided:
        with _lock:
            if not _decided:
                _decide()
    if warn and _kernel is None and not _warned and not _native.turned_off():
        _warned = True
        what = (f"pipeoff: the fused host step is off, {_why}; full offload runs torch's "
                "fused AdamW, fold and cast instead (the same bits, more passes over memory)")
        if _broken:  # a kernel that computes other bits than torch: the user should know
            warnings.warn(what + "; please report it", RuntimeWarning, stacklevel=stacklevel)
        else:  # no compiler, or a CPU it does not know: expected, nothing to act on
            _log.info(what)
    return _kernel


def _decide() -> None:
    global _kernel, _why, _decided, _broken
    lib = _native.library()
    level = torch.backends.cpu.get_cpu_capability()
    if lib is None:
        _why = f"the native kernels are unavailable: {_native.unavailable_reason()}"
    elif level not in CONTRACTIONS:
        _why = (f"torch's CPU dispatch level here is {level}, whose rounding of fused "
                f"AdamW pipeoff does not know (it knows {', '.join(CONTRACTIONS)})")
    else:
        kernel = HostKernel(lib, level)
        try:
            mismatch = _self_test_apart(kernel)
        except Exception as err:  # decided, not retried at every step
            mismatch = f"it raised {type(err).__name__}: {err}"
        if mismatch is None:
            _kernel = kernel
        else:
            _why = f"its self-test against torch's fused AdamW failed: {mismatch}"
            _broken = True
    _decided = True


def warn_if_off(optimizer_class: type[torch.optim.Optimizer],
                groups: Sequence[Mapping[str, Any]]) -> None:
    """On the caller's thread: decide the kernel (and warn if it is off) when some
    group would use it."""
    if any(adam_hyper(optimizer_class, g) is not None for g in groups):
        host_kernel(warn=True, stacklevel=4)  # at the optimizer's caller


def unavailable_reason() -> str | None:
    """Why :func:`host_kernel` returned ``None``."""
    return _why


def host_step_status(optimizer: Any = None) -> str:
    """How :class:`~pipeoff.optim.FullOffloadOptimizer` steps ``fused=True`` Adam/AdamW
    on this machine: ``"native (AVX512, 8 threads)"``, or ``"torch: <why not native>"``.
    The first call on a machine builds the kernels (about 15 s on 2 cores; later
    processes load the cached build) and each process checks them once.

    Args:
        optimizer: a ``FullOffloadOptimizer``: then also how its last step's final
            micro-step reached the host step, and why (its ``host_step_path``):
            ``"native (AVX512, 2 threads); last step: one pass (32 B): final backward
            marked, ..."``, or ``"...; no step yet"``.
    """
    kernel = host_kernel(warn=False)  # the reason is returned instead
    if kernel is None:
        status = f"torch: {_why or _native.unavailable_reason()}"
    else:
        status = f"native ({kernel.level}, {default_threads()} threads)"
    if optimizer is None:
        return status
    path = optimizer.host_step_path
    return f"{status}; " + ("no step yet" if path is None else f"last step: {path}")


def _reset_for_tests() -> None:
    global _kernel, _why, _decided, _warned, _broken
    with _lock:
        _kernel, _why, _decided, _warned, _broken = None, None, False, False, False


# -- the self-test ----------------------------------------------------------------------
_HYPER = (
    AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=True,
              maximize=False),
    AdamHyper(lr=1e-3, beta1=0.3, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=False,
              maximize=False),
    AdamHyper(lr=1e-2, beta1=0.5, beta2=0.99, eps=1e-6, weight_decay=0.0, decoupled=True,
              maximize=True),
    AdamHyper(lr=3e-4, beta1=0.95, beta2=0.95, eps=1e-12, weight_decay=0.0, decoupled=False,
              maximize=False),
    AdamHyper(lr=1e-3, beta1=0.0, beta2=0.99, eps=1e-8, weight_decay=0.1, decoupled=True,
              maximize=False),
)
"""Both lerp branches (``beta1`` below and above 0.5, and 0, where torch's vector
body and scalar tail differ in the sign of a zero), Adam's L2 term and AdamW's
decay, with and without weight decay, ``maximize``."""


def _values(n: int, gen: torch.Generator) -> list[torch.Tensor]:
    """``param, grad, exp_avg, exp_avg_sq`` over the value classes: normal,
    mid-training, subnormal, huge, signed zeros, infinities, NaNs, random bits."""
    f32 = torch.float32  # explicit: the caller's default dtype may be float64

    def randn() -> torch.Tensor:
        return torch.randn(n, generator=gen, dtype=f32)

    def mix(scale: float) -> torch.Tensor:
        x = randn() * scale
        cls = torch.randint(0, 10, (n,), generator=gen)
        x = torch.where(cls == 0, randn() * 1e-39, x)  # subnormal
        x = torch.where(cls == 1, randn() * 1e30, x)  # huge
        x = torch.where(cls == 2, torch.zeros(n, dtype=f32).copysign(randn()), x)
        bits = torch.randint(-2**31, 2**31 - 1, (n,), generator=gen, dtype=torch.int32)
        x = torch.where(cls == 3, bits.view(f32), x)  # anything, inf and NaN too
        return x
    p, g, m = mix(1.0), mix(1e-2), mix(1e-3)
    zero = torch.randint(0, 4, (n,), generator=gen) == 0  # a quarter: signed zeros at once
    g = torch.where(zero, torch.zeros(n, dtype=f32).copysign(randn()), g)
    m = torch.where(zero, torch.zeros(n, dtype=f32).copysign(randn()), m)
    v = mix(1e-6).abs()
    special = torch.tensor([float("inf"), -float("inf"), float("nan")], dtype=f32)
    g[:: max(1, n // 3)] = special[torch.randint(0, 3, (1,), generator=gen)]
    return [p, g, m, v]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, a NaN matching any NaN (which operand's payload an operation
    propagates is not a property of the math)."""
    an, bn = a.isnan(), b.isnan()
    if not torch.equal(an, bn):
        return False
    ints = torch.int32 if a.dtype == torch.float32 else torch.int16
    return torch.equal(a.view(ints)[~an], b.view(ints)[~bn])


def _self_test_apart(kernel: HostKernel) -> str | None:
    """:func:`self_test` on a thread of its own: outside the dispatch modes (a
    profiler's, the simulated device's) of the thread that asked, which are per thread."""
    result: list[str | None] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.append(self_test(kernel))
        except BaseException as err:  # re-raised on the asking thread
            errors.append(err)

    t = threading.Thread(target=run, name="pipeoff-self-test", daemon=True)
    t.start()
    t.join()
    if errors:
        raise errors[0]
    return result[0]


def self_test(kernel: HostKernel, *, steps: int = 3) -> str | None:
    """``None`` if ``kernel`` gives torch's fused Adam/AdamW bits (and its BF16 cast) on
    this machine, over the value classes, odd lengths (every tail), both
    ``beta1`` branches, a clip scale and ``steps`` steps; else what differed."""
    gen = torch.Generator().manual_seed(1234)
    sizes = [*range(1, 34), 100_003]
    for hi, h in enumerate(_HYPER):
        fused = _compat.fused_adam_kernel(h.decoupled)
        for n in sizes:
            base = _values(n, gen)
            ref = [t.clone() for t in base]
            mine = [t.clone() for t in base]
            scale = 0.5 if hi == 1 else None
            out = torch.empty(n, dtype=torch.bfloat16)
            for step in range(1, steps + 1):
                grad = ref[1] * scale if scale is not None else ref[1]
                step_t = torch.tensor(float(step), dtype=torch.float32)
                fused([ref[0]], [grad], [ref[2]], [ref[3]], [], [step_t],
                      lr=h.lr, beta1=h.beta1, beta2=h.beta2, weight_decay=h.weight_decay,
                      eps=h.eps, amsgrad=False, maximize=h.maximize)
                kernel.adam_step(mine[0], mine[1], mine[2], mine[3], out, h, step=float(step),
                                 scale=scale, threads=2, announce=False)
                for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"),
                                      (ref[0], ref[2], ref[3]), (mine[0], mine[2], mine[3])):
                    if not _same(a, b):
                        bad = int((a.view(torch.int32) != b.view(torch.int32)).sum())
                        return (f"{name} differs in {bad} of {n} elements after step {step} "
                                f"({h}, dispatch level {kernel.level})")
                if not _same(ref[0].to(torch.bfloat16), out):
                    return f"the BF16 cast differs ({n} elements, step {step})"
    return None
