"""The final fold of full offload with torch's 2-norm of the sum taken in the same pass
(``pipeoff_fold_norm``): the norm clipping needs before the step, 10 bytes per
parameter where the fold then torch's norm move 14.

torch's 2-norm of a contiguous FP32 tensor sums the squares in 8 lanes in order, with
no fused multiply-add, adds the lanes in order, then the last ``n % 8`` squares (an
in-order 4-wide step, the rest contracted into fused multiply-adds on the AVX2 and
AVX-512 builds: :data:`_NORM_TAIL_FMA`), and takes ``sqrtf``; of one element, its
absolute value. That order is sequential: the kernel's calling thread takes the
norm chunk after chunk, in cache, while helpers fold the chunks ahead
(``hoststep.c``). At first use in each process :func:`self_test_norm` checks it
against ``torch.linalg.vector_norm`` on this machine; if the bits differ (another
torch, another level) the fold and torch's norm run apart, said once at INFO.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

import torch

from pipeoff import _accel, _happens, _native
from pipeoff.optim._full_offload._host_kernel import _KINDS, _same

__all__ = ["fold_norm", "new_lanes", "norm_in_fold", "reset_for_tests", "self_test_norm"]

_log = logging.getLogger("pipeoff")


def fold_norm(acc: torch.Tensor, grad: torch.Tensor, *, first: bool, threads: int,
              lanes: torch.Tensor, offset: int, total: int,
              last: bool) -> torch.Tensor | None | bool:
    """``_host_kernel.fold`` of the piece ``acc`` (elements ``offset`` on of a sum of ``total``),
    taking torch's 2-norm of the finished sum as it goes: ``lanes`` (8 FP32 zeros at the
    first piece) carries it from piece to piece; at the ``last`` piece, returns the norm
    (a 0-dim FP32 tensor, bitwise ``torch.linalg.vector_norm`` of the whole sum), else
    ``None``. One pass over memory where the fold and then the norm make two.

    Returns ``False`` (and does nothing) when the kernels are unavailable, their norm did
    not match torch's here (:func:`self_test_norm`), or the tensors are of other kinds:
    the caller then folds and takes the norm apart.
    """
    lib = _native.library()
    kind = _KINDS.get(grad.dtype)
    if (lib is None or kind is None or acc.dtype != torch.float32 or acc.device.type != "cpu"
            or grad.device.type != "cpu" or not acc.is_contiguous()
            or not grad.is_contiguous() or acc.numel() != grad.numel()
            or not _norm_matches()):
        return False
    _happens.native_access("pipeoff_fold_norm", reads=(grad,) if first else (acc, grad),
                           writes=(acc, lanes))
    out = _accel.current().host_empty((1,), torch.float32, pinned=False) if last else None
    rc = lib.pipeoff_fold_norm(acc.data_ptr(), grad.data_ptr(), kind, acc.numel(), int(first),
                               threads, lanes.data_ptr(), offset, total, _NORM_TAIL_FMA[_level()],
                               None if out is None else out.data_ptr())
    if rc != 0:
        raise RuntimeError(f"pipeoff_fold_norm refused its arguments (rc={rc})")
    return None if out is None else out.reshape(())


def new_lanes() -> torch.Tensor:
    """The running lane sums of a fold's norm, zero: host memory (the kernel writes it)."""
    return _accel.current().host_empty((8,), torch.float32, pinned=False).zero_()


def norm_in_fold() -> bool:
    """Whether :func:`fold_norm` runs here (the kernels, and their norm is torch's)."""
    return _native.library() is not None and _norm_matches()


_NORM_TAIL_FMA: Mapping[str, int] = {"DEFAULT": 0, "AVX2": 1, "AVX512": 1}
"""Per torch CPU dispatch level, whether its 2-norm's scalar tail (the last ``n % 8``
squares) was contracted into fused multiply-adds after an in-order 4-wide step (found
against torch 2.13 on AVX-512; :func:`self_test_norm` re-checks it on every machine)."""

_norm_lock = threading.Lock()
_norm_ok: bool | None = None


def _level() -> str:
    return torch.backends.cpu.get_cpu_capability()


def _norm_matches() -> bool:
    """Whether the native norm gives torch's bits here (checked once per process, on a
    thread of its own; a mismatch is said on the ``pipeoff`` logger at INFO and the
    fold and the norm run apart)."""
    global _norm_ok
    if _norm_ok is None:
        with _norm_lock:
            if _norm_ok is None:
                lib = _native.library()
                why = ("no kernels" if lib is None else
                       f"torch's dispatch level {_level()} is not one whose norm it knows"
                       if _level() not in _NORM_TAIL_FMA else
                       _apart(lambda: self_test_norm(lib)))
                if why is not None and lib is not None:
                    _log.info("pipeoff: the native fold takes no norm (%s); the final fold "
                              "and torch's norm run as two passes", why)
                _norm_ok = why is None
    return _norm_ok


def self_test_norm(lib: Any) -> str | None:
    """``None`` if ``pipeoff_fold_norm`` gives ``torch.linalg.vector_norm``'s bits here
    (every length 1-40 and two long ones, pieces cut anywhere, the first contribution
    copied or added, normal, subnormal, huge and special values), else what differed."""
    gen = torch.Generator().manual_seed(4321)
    f32 = torch.float32
    for n in [*range(1, 41), 100_003, (1 << 17) + 5]:
        for cut in sorted({0, n // 3, (n // 2) & ~7, n - 1}):
            x = torch.randn(n, generator=gen, dtype=f32)
            cls = torch.randint(0, 12, (n,), generator=gen)
            x = torch.where(cls == 0, x * 1e-39, x)
            x = torch.where(cls == 1, x * 1e19, x)  # squares past FP32's range: inf
            if n > 30:
                x[n // 5] = float("nan")
            base = torch.randn(n, generator=gen, dtype=f32)
            for first in (True, False):
                acc = base.clone()
                lanes = torch.zeros(8, dtype=f32)
                got = torch.zeros((), dtype=f32)
                for s, e in ((0, cut), (cut, n)):
                    if e == s:
                        continue
                    out = got if e == n else None
                    rc = lib.pipeoff_fold_norm(
                        acc[s:].data_ptr(), x[s:].data_ptr(), 2, e - s, int(first), 2,
                        lanes.data_ptr(), s, n, _NORM_TAIL_FMA[_level()],
                        None if out is None else out.data_ptr())
                    if rc != 0:
                        return f"pipeoff_fold_norm refused its arguments (rc={rc})"
                want = torch.linalg.vector_norm(x if first else base + x, 2.0)
                if not _same(got.reshape(1), want.reshape(1)):
                    return (f"the norm of {n} elements (cut at {cut}) is {float(got)!r}, "
                            f"torch's {float(want)!r}")
    return None


def reset_for_tests() -> None:
    global _norm_ok
    with _norm_lock:
        _norm_ok = None


def _apart(fn: Any) -> str | None:
    """``fn()`` on a thread of its own (outside the calling thread's dispatch modes);
    its exception, if any, as the reason."""
    result: list[str | None] = []

    def run() -> None:
        try:
            result.append(fn())
        except Exception as err:  # decided, not retried
            result.append(f"it raised {type(err).__name__}: {err}")

    t = threading.Thread(target=run, name="pipeoff-self-test", daemon=True)
    t.start()
    t.join()
    return result[0] if result else "it did not finish"
