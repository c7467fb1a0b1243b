"""The torchtitan container example runs, and pipeoff's containers match torchtitan's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan.components.optimizer")
pytestmark = pytest.mark.slow  # runs an example script (subprocess, three training runs)

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "torchtitan_container.py"
RUNS = ["torchtitan", "OffloadOptimizer", "FullOffloadOptimizer"]


def test_torchtitan_container_example() -> None:
    out = subprocess.run([sys.executable, str(EXAMPLE), "--steps", "4"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert not out.stderr.strip(), out.stderr[-3000:]  # quiet: no warnings, no logs
    runs: dict[str, list[tuple[float, float]]] = {}
    name = ""
    for line in out.stdout.splitlines():
        if line.startswith("  step "):
            words = line.split()
            runs[name].append((float(words[3]), float(words[5])))  # loss, grad_norm
        elif line.endswith(" per model part"):
            name = line.split(":")[0]
            runs[name] = []
    assert list(runs) == RUNS, out.stdout
    assert all(len(steps) == 4 for steps in runs.values()), runs
    # torchtitan's clip_grad_norm_ saw the gradients (under full offload too) and clipped.
    assert all(norm > 0.5 for _, norm in runs["FullOffloadOptimizer"]), runs
    assert runs["torchtitan"][-1][0] < runs["torchtitan"][0][0]  # it learns
    for name in RUNS[1:]:
        assert runs[name] == runs["torchtitan"], name
        assert (f"{name}: weights bitwise torchtitan's: True; checkpoint (210 keys) "
                "equal to torchtitan's: True") in out.stdout, out.stdout
