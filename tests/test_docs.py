"""Every snippet in the docs and the README is checked.

- ```` ```python ```` blocks run. An HTML comment on the line before a fence,
  ``<!-- doc-test: slow, needs=lightning -->``, marks the block slow and skips it
  when the named package is not installed (the trainers are optional extras).
- ```` ```py ```` blocks are other tools' code, or pipeoff code that needs a
  cluster (``...`` where it would go): they must parse.
- ```` ```json ```` blocks (config files) must parse.
- ```` ```bash ```` blocks: every ``pipeoff ...`` line parses with the CLI's own
  parser, every ``./dev X`` names one of its commands, and every
  ``python benchmarks/X.py`` script exists.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
FENCE = re.compile(r"^(?:<!-- doc-test: (?P<tags>[^>]*?) -->\n)?```(?P<lang>[a-z]*)\n"
                   r"(?P<code>.*?)^```", re.S | re.M)


def blocks(lang: str) -> list[Any]:
    out = []
    for path in DOCS:
        for k, m in enumerate(FENCE.finditer(path.read_text())):
            if m.group("lang") != lang:
                continue
            tags = [t.strip() for t in (m.group("tags") or "").split(",") if t.strip()]
            marks = [pytest.mark.slow] if "slow" in tags else []
            needs = [t.split("=", 1)[1] for t in tags if t.startswith("needs=")]
            marks += [pytest.mark.skipif(importlib.util.find_spec(n) is None,
                                         reason=f"{n} is not installed") for n in needs]
            out.append(pytest.param(m.group("code"), id=f"{path.name}#{k}", marks=marks))
    return out


def test_every_fence_is_checked() -> None:
    """A block in another language would go unchecked: name it here first."""
    langs = {m.group("lang") for p in DOCS for m in FENCE.finditer(p.read_text())}
    assert langs <= {"python", "py", "json", "bash", "text", ""}, langs


@pytest.mark.parametrize("code", blocks("python"))
def test_doc_example_runs(code: str, request: pytest.FixtureRequest) -> None:
    where = request.node.callspec.id
    exec(compile(code, where, "exec"), {"__name__": f"doc_{where}"})


@pytest.mark.parametrize("code", blocks("py"))
def test_other_tools_code_parses(code: str) -> None:
    ast.parse(code)


@pytest.mark.parametrize("code", blocks("json"))
def test_config_files_parse(code: str) -> None:
    json.loads(code)


def _dev_commands() -> set[str]:
    text = (ROOT / "dev").read_text()
    return set(re.findall(r"^\s*([a-z][a-z-]*)\)", text, re.M))


@pytest.mark.parametrize("code", blocks("bash"))
def test_shell_commands_exist(code: str) -> None:
    from pipeoff.cli import _parser

    lines = code.replace("\\\n", " ").splitlines()
    for line in lines:
        words = shlex.split(line, comments=True)
        if not words:
            continue
        if words[0] == "pipeoff":
            _parser().parse_args(words[1:])
        elif words[0] == "./dev":
            assert words[1] in _dev_commands(), line
        for w in words:
            if w.startswith("benchmarks/") and w.endswith(".py"):
                assert (ROOT / w).is_file(), line
