"""The FSDP2 overlap-optimizer example runs end to end (two gloo processes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # runs an example script (subprocess)

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fsdp2_overlap_optimizer.py"


def test_fsdp2_overlap_optimizer_example() -> None:
    out = subprocess.run([sys.executable, str(EXAMPLE), "--steps", "3"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    losses = [float(line.split()[-1]) for line in out.stdout.splitlines()
              if line.startswith("step ")]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert "chunks per step" in out.stdout
    assert "device staging" in out.stdout
    assert "forward-hook waits" in out.stdout
