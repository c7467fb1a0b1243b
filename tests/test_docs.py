"""Every python example in the docs and the README runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def blocks() -> list[tuple[str, str]]:
    out = []
    for path in DOCS:
        for k, m in enumerate(FENCE.finditer(path.read_text())):
            out.append((f"{path.name}#{k}", m.group(1)))
    return out


@pytest.mark.parametrize(("where", "code"), blocks(), ids=[w for w, _ in blocks()])
def test_doc_example_runs(where: str, code: str) -> None:
    exec(compile(code, where, "exec"), {"__name__": f"doc_{where}"})
