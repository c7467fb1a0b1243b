"""The full-offload fraction example runs end to end: it learns, resumes at another
fraction, and ends bitwise equal to a run with everything offloaded."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # runs an example script (subprocess)

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "full_offload_fraction.py"


@pytest.mark.parametrize("clip", ["loop", "optimizer"])
def test_full_offload_fraction_example(clip: str) -> None:
    out = subprocess.run([sys.executable, str(EXAMPLE), "--steps", "4", "--resume-steps", "3",
                          "--fraction", "0.5", "--resume-fraction", "0.0", "--clip", clip],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    losses = [float(line.split()[-1]) for line in out.stdout.splitlines()
              if line.startswith("step ")]
    assert len(losses) == 7 and losses[-1] < losses[0]
    assert "offload_fraction=0.5: " in out.stdout and "KiB on the device" in out.stdout
    assert "resumed at offload_fraction=0.0: 0 KiB of masters" in out.stdout
    assert "bitwise equal to offload_fraction=1.0 over 7 steps: True" in out.stdout


def test_full_offload_fraction_example_auto() -> None:
    """``--fraction auto``: the optimizer chooses within half the state's bytes on the
    device (the CPU's default budget here) and still ends bitwise equal."""
    out = subprocess.run([sys.executable, str(EXAMPLE), "--steps", "2", "--resume-steps", "1",
                          "--fraction", "auto", "--resume-fraction", "0.0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "auto: offload_fraction=" in out.stdout and "(device_budget_bytes)" in out.stdout
    assert "bitwise equal to offload_fraction=1.0 over 3 steps: True" in out.stdout
