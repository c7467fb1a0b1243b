"""The benchmark scripts stay runnable (quick modes) and the GPU suite's graphs are right."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # runs a benchmark script (subprocess)
def test_scheduler_benchmark_quick() -> None:
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_scheduler.py"),
                          "--sizes", "200", "--repeats", "1"], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert "threads" in res.stdout and "us/task" in res.stdout


@pytest.mark.slow  # runs a benchmark script (subprocess)
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: nothing to refuse")
def test_gpu_suite_refuses_without_a_gpu() -> None:
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_suite.py"), "--out",
                          "/tmp/unused"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "no CUDA device" in res.stderr


@pytest.mark.slow  # runs a benchmark script (subprocess)
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: nothing to refuse")
def test_gpu_checks_refuse_without_a_gpu() -> None:
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_checks.py")],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "no CUDA device" in res.stderr


@pytest.mark.slow  # runs a benchmark script (subprocess)
@pytest.mark.parametrize("optimizer", ["offload", "full"])
def test_auto_fraction_benchmark_runs_on_cpu(optimizer: str) -> None:
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_auto_fraction.py"),
                          "--layers", "2", "--width", "128", "--rounds", "1", "--device", "cpu",
                          "--optimizer", optimizer],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "auto chose offload_fraction=" in res.stdout and "(auto)" in res.stdout


def load_benchmark(name: str) -> ModuleType:
    """Import ``benchmarks/<name>.py`` by its file path (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}",
                                                  ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_suite_local_sgd_graphs_run_on_cpu(tmp_path: Path) -> None:
    gpu_suite = load_benchmark("gpu_suite")
    (tmp_path / "traces").mkdir()
    rows = gpu_suite.local_sgd_staging(tmp_path, [1 << 12] * 6, bucket_bytes=1 << 14,
                                       device="cpu")
    assert [r[0] for r in rows] == ["rfc", "pipelined"]
    assert rows[1][4] <= 2 * (1 << 14)
    assert (tmp_path / "traces" / "local_sgd_pipelined.json").exists()


@pytest.mark.slow  # runs a benchmark script (subprocess)
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: nothing to refuse")
def test_gpu_full_offload_refuses_without_a_gpu() -> None:
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_full_offload.py")],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "no CUDA device" in res.stderr


@pytest.mark.slow  # runs a benchmark script (subprocess)
def test_full_offload_cpu_benchmark_quick() -> None:
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_full_offload.py"),
                          "--numel", "262144", "--params", "2", "--repeats", "1",
                          "--threads", "1"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "whole host step" in res.stdout and "naive / whole step" in res.stdout


@pytest.mark.slow  # runs a benchmark script (subprocess)
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: nothing to refuse")
def test_gpu_transfer_refuses_without_a_gpu() -> None:
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_transfer.py")],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "no CUDA device" in res.stderr


@pytest.mark.slow  # runs a benchmark script (subprocess)
def test_transfer_benchmark_quick() -> None:
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_transfer.py"),
                          "--mib", "8", "--tensors", "4", "--budgets-mib", "1", "--repeats", "1",
                          "--plan-tensors", "200"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "x raw copy_" in res.stdout and "plan of 200 tensors" in res.stdout


@pytest.mark.slow  # runs a benchmark script (subprocess)
def test_host_step_benchmark_quick() -> None:
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_host_step.py"),
                          "--numel", "262144", "--params", "2", "--rounds", "1",
                          "--threads", "1"], capture_output=True, text=True, timeout=120)
    if "no native kernel here" in res.stderr + res.stdout:
        pytest.skip("no native kernels on this machine")
    assert res.returncode == 0, res.stderr
    assert "pipeoff kernels" in res.stdout and "fold: native" in res.stdout


@pytest.mark.slow  # runs a benchmark script (subprocess)
def test_host_node_benchmark_quick() -> None:
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "host_node.py"),
                          "--mib", "16", "--ranks", "1", "2", "--rounds", "1"],
                         capture_output=True, text=True, timeout=120)
    if "no native kernel here" in res.stderr:
        pytest.skip("no native kernels on this machine")
    assert res.returncode == 0, res.stderr
    assert "GB/s per rank" in res.stdout and "h200_node assumes" in res.stdout


@pytest.mark.slow  # runs a benchmark script (subprocess)
def test_outer_step_benchmark_quick() -> None:
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_outer_step.py"),
                          "--numel", "262144", "--params", "2", "--rounds", "1",
                          "--threads", "1"], capture_output=True, text=True, timeout=120)
    if "no native kernel here" in res.stderr + res.stdout:
        pytest.skip("no native kernels on this machine")
    assert res.returncode == 0, res.stderr
    assert "bitwise (sgd, adamw): checked" in res.stdout
    for name in ("floor", "native", "torch for-loop", "torch foreach"):
        assert f"| {name}" in res.stdout
    assert "| adamw" in res.stdout and "| sgd" in res.stdout


@pytest.mark.slow  # runs a benchmark script (subprocess)
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: nothing to refuse")
def test_gpu_diloco_refuses_without_a_gpu_and_runs_on_the_simulated_device() -> None:
    script = str(ROOT / "benchmarks" / "gpu_diloco.py")
    res = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "no CUDA device" in res.stderr
    res = subprocess.run([sys.executable, script, "--simulated", "--layers", "2", "--width",
                          "64", "--rounds", "1", "--bucket-mib", "0.01", "--budget-mib", "0.02"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-4000:]
    for name in ("torchft", "synchronous", "pipelined"):
        assert f"| {name}" in res.stdout


@pytest.mark.slow  # runs a benchmark script (subprocess)
@pytest.mark.timeout(150)
def test_diloco_benchmark_quick() -> None:
    pytest.importorskip("torchft")
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_diloco.py"),
                          "--sizes", "1", "--repeats", "1", "--threads", "1", "--bucket-mib",
                          "1", "--budget-mib", "2"], capture_output=True, text=True, timeout=140)
    assert res.returncode == 0, res.stderr[-4000:]
    for name in ("torchft", "synchronous", "pipelined", "floor"):
        assert f"| {name}" in res.stdout
