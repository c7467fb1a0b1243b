"""The weight-broadcast example runs in two processes and its rollout weights are exact."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # runs an example script (subprocess)

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "weight_broadcast.py"


def test_weight_broadcast_example() -> None:
    out = subprocess.run([sys.executable, str(EXAMPLE), "--steps", "3", "--budget", "512"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    steps = [line for line in out.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 3
    assert all(line.endswith("rollout weights == masters in BF16: True") for line in steps)
    # The rollout model generates with the weights the step just made: its loss is the
    # trainer's loss one step later.
    train = [float(line.split("train loss ")[1].split(",")[0]) for line in steps]
    rollout = [float(line.split("rollout loss ")[1].split(",")[0]) for line in steps]
    assert rollout[:-1] == train[1:]
    last = next(line for line in out.stdout.splitlines() if line.startswith("last transfer"))
    peak = int(last.split("peak host staging ")[1].split()[0])
    assert 0 < peak <= 512
