"""benchmarks/bench_local_sgd.py stays runnable in its quickest mode."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_local_sgd_benchmark_quick(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_local_sgd.py"), "--sizes", "1",
         "--repeats", "1", "--threads", "1", "--bucket-mib", "1", "--budget-mib", "2",
         "--trace-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=140,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    for mode in ("original", "RFC sync", "pipelined", "floor"):
        assert f"| {mode}" in res.stdout
    assert (tmp_path / "local_sgd_1M_pipelined.json").exists()
