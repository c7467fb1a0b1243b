"""DiLoCo's outer step in native passes, bitwise torch's CPU ``torch.optim.SGD``, ``Adam``
and ``AdamW``.

torch's CPU SGD (its for-loop, the default for CPU tensors) is four or five
element-wise ops per parameter, each a pass over the pseudo-gradient, the
parameter or the momentum buffer: about 44 bytes per element with Nesterov
momentum. ``pipeoff_sgd_step`` (``pipeoff/_native/hoststep.c``) does the same IEEE
operations in one pass, 20 bytes per element with momentum (12 without), over the
rank's cores.

torch's CPU Adam/AdamW (its for-loop) is seven or eight passes, about 80 bytes per
element. Its square root is torch's own ``sqrt``, which on torch's MKL builds is
MKL's and not correctly rounded (it differs from IEEE ``sqrtf`` in about a fifth of
the elements, by one ulp), so it is not redone natively: ``pipeoff_adam_moments``
(the gradient's sign and L2 term, ``exp_avg``'s lerp, ``exp_avg_sq``'s update),
torch's ``sqrt`` of ``exp_avg_sq``, then ``pipeoff_adam_apply`` (AdamW's decay,
the denominator, the addcdiv), in rounds of :data:`_ADAM_CHUNK` elements: 44 bytes
per element through the passes, with one FP32 temporary of a round (16 MiB; torch's
own step makes two the size of the parameter). Few, large rounds: each round is
three parallel regions (torch's ``sqrt`` one of them, on torch's intra-op threads),
and a region costs a scheduling quantum per thread on a busy host.

Their fused multiply-adds are where aten's element-wise kernels have them at each
CPU dispatch level (:data:`ATEN_FMA`), and :func:`outer_kernel` checks that
against torch at first use: a kernel that differs is not used (a
``RuntimeWarning``), a machine without a compiler or at an unknown level runs
torch's step (said once on the ``pipeoff`` logger). ``PIPEOFF_NATIVE=0`` turns it
off.

Which groups take it (:func:`outer_hyper`): ``torch.optim.SGD``, ``Adam`` or
``AdamW`` itself with plain numbers for its hyperparameters, ``foreach`` and
``fused`` unset or ``False`` (torch's for-loop, which is what a CPU optimizer runs
by default), no ``differentiable``; for Adam, no ``amsgrad`` and ``beta1`` above
0.5 (where torch's vector body and scalar loops round its lerp alike). Others run
torch's own step, as before.
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
from pipeoff.optim._full_offload._host_kernel import AdamHyper, _same

__all__ = ["ATEN_FMA", "AdamHyper", "OuterKernel", "SgdHyper", "adam_hyper", "native_takes",
           "outer_hyper", "outer_kernel", "outer_step_status", "sgd_hyper"]

ATEN_FMA: Mapping[str, int] = {"DEFAULT": 0, "AVX2": 1, "AVX512": 1}
"""Per torch CPU dispatch level, whether aten's element-wise multiply-adds are one
fused multiply-add (1: ``a.add(b, alpha=x)``, ``lerp``'s and ``addcmul``'s vector
bodies' ``fmadd`` and their scalar loops, contracted by the compiler) or a multiply
then an add (0). Found on torch 2.13 (DEFAULT and AVX2 measured; AVX512 is its
vector bodies' ``fmadd``, which the self-test checks on the first machine that has
it)."""

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


def adam_hyper(optimizer_class: type[torch.optim.Optimizer],
               group: Mapping[str, Any]) -> AdamHyper | None:
    """``group``'s hyperparameters if the native step is bitwise what
    ``optimizer_class`` does with them (``torch.optim.Adam`` or ``AdamW``'s for-loop
    step with plain numbers, no ``amsgrad``, ``0.5 < beta1 < 1`` and
    ``0 <= beta2 < 1``), else ``None`` (torch's step)."""
    if optimizer_class not in (torch.optim.Adam, torch.optim.AdamW):
        return None
    if group.get("foreach") or group.get("fused") or group.get("differentiable") \
            or group.get("capturable") or group.get("amsgrad"):
        return None
    betas = group.get("betas")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        return None
    values = (group.get("lr"), *betas, group.get("eps"), group.get("weight_decay", 0.0))
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return None  # a Tensor lr or beta: torch's path
    lr, beta1, beta2, eps, weight_decay = (float(v) for v in values)  # type: ignore[arg-type]
    # torch's lerp below weight 0.5 is one expression in its vector body and its
    # scalar loops (each of torch's threads has a tail of its own); beta2 below 1
    # keeps the bias correction's square root real, as torch's constructor does
    if not (0.5 < beta1 < 1.0 and 0.0 <= beta2 < 1.0):
        return None
    decoupled = group.get("decoupled_weight_decay", optimizer_class is torch.optim.AdamW)
    return AdamHyper(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                     decoupled=bool(decoupled), maximize=bool(group.get("maximize", False)))


def outer_hyper(optimizer_class: type[torch.optim.Optimizer],
                group: Mapping[str, Any]) -> SgdHyper | AdamHyper | None:
    """:func:`sgd_hyper` or :func:`adam_hyper`, whichever ``optimizer_class`` is."""
    if optimizer_class is torch.optim.SGD:
        return sgd_hyper(optimizer_class, group)
    return adam_hyper(optimizer_class, group)


def _fp32_1d(t: Any, n: int) -> bool:
    return (isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.is_contiguous()
            and t.numel() == n and t.device.type == "cpu" and t.layout == torch.strided)


def native_takes(param: torch.Tensor, grad: torch.Tensor,
                 state: Mapping[str, Any] | None) -> bool:
    """Whether :meth:`OuterKernel.step` takes these tensors: contiguous FP32 CPU
    ``param`` and ``grad`` of one size, and the state's tensors (a momentum buffer,
    Adam's moments; if any) alike and of ``param``'s shape, Adam's ``step`` a CPU
    scalar. BF16 backups, say, run torch's step, and so does a state tensor the loop
    reshaped (where torch's step raises, as in torchft's DiLoCo)."""
    n = param.numel()
    state = state or {}
    held = [state[k] for k in ("momentum_buffer", "exp_avg", "exp_avg_sq") if k in state]
    if "max_exp_avg_sq" in state:
        return False
    if ("exp_avg" in state) != ("exp_avg_sq" in state) or ("exp_avg" in state) != (
            "step" in state):
        return False
    if "step" in state:
        step = state["step"]
        if not (isinstance(step, torch.Tensor) and step.dim() == 0 and step.device.type == "cpu"
                and step.dtype in (torch.float32, torch.float64)):
            return False
    tensors = (param, grad, *held)
    # Host memory as the accelerator sees it too: the simulated device counts a
    # CPU tensor it did not see allocated as host (torchft's unpinned backups) as
    # device memory, which native code must not touch; torch's step runs there.
    accel = _accel.current()
    return (_fp32_1d(param, n) and _fp32_1d(grad, n) and grad.shape == param.shape
            and all(_fp32_1d(t, n) and t.shape == param.shape for t in held)
            and not any(accel.on_device(t) for t in tensors))


def _check(name: str, t: torch.Tensor, n: int) -> None:
    if t.dtype != torch.float32 or not t.is_contiguous() or t.numel() != n \
            or t.device.type != "cpu":
        raise ValueError(f"{name} must be a contiguous FP32 CPU tensor of {n} elements, "
                         f"got {t.dtype} {tuple(t.shape)} on {t.device}")


class OuterKernel:
    """The native outer steps at one dispatch level's rounding (:data:`ATEN_FMA`)."""

    def __init__(self, lib: Any, level: str) -> None:
        self.lib = lib
        self.level = level
        self.fma = ATEN_FMA[level]

    def step(self, param: torch.Tensor, grad: torch.Tensor, state: MutableMapping[str, Any],
             hyper: SgdHyper | AdamHyper, *, threads: int, announce: bool = True) -> None:
        """:meth:`sgd_step` or :meth:`adam_step`, whichever ``hyper`` is for."""
        if isinstance(hyper, SgdHyper):
            self.sgd_step(param, grad, state, hyper, threads=threads, announce=announce)
        else:
            self.adam_step(param, grad, state, hyper, threads=threads, announce=announce)

    def adam_step(self, param: torch.Tensor, grad: torch.Tensor,
                  state: MutableMapping[str, Any], hyper: AdamHyper, *, threads: int,
                  announce: bool = True, chunk: int | None = None) -> None:
        """One ``torch.optim.Adam``/``AdamW`` step (its for-loop) of ``param`` with
        gradient ``grad`` (not written), and of ``state`` (``step``, ``exp_avg``,
        ``exp_avg_sq``), created on the first step as torch creates it.

        ``param`` and ``grad``: contiguous FP32 CPU tensors of one shape, not
        overlapping; the moments alike. ``announce=False`` keeps the native accesses
        from a checker (the self-test's tensors, which it does not know). ``chunk``:
        elements per round of the passes (default :data:`_ADAM_CHUNK`; the
        self-test's odd one puts chunk edges at every alignment).

        Raises:
            ValueError: the tensors are not of that kind.
        """
        n = param.numel()
        _check("param", param, n)
        _check("grad", grad, n)
        if not state:
            # torch's Adam._init_group: a CPU step counter, zeroed moments
            dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
            state["step"] = torch.tensor(0.0, dtype=dtype)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        m, v, step_t = state["exp_avg"], state["exp_avg_sq"], state["step"]
        _check("exp_avg", m, n)
        _check("exp_avg_sq", v, n)
        h = hyper
        step_t += 1  # as torch, before the math
        step = step_t.item()
        # The scalars as torch's Python computes them, in double (its ``** 0.5``, not
        # ``math.sqrt``), each rounded to float by ctypes as aten rounds a scalar.
        bc1 = 1.0 - h.beta1 ** step
        bc2 = 1.0 - h.beta2 ** step
        wd = h.weight_decay
        adam_wd = int(not h.decoupled and wd != 0)
        if n == 0:  # (an empty one has no storage)
            return
        if announce:
            _happens.native_access("pipeoff_adam_step", reads=(grad, m, v, param),
                                   writes=(m, v, param))
        increment_version([m, v, param])
        # Round by round, so that the square root's temporary is a round's, not the
        # parameter's (torch's step makes two of the parameter's size).
        chunk = chunk or _ADAM_CHUNK
        root = torch.empty(min(n, chunk), dtype=torch.float32)
        pp, mp, vp, gp = param.data_ptr(), m.data_ptr(), v.data_ptr(), grad.data_ptr()
        v_flat = v.view(-1)  # contiguous, checked
        for a in range(0, n, chunk):
            k = min(chunk, n - a)
            off = 4 * a  # FP32 bytes
            rc = self.lib.pipeoff_adam_moments(
                mp + off, vp + off, gp + off, pp + off if adam_wd else None, k,
                int(h.maximize), adam_wd, wd, 1.0 - h.beta1, h.beta2, 1.0 - h.beta2, self.fma,
                threads)
            if rc != 0:
                raise RuntimeError(f"pipeoff_adam_moments refused its arguments (rc={rc})")
            # torch's own square root, whose bits native code cannot reproduce (MKL's
            # on this build); elementwise, so a chunk's bits are the whole tensor's
            torch.sqrt(v_flat[a:a + k], out=root[:k])
            rc = self.lib.pipeoff_adam_apply(
                pp + off, mp + off, root.data_ptr(), k, int(h.decoupled and wd != 0),
                1.0 - h.lr * wd, bc2 ** 0.5, h.eps, -(h.lr / bc1), threads)
            if rc != 0:
                raise RuntimeError(f"pipeoff_adam_apply refused its arguments (rc={rc})")

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
        _check("param", param, n)
        _check("grad", grad, n)
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
    """The native outer steps (SGD, Adam, AdamW), or ``None`` (torch's step;
    :func:`outer_step_status` says why). Built, checked against torch and decided
    once per process; the first call on a machine builds the library (about 15 s on
    2 cores, once)."""
    global _said
    if not _decided:
        with _lock:
            if not _decided:
                _decide()
    if _kernel is None and not _said and not _native.turned_off():
        _said = True
        what = (f"pipeoff: DiLoCo's native outer step (SGD, Adam, AdamW) is off, {_why}; "
                "torch's step runs")
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
    elif level not in ATEN_FMA:
        _why = (f"torch's CPU dispatch level here is {level}, whose rounding pipeoff does "
                f"not know (it knows {', '.join(ATEN_FMA)})")
    else:
        kernel = OuterKernel(lib, level)
        try:
            mismatch = _apart(self_test, kernel)
        except Exception as err:  # decided, not retried at every sync
            mismatch = f"it raised {type(err).__name__}: {err}"
        if mismatch is None:
            _kernel = kernel
        else:
            _why = f"its self-test against torch's optimizers failed: {mismatch}"
    _decided = True


def outer_step_status() -> str:
    """How DiLoCo steps an SGD, Adam or AdamW outer optimizer in host memory:
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


_ADAM_HYPER = (
    AdamHyper(lr=0.7, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, decoupled=True,
              maximize=False),  # an outer AdamW
    AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=False,
              maximize=True),  # Adam's L2 term, maximize
    AdamHyper(lr=1e-2, beta1=0.6, beta2=0.99, eps=1e-6, weight_decay=0.0, decoupled=False,
              maximize=False),
)
_ADAM_CHUNK = 1 << 22
"""Elements in one round of the Adam passes (the square root's temporary: 16 MiB).
Smaller rounds, whose arrays would stay in cache between the passes, lost more to
the regions' start-up than they saved: measured on this 2-core machine
(``bench_outer_step.py``, 16M parameters), 1 Mi elements took 29 ms against 20 ms
at 4 Mi with two threads, and 115 ms against 43 ms beside two CPU-bound processes
(torch's ``sqrt`` on two OpenMP threads)."""

_LENGTHS = (1, 2, 7, 8, 9, 15, 16, 17, 31, 32, 33, 100_003)  # every tail class


def self_test(kernel: OuterKernel, *, steps: int = 3) -> str | None:
    """``None`` if ``kernel`` gives ``torch.optim.SGD``'s, ``Adam``'s and ``AdamW``'s
    bits on this machine (value classes from subnormals to NaNs, lengths on both
    sides of the vector widths, one that torch splits over its threads, ``steps``
    steps of each configuration); else what differed."""
    return _sgd_self_test(kernel, steps) or _adam_self_test(kernel, steps)


def _adam_self_test(kernel: OuterKernel, steps: int) -> str | None:
    from pipeoff.optim._full_offload._host_kernel import _values

    gen = torch.Generator().manual_seed(8765)
    for h in _ADAM_HYPER:
        cls = torch.optim.AdamW if h.decoupled else torch.optim.Adam
        for n in _LENGTHS:
            p0 = _values(n, gen)[0]
            ref = p0.clone()
            opt = cls([ref], lr=h.lr, betas=(h.beta1, h.beta2), eps=h.eps,
                      weight_decay=h.weight_decay, maximize=h.maximize, foreach=False)
            mine, state = p0.clone(), {}  # type: ignore[var-annotated]
            for step in range(steps):
                grad = _values(n, gen)[1]
                ref.grad = grad
                opt.step()
                kernel.adam_step(mine, grad, state, h, threads=2, announce=False,
                                 chunk=4099)
                theirs = opt.state[ref]
                for what, a, b in (("param", mine, ref),
                                   ("exp_avg", state["exp_avg"], theirs["exp_avg"]),
                                   ("exp_avg_sq", state["exp_avg_sq"], theirs["exp_avg_sq"]),
                                   ("step", state["step"], theirs["step"])):
                    # bitwise, a NaN matching any NaN (which operand's payload an
                    # operation propagates is not a property of the math)
                    if a.dtype != b.dtype or not _same(a.reshape(-1), b.reshape(-1)):
                        return (f"{cls.__name__}'s {what} differs at step {step + 1} of {h} "
                                f"({n} elements)")
    return None


def _sgd_self_test(kernel: OuterKernel, steps: int) -> str | None:
    from pipeoff.optim._full_offload._host_kernel import _values

    gen = torch.Generator().manual_seed(4321)
    for h in _HYPER:
        for n in _LENGTHS:
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
                        return (f"SGD's {what} differs in {len(apart)} of {n} elements at step "
                                f"{step + 1} of {h} (first at {i}: {float(a[i])!r} vs torch "
                                f"{float(b[i])!r})")
    return None
