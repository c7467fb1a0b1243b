"""The optimizer benchmarks stay runnable: CPU in a tiny size; the GPU one refuses cleanly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # each test runs a benchmark script (subprocess)

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_cpu_benchmark_tiny() -> None:
    res = subprocess.run(
        [sys.executable, str(BENCH / "bench_optimizer.py"), "--layers", "2", "--width", "64",
         "--batch", "4", "--chunk-mb", "0.01", "--iters", "1", "--repeats", "1"],
        capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    for mode in ("plain AdamW", "single_pass", "chunked", "overlap"):
        for kernel in ("for-loop", "fused"):  # torch's default and fused AdamW, side by side
            assert f"{mode} ({kernel})" in res.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: nothing to refuse")
def test_gpu_benchmark_refuses_without_a_gpu() -> None:
    res = subprocess.run([sys.executable, str(BENCH / "gpu_optimizer.py"), "--quick"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "no CUDA device" in res.stderr


def test_cpu_benchmark_sweeps_the_offload_fraction() -> None:
    res = subprocess.run(
        [sys.executable, str(BENCH / "bench_optimizer.py"), "--layers", "2", "--width", "64",
         "--batch", "4", "--chunk-mb", "0.01", "--iters", "1", "--repeats", "2",
         "--inner", "for-loop", "--fractions", "0,0.5,1"],
        capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    for mode in ("chunked", "overlap"):
        for f in ("0", "0.5", "1"):
            assert f"{mode} f={f} (for-loop)" in res.stdout
    assert "state MiB device / host" in res.stdout and "range ms (min-max)" in res.stdout
