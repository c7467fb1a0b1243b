"""examples/local_sgd_torchft.py and examples/diloco_torchft.py run end to end (two
replicas, a real Lighthouse) and leave a readable trace of their last sync."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import pipeoff

pytestmark = pytest.mark.slow  # runs an example script (subprocess)

ROOT = Path(__file__).resolve().parents[1]

EXAMPLES = {
    # script: (training steps, the trace's task kinds by name prefix)
    "local_sgd_torchft.py": (4, {"allreduce", "d2h", "should_commit", "h2d"}),
    # (fragment_sync_delay=1: each formed bucket is staged to the host and uploaded
    # again for its all-reduce; the outer step is speculative, "keep" keeps it.)
    "diloco_torchft.py": (8, {"pseudograd", "stage", "upload", "allreduce", "d2h", "formed",
                              "staged", "commit", "outer", "stepped", "keep", "write"}),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("script", list(EXAMPLES))
def test_torchft_example_runs(script: str, tmp_path: Path) -> None:
    pytest.importorskip("torchft")
    steps, prefixes = EXAMPLES[script]
    trace = tmp_path / "sync.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), "--steps", str(steps),
         "--trace", str(trace)],
        capture_output=True, text=True, timeout=110, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "replica 1: final loss" in proc.stdout
    assert "device staging" in proc.stdout
    loaded = pipeoff.Trace.load(trace)
    summary = loaded.summary()
    assert summary.failed == 0 and summary.peak_device_staging_bytes <= 128 << 10
    assert {t.name.split(":")[0] for t in loaded.tasks} == prefixes
