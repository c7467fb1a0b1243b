"""examples/diloco_torchft.py runs end to end and leaves a readable trace."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import pipeoff

pytestmark = pytest.mark.slow  # runs an example script (subprocess)

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(120)
def test_diloco_example_runs(tmp_path: Path) -> None:
    pytest.importorskip("torchft")
    trace = tmp_path / "sync.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "diloco_torchft.py"), "--steps", "8",
         "--trace", str(trace)],
        capture_output=True, text=True, timeout=110, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "replica 1: final loss" in proc.stdout
    assert "device staging" in proc.stdout
    loaded = pipeoff.Trace.load(trace)
    summary = loaded.summary()
    assert summary.failed == 0 and summary.peak_device_staging_bytes <= 128 << 10
    assert {t.name.split(":")[0] for t in loaded.tasks} == {
        "pseudograd", "allreduce", "d2h", "formed", "staged", "commit", "outer", "write"}
