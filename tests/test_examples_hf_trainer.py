"""The HF Trainer example runs with each optimizer and matches plain AdamW."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytestmark = pytest.mark.slow  # runs an example script (subprocess, three Trainer runs)

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "hf_trainer.py"


def test_hf_trainer_example() -> None:
    out = subprocess.run([sys.executable, str(EXAMPLE), "--steps", "3"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    runs: dict[str, list[tuple[float, float]]] = {}
    name = ""
    for line in out.stdout.splitlines():
        if line.startswith("  step "):
            words = line.split()
            runs[name].append((float(words[3]), float(words[5])))  # loss, grad_norm
        elif not line.startswith(" ") and ":" not in line:
            name = line.strip()
            runs[name] = []
    assert list(runs) == ["AdamW", "OffloadOptimizer", "FullOffloadOptimizer"]
    assert all(len(steps) == 3 for steps in runs.values()), runs
    # The Trainer's clipping reached the gradients: the norms are real, not 0.
    assert all(norm > 1.0 for _, norm in runs["FullOffloadOptimizer"]), runs
    for name in ("OffloadOptimizer", "FullOffloadOptimizer"):
        assert runs[name] == runs["AdamW"], name
        assert (f"{name}: weights bitwise equal to AdamW's: True; "
                "logged loss and grad_norm equal: True") in out.stdout, out.stdout
