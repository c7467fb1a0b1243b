"""Private APIs of torch, FSDP2 and torchft: each resolves in the installed versions,
the tested versions match pyproject.toml, and pipeoff's modules import no circle."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import tomllib

from pipeoff import _compat

ROOT = Path(__file__).resolve().parents[1]


def test_every_private_api_resolves_in_the_installed_versions() -> None:
    problems = _compat.check_private_apis()
    assert not problems, "\n".join(problems)


def test_a_moved_private_api_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    moved = _compat.PrivateAPI("torch", "torch._C:_no_such_function", "a test")
    monkeypatch.setattr(_compat, "PRIVATE_APIS", (*_compat.PRIVATE_APIS, moved))
    (problem,) = _compat.check_private_apis("torch")
    assert "torch._C:_no_such_function (used for a test) is gone in torch" in problem
    assert "tested 2.9 to 2.13" in problem


def test_pyproject_bounds_are_the_tested_versions() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = [*project["dependencies"], *project["optional-dependencies"]["ft"],
             *project["optional-dependencies"]["test"]]
    for package, (lo, hi) in _compat.TESTED.items():
        mine = [s for s in specs if re.match(rf"{package}\b", s)]
        assert mine, package
        for spec in mine:
            assert f">={lo}" in spec, spec
            major, minor = (int(x) for x in hi.split("."))
            assert f"<{major}.{minor + 1}" in spec, f"{spec}: upper bound should admit {hi} only"


def test_every_private_name_in_pipeoff_goes_through_compat() -> None:
    """Private attributes of torch and torchft are named only in _compat.py (and in the
    simulated device of pipeoff.testing, whose imports are listed there too)."""
    pattern = re.compile(r"torch(\.[a-z_]+)*\._[a-z]\w*|\._(get_fsdp_state|fsdp_param_groups|"
                         r"states_to_forward_prefetch|comm_ctx|pg)\b")
    offenders = []
    for path in (ROOT / "pipeoff").rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        if rel in ("pipeoff/_compat.py",) or rel.startswith("pipeoff/testing/"):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if "``" in code or code.strip().startswith(('"', "'")):
                continue  # prose in docstrings
            if pattern.search(code):
                offenders.append(f"{rel}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def _module_graph() -> dict[str, set[str]]:
    """pipeoff's modules and the pipeoff modules each imports at run time (module
    level or inside functions; not under TYPE_CHECKING)."""
    mods = {}
    for p in (ROOT / "pipeoff").rglob("*.py"):
        name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = p
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        out: set[str] = set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]

        def visit(nodes: list[ast.stmt], out: set[str] = out, package: str = package) -> None:
            for node in nodes:
                if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                    continue
                if isinstance(node, ast.Import):
                    out.update(a.name for a in node.names if a.name.startswith("pipeoff"))
                elif isinstance(node, ast.ImportFrom):
                    base = node.module or ""
                    if node.level:
                        parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                        base = ".".join([*parts, base] if base else parts)
                    if base.startswith("pipeoff"):
                        for a in node.names:
                            full = f"{base}.{a.name}"
                            out.add(full if full in mods else base)
                for field in ("body", "orelse", "finalbody", "handlers"):
                    child = getattr(node, field, None)
                    if isinstance(child, list):
                        visit(child)  # type: ignore[arg-type]

        visit(ast.parse(path.read_text()).body)
        graph[name] = {m for m in out if m in mods and m != name}
    return graph


def test_no_import_circles_among_pipeoff_modules() -> None:
    graph = _module_graph()
    # Depth-first search for a back edge; the cycle it closes is printed.
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state:
                found = dfs(d)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            cycle = dfs(m)
            assert cycle is None, "import circle: " + " -> ".join(cycle)
