"""The rooms of the code and what each may touch (see docs/concepts.md, "How the code is
laid out"): checked by reading the sources, as tests/test_compat.py checks upstream
private names."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PIPEOFF = ROOT / "pipeoff"


def _sources() -> list[tuple[str, str]]:
    return sorted((p.relative_to(ROOT).as_posix(), p.read_text())
                  for p in PIPEOFF.rglob("*.py"))


def _code_lines(text: str) -> list[tuple[int, str]]:
    """Lines of code with comments and docstring prose taken out."""
    out = []
    doc = False
    for n, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        quotes = stripped.count('"""')
        if doc:
            doc = quotes % 2 == 0
            continue
        if stripped.startswith('"""'):
            doc = quotes == 1
            continue
        out.append((n, line.split("#", 1)[0]))
    return out


def _offenders(pattern: re.Pattern[str], *, only: tuple[str, ...] = ("pipeoff/",),
               skip: tuple[str, ...] = (), imports: bool = True) -> list[str]:
    """``path:line: code`` of each code line (of the files under ``only``, but not
    ``skip``) that ``pattern`` matches; ``imports=False`` ignores import lines."""
    out = []
    for rel, text in _sources():
        if not rel.startswith(only) or rel in skip or rel.startswith(
                tuple(s for s in skip if s.endswith("/"))):
            continue
        for n, code in _code_lines(text):
            if not imports and code.lstrip().startswith(("from ", "import ")):
                continue
            if pattern.search(code):
                out.append(f"{rel}:{n}: {code.strip()}")
    return out


def test_no_production_module_imports_pipeoff_testing() -> None:
    offenders = []
    for rel, text in _sources():
        if rel.startswith("pipeoff/testing/"):
            continue
        for node in ast.walk(ast.parse(text)):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module is not None:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            if any(n == "pipeoff.testing" or n.startswith("pipeoff.testing.") for n in names):
                offenders.append(f"{rel}:{node.lineno}")
    assert not offenders, offenders


# What only the runtime's own rooms (execution.py, executor/) and its front door
# (_lowlevel.py) may read of an execution.
_RUNTIME_PRIVATES = re.compile(
    r"\._run\b|\._backend\b|\._translate\b|\._finalize\(|\._shifted_trace\b|\._pending_names\b"
    r"|\bfrom_run\(")


_RUNTIME = ("pipeoff/execution.py", "pipeoff/_lowlevel.py", "pipeoff/sim/_backend.py")
"""The runtime's rooms besides executor/: the handle, its front door, and the
simulator's backend (an executor backend that lives with its cost model)."""
_FEATURES = ("pipeoff/optim/", "pipeoff/ft/", "pipeoff/transfer/")


def test_features_reach_the_runtime_through_its_front_door_only() -> None:
    offenders = _offenders(_RUNTIME_PRIVATES, skip=(*_RUNTIME, "pipeoff/executor/"),
                           imports=False)
    assert not offenders, "\n".join(offenders)


def test_features_import_no_private_module_of_the_core() -> None:
    """Features use the core's public names and its front door (``pipeoff._lowlevel``),
    never ``pipeoff.executor._x`` or ``pipeoff.trace._x``."""
    offenders = _offenders(re.compile(r"pipeoff\.(executor|trace)\._\w+"), only=_FEATURES)
    assert not offenders, "\n".join(offenders)


def test_no_feature_reads_an_optimizers_privates() -> None:
    """What StateTransfer and LocalSGD need of an optimizer is its typed contract
    (``pipeoff._contract``), not its fields (``opt._readers``)."""
    pattern = re.compile(r"\b(opt|optimizer|lt\.optimizer|_local_optimizer)\._[a-z]\w*")
    offenders = _offenders(pattern, skip=("pipeoff/_compat.py",))
    assert not offenders, "\n".join(offenders)


# Upstream private names that once bypassed _compat.py; each goes through a helper
# there now, with a PRIVATE_APIS row that tests/test_compat.py resolves.
_UPSTREAM_PRIVATES = re.compile(
    r"_patch_step_function|_optimizer_(step|state_dict|load_state_dict)_(pre|post)_hooks"
    r"|__wrapped__|\.hooked\b|_local_tensor|_orig_mod|_compiled_call_impl")


def test_upstream_private_names_go_through_compat() -> None:
    offenders = _offenders(_UPSTREAM_PRIVATES, skip=("pipeoff/_compat.py", "pipeoff/testing/"))
    assert not offenders, "\n".join(offenders)


def test_each_upstream_private_name_has_a_compat_row() -> None:
    from pipeoff import _compat

    paths = " ".join(api.path for api in _compat.PRIVATE_APIS)
    for name in ("_patch_step_function", "profile_hook_step", "_optimizer_step_pre_hooks",
                 "_optimizer_load_state_dict_post_hooks", "DTensor._local_tensor",
                 "OptimizedModule._orig_mod", "Module._compiled_call_impl"):
        assert name in paths, name
