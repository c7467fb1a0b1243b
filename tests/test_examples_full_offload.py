"""The full-offload example runs end to end and learns."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # runs an example script (subprocess)

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "full_offload.py"


def test_full_offload_example(tmp_path: Path) -> None:
    trace = tmp_path / "trace.json"
    out = subprocess.run([sys.executable, str(EXAMPLE), "--steps", "4", "--trace", str(trace)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    losses = [float(line.split()[-1]) for line in out.stdout.splitlines()
              if line.startswith("step ")]
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert "last gradient norm" in out.stdout
    assert "logged 4 steps' figures; the last: step 3, d2h_bytes" in out.stdout
    assert "host step: native" in out.stdout or "host step: torch:" in out.stdout
    assert "host staging" in out.stdout and "accumulate" in out.stdout
    names = {e["args"].get("pipeoff.task") for e in json.loads(trace.read_text())["traceEvents"]
             if e.get("ph") == "X"}
    assert {"norm", "step:0", "h2d:0"} <= names
