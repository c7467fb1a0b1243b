"""The final fold with torch's norm taken in its pass (``_fold_norm.py``, issue 35): the
sum and the norm bitwise ``acc.add_(grad)`` then ``torch.linalg.vector_norm``, over
pieces cut anywhere, at every dispatch level this machine runs; the fallback when the
norm does not match; the clipped optimizer bitwise through it."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeoff import _native
from pipeoff.optim import FullOffloadOptimizer
from pipeoff.optim._full_offload import _fold_norm, _host_kernel
from tests.optim.full_reference import Reference
from tests.optim.test_full_offload import (
    assert_bitwise,
    batches,
    make_model,
    train,
    train_reference,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _native_kernels() -> None:
    if _native.library() is None:
        pytest.skip(f"no native kernels: {_native.unavailable_reason()}")


def _fold_in_pieces(acc: torch.Tensor, grad: torch.Tensor, cuts: list[int], *, first: bool,
                    threads: int) -> torch.Tensor:
    n = acc.numel()
    lanes = _fold_norm.new_lanes()
    bounds = [0, *cuts, n]
    out: object = None
    for s, e in zip(bounds, bounds[1:]):
        out = _fold_norm.fold_norm(acc[s:e], grad[s:e], first=first, threads=threads,
                                   lanes=lanes, offset=s, total=n, last=e == n)
        assert out is not False
    assert isinstance(out, torch.Tensor)
    return out


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_fold_takes_torchs_norm_bit_for_bit(dtype: torch.dtype, threads: int) -> None:
    """Every length 1-40 and long ones (several of the kernel's chunks, a tail of every
    size), cut into pieces anywhere (a lane's run crosses a piece, the tail reaches
    back into the piece before), the first contribution copied or added; normal,
    mid-training, subnormal, huge (squares past FP32: inf), signed-zero and special
    values."""
    gen = torch.Generator().manual_seed(7)
    for n in [*range(1, 41), 100_003, (1 << 17) + 6]:
        base, g = (_host_kernel._values(n, gen)[k] for k in (0, 1))
        grad = g.to(dtype)
        for cuts in ([], [n // 3], sorted({n // 5, (n // 2) | 3, n - 1} - {0, n})):
            cuts = [c for c in cuts if 0 < c < n]
            for first in (True, False):
                acc = base.clone()
                norm = _fold_in_pieces(acc, grad, cuts, first=first, threads=threads)
                want_acc = grad.float() if first else base + grad.float()
                assert _host_kernel._same(acc, want_acc), (n, cuts, first)
                want = torch.linalg.vector_norm(want_acc, 2.0)
                assert _host_kernel._same(norm.reshape(1), want.reshape(1)), \
                    (n, cuts, first, float(norm), float(want))


@pytest.mark.parametrize("level", ["default", "avx2"])
def test_other_dispatch_levels_take_torchs_norm(level: str) -> None:
    """torch's norm is compiled per level (its tail contracted on AVX2/AVX-512, not on
    DEFAULT); the kernel follows each level this machine can run."""
    if level == "avx2" and torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        pytest.skip("this CPU has no AVX2")
    code = ("import torch\n"
            "from pipeoff import _native\n"
            "from pipeoff.optim._full_offload import _fold_norm\n"
            "print(torch.backends.cpu.get_cpu_capability(), "
            "_fold_norm.self_test_norm(_native.library()))\n")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": level}
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split(maxsplit=1) == [level.upper(), "None\n"], proc.stdout


def test_a_norm_that_does_not_match_folds_apart(monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    """The self-test fails (here: the tail's contractions taken away where torch has
    them): the kernel is not used, it is said at INFO, and the clipped optimizer, its
    fold and torch's norm apart (44 B), is bitwise the reference all the same."""
    level = torch.backends.cpu.get_cpu_capability()
    if not _fold_norm._NORM_TAIL_FMA.get(level):
        pytest.skip("torch contracts nothing in its norm at this dispatch level")
    monkeypatch.setitem(_fold_norm._NORM_TAIL_FMA, level, 0)  # type: ignore[index]
    _fold_norm.reset_for_tests()
    try:
        with caplog.at_level("INFO", logger="pipeoff"):
            assert not _fold_norm.norm_in_fold()
        assert "the native fold takes no norm" in caplog.text
        assert _fold_norm.fold_norm(torch.zeros(8), torch.zeros(8), first=True, threads=1,
                                    lanes=_fold_norm.new_lanes(), offset=0, total=8,
                                    last=True) is False
        model = make_model()
        kw = {"lr": 1e-2, "weight_decay": 0.1, "fused": True}
        ref = Reference(model, torch.optim.AdamW, max_norm=0.05, **kw)
        opt = FullOffloadOptimizer(model, torch.optim.AdamW, max_norm=0.05, **kw)
        data = batches(2, 2)
        train(opt, model, data)
        train_reference(ref, data)
        assert_bitwise(model, ref)
        assert opt.host_step_path is not None and opt.host_step_path.bytes_per_param == 44
    finally:
        _fold_norm.reset_for_tests()


@pytest.mark.parametrize("overlap", ["none", "forward"])
def test_the_clipped_optimizer_folds_its_pieces_with_the_norm(overlap: str) -> None:
    """Gradients shipped in pieces of 500 elements (a lane's run crosses each cut): the
    clipping norm the final folds took is torch's, bitwise the reference (40 B)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 67), torch.nn.GELU(),
                                torch.nn.Linear(67, 8)).to(torch.bfloat16)
    kw = {"lr": 1e-2, "weight_decay": 0.1, "fused": True}
    ref = Reference(model, torch.optim.AdamW, max_norm=0.05, **kw)
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, max_norm=0.05, overlap=overlap,
                               slot_bytes=1000, **kw)
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        xs = [torch.randn(4, 16, generator=gen).to(torch.bfloat16) for _ in range(3)]
        for k, x in enumerate(xs):
            with opt.no_sync() if k < 2 else contextlib.nullcontext():
                model(x).float().pow(2).mean().backward()
            ref.micro_step(lambda m, x=x: m(x).float().pow(2).mean())
        opt.step()
        opt.zero_grad()
        ref.step()
    opt.wait_for_step()
    assert_bitwise(model, ref)
    assert opt.host_step_path is not None and opt.host_step_path.bytes_per_param == 40
