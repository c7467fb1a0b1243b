"""The rooms of the code and what each may touch (see docs/concepts.md, "How the code is
laid out"): checked by reading the sources, as tests/test_compat.py checks upstream
private names. Room sizes (600 lines, 30 methods), one writer of full offload's
phase, no private attribute read by string, and a ``PRIVATE_APIS`` row for every
torchft private name pipeoff touches."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from pipeoff import _compat

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
# (_lowlevel/) may read of an execution.
_RUNTIME_PRIVATES = re.compile(
    r"\._run\b|\._backend\b|\._translate\b|\._finalize\(|\._shifted_trace\b|\._pending_names\b"
    r"|\bfrom_run\(")


_RUNTIME = ("pipeoff/execution.py", "pipeoff/_lowlevel/", "pipeoff/sim/_backend.py")
"""The runtime's rooms besides executor/: the handle, its front door, and the
simulator's backend (an executor backend that lives with its cost model)."""
_FEATURES = ("pipeoff/optim/", "pipeoff/ft/", "pipeoff/transfer/")


def test_features_reach_the_runtime_through_its_front_door_only() -> None:
    offenders = _offenders(_RUNTIME_PRIVATES, skip=(*_RUNTIME, "pipeoff/executor/"),
                           imports=False)
    assert not offenders, "\n".join(offenders)


def test_features_import_no_private_module_of_the_core() -> None:
    """Features use the core's public names and its front door (``pipeoff._lowlevel``),
    never ``pipeoff.executor._x``, ``pipeoff.trace._x`` or ``pipeoff.recording._x``."""
    offenders = _offenders(re.compile(r"pipeoff\.(executor|trace|recording)\._\w+"),
                           only=_FEATURES)
    assert not offenders, "\n".join(offenders)


def test_features_reach_the_instruments_through_the_front_door() -> None:
    """The recorder, the train spans and the step figures are the features' through
    ``pipeoff._lowlevel`` only: one front door, not two."""
    offenders = _offenders(re.compile(r"\bpipeoff\.recording\b|from pipeoff import recording"
                                      r"|trace\.lowlevel|trace import lowlevel"),
                           only=_FEATURES)
    assert not offenders, "\n".join(offenders)


def test_trace_values_import_no_instrument() -> None:
    """``pipeoff/trace/`` holds values; the instruments (``pipeoff/recording/``) import
    them, never the other way (its ``__init__`` loads the re-exported recorder on
    first use, inside a function)."""
    offenders = []
    for rel, text in _sources():
        if not rel.startswith("pipeoff/trace/"):
            continue
        for node in ast.parse(text).body:  # module level only: lazy imports are allowed
            if isinstance(node, ast.ImportFrom) and node.module is not None and (
                    node.module.startswith("pipeoff.recording")
                    or node.module in ("pipeoff._lowlevel", "pipeoff.executor")
                    or node.module.startswith("pipeoff.executor.")):
                offenders.append(f"{rel}:{node.lineno}")
    assert not offenders, offenders


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


MAX_LINES = 600
MAX_METHODS = 30


def _modules() -> list[tuple[str, ast.Module, str]]:
    """Every module of ``pipeoff/``: its path, its tree and its text."""
    out = []
    for path in sorted(PIPEOFF.rglob("*.py")):
        text = path.read_text()
        out.append((path.relative_to(ROOT).as_posix(), ast.parse(text), text))
    return out


MODULES = _modules()


def test_room_sizes() -> None:
    """No module in ``pipeoff/`` over 600 lines, no class over 30 methods (the guard
    against the next 1,100-line feature commit)."""
    big = [f"{rel}: {text.count(chr(10))} lines" for rel, _, text in MODULES
           if text.count("\n") > MAX_LINES]
    wide = []
    for rel, tree, _ in MODULES:
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                n = sum(isinstance(x, (ast.FunctionDef, ast.AsyncFunctionDef)) for x in node.body)
                if n > MAX_METHODS:
                    wide.append(f"{rel}: class {node.name} has {n} methods")
    assert not big + wide, "\n".join(big + wide)


def test_the_phase_of_an_accumulation_is_written_in_one_place() -> None:
    """Full offload's ``.phase`` changes only through ``Accumulation.move``, which checks
    the transition table."""
    writes = []
    for rel, tree, _ in MODULES:
        for node in ast.walk(tree):
            targets = (node.targets if isinstance(node, ast.Assign) else
                       [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
            for t in targets:
                if isinstance(t, ast.Attribute) and t.attr == "phase":
                    writes.append(f"{rel}:{node.lineno}")
    assert writes == ["pipeoff/optim/_full_offload/_common.py:" + str(_move_line())], writes


def _move_line() -> int:
    rel = "pipeoff/optim/_full_offload/_common.py"
    tree = next(t for r, t, _ in MODULES if r == rel)
    move = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "move")
    return next(n.lineno for n in ast.walk(move) if isinstance(n, ast.Assign))


def test_every_phase_is_read() -> None:
    """Every member of ``Phase`` is read somewhere (the table reads the ends)."""
    from pipeoff.optim._full_offload._common import Phase

    reads = {node.attr for _, tree, _ in MODULES for node in ast.walk(tree)
             if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
             and node.value.id == "Phase" and isinstance(node.ctx, ast.Load)}
    assert {p.name for p in Phase} <= reads, {p.name for p in Phase} - reads


FEATURES = ("pipeoff/optim/", "pipeoff/ft/", "pipeoff/transfer/", "pipeoff/trace/",
            "pipeoff/integrations/")


def test_no_feature_module_reads_another_objects_private_attribute_by_string() -> None:
    """``getattr(obj, "_name")`` hides a reach into another object's privates from
    grep and from mypy: use a typed protocol (``_contract.py``) instead. An object's
    own attributes (``getattr(self, ...)``, while it is being built) are its business."""
    found = []
    for rel, tree, _ in MODULES:
        if not rel.startswith(FEATURES):
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) >= 2
                    and isinstance(node.args[1], ast.Constant)
                    and isinstance(node.args[1].value, str)
                    and node.args[1].value.startswith("_")
                    and not node.args[1].value.startswith("__")
                    and not (isinstance(node.args[0], ast.Name) and node.args[0].id == "self")):
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "\n".join(found)


def _torchft_privates() -> dict[str, set[str]]:
    """Per private name torchft's classes that pipeoff uses define (attributes their
    methods set, methods), the ``module:Class`` paths that define it."""
    lsgd = pytest.importorskip("torchft.local_sgd")
    manager = pytest.importorskip("torchft.manager")
    classes = {"torchft.local_sgd:DiLoCo": lsgd.DiLoCo,
               "torchft.local_sgd:LocalSGD": lsgd.LocalSGD,
               "torchft.local_sgd:_StreamingDiLoCoFragment": lsgd._StreamingDiLoCoFragment,
               "torchft.manager:Manager": manager.Manager}
    out: dict[str, set[str]] = {}
    for path, cls in classes.items():
        names = set(vars(cls))
        for f in vars(cls).values():
            code = getattr(f, "__code__", None)
            if code is not None:
                names.update(code.co_names)
        for name in names:
            if name.startswith("_") and not name.startswith("__"):
                out.setdefault(name, set()).add(path)
    return out


def test_every_torchft_private_name_has_a_private_apis_row() -> None:
    """A private name of torchft's that ``pipeoff/`` reads, writes or overrides (or
    imports) is listed in ``_compat.PRIVATE_APIS``: a torchft release that renames it
    fails ``tests/test_compat.py`` naming it, instead of a sync failing mid-run."""
    privates = _torchft_privates()
    rows = {api.path.rsplit(":", 1)[-1].rsplit(".", 1)[-1]
            for api in _compat.PRIVATE_APIS if api.package == "torchft"}
    missing = set()
    for rel, tree, _ in MODULES:
        for node in ast.walk(tree):
            if not rel.startswith(("pipeoff/ft/", "pipeoff/_compat.py")):
                continue  # (the rooms that touch torchft objects)
            if isinstance(node, ast.Attribute) and node.attr in privates:
                name = node.attr
            elif isinstance(node, ast.FunctionDef) and node.name in privates and rel.startswith(
                    "pipeoff/ft/"):
                name = node.name  # an override of torchft's method
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torchft"):
                for alias in node.names:
                    if alias.name.startswith("_") and alias.name not in rows:
                        missing.add(f"{rel}:{node.lineno}: import {alias.name}")
                continue
            else:
                continue
            if name not in rows:
                missing.add(f"{rel}:{node.lineno}: {name} ({', '.join(sorted(privates[name]))})")
    assert not missing, "\n".join(sorted(missing))


_LANE_STORES = {"res", "shipped.tensor", "rec.scalars", "rec.present", "rec.stepped",
                "rec.version"}
"""What full offload's lanes may store (``[Note: lane writes]``): the accumulation's
``LaneResults`` (``res``), the listed ``OffloadedParam`` fields, ``Shipped.tensor``."""


def test_full_offload_lanes_write_only_their_results_and_the_listed_fields() -> None:
    """Lane work returns what it computed in ``LaneResults`` and writes nothing of the
    caller's records: every attribute store (and every mutating call on an attribute)
    in ``_lanes.py`` outside ``__init__`` is one of the listed ones."""
    rel = "pipeoff/optim/_full_offload/_lanes.py"
    tree = next(t for r, t, _ in MODULES if r == rel)
    mutators = {"add", "append", "update", "pop", "clear", "setdefault", "discard",
                "remove", "extend"}
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef) or fn.name in ("__init__", "for_params"):
            continue
        for node in ast.walk(fn):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = list(node.targets)
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in mutators
                    and isinstance(node.func.value, ast.Attribute)):
                targets = [node.func.value]
            for target in targets:
                if isinstance(target, ast.Subscript):
                    target = target.value
                if not isinstance(target, ast.Attribute):
                    continue
                name = ast.unparse(target)
                if name.split(".", 1)[0] != "res" and name not in _LANE_STORES:
                    found.append(f"{rel}:{node.lineno} ({fn.name}): {name}")
    assert not found, "\n".join(found)


def _defined(name: str) -> list[str]:
    """``path:line`` of each module-level definition of ``name`` in ``pipeoff/``."""
    out = []
    for rel, text in _sources():
        for node in ast.parse(text).body:
            targets: list[str] = []
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                targets = [node.name]
            elif isinstance(node, ast.Assign):
                targets = [t.id for t in node.targets if isinstance(t, ast.Name)]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                targets = [node.target.id]
            if name in targets:
                out.append(f"{rel}:{node.lineno}")
    return out


def test_one_definition_of_elementwise_and_of_the_local_shard() -> None:
    """One set of element-wise optimizers (DiLoCo's host outer optimizers are a named
    subset of it) and one local-shard helper, where the meanings agree."""
    assert [d.split(":")[0] for d in _defined("ELEMENTWISE")] == ["pipeoff/optim/_update.py"]
    assert [d.split(":")[0] for d in _defined("local_tensor")] == ["pipeoff/_compat.py"]
    assert _defined("local") == []
    from pipeoff.ft._outer import HOST_OUTER_OPTIMIZERS
    from pipeoff.optim import ELEMENTWISE

    assert set(HOST_OUTER_OPTIMIZERS) <= set(ELEMENTWISE)


def test_optim_shows_its_two_optimizers() -> None:
    """Each optimizer's parts are in its own folder; what sits directly in ``optim/``
    is the two public modules and what both share (imported from both folders'
    sides, or by another feature)."""
    top = sorted(p.name for p in (PIPEOFF / "optim").glob("*.py"))
    assert top == ["__init__.py", "_foreign.py", "_hooks.py", "_offloaded.py", "_plan.py",
                   "_readers.py", "_tensors.py", "_update.py", "_waits.py",
                   "full_offload.py", "offload.py"], top
    assert (PIPEOFF / "optim" / "_offload").is_dir()
    assert (PIPEOFF / "optim" / "_full_offload").is_dir()


def test_full_offload_parts_hold_no_method_of_their_optimizer() -> None:
    # Parts call down, never back up into their owner: no part of a
    # FullOffloadOptimizer holds the optimizer or one of its bound methods (the
    # model sync once called the optimizer's wait_for_step). The forward waits'
    # on_failure is the one call up, and it only raises the step's failure.
    import torch

    from pipeoff.optim import FullOffloadOptimizer

    model = torch.nn.Linear(4, 4)
    opt = FullOffloadOptimizer(model, torch.optim.AdamW)
    allowed = {("ForwardWaits", "_on_failure")}
    seen: set[int] = set()

    def walk(obj: object, depth: int) -> None:
        if id(obj) in seen or depth > 3 or not type(obj).__module__.startswith("pipeoff."):
            return
        seen.add(id(obj))
        for name, value in vars(obj).items() if hasattr(obj, "__dict__") else ():
            owner = getattr(value, "__self__", None)
            if (value is opt or owner is opt) and (type(obj).__name__, name) not in allowed:
                raise AssertionError(f"{type(obj).__name__}.{name} calls up into the optimizer")
            walk(value, depth + 1)

    for name in ("_registry", "_lifecycle", "_model_sync", "_intake", "_traces", "_waits"):
        walk(getattr(opt, name), 0)


def test_full_offload_task_gate_and_buffer_names_are_spelled_in_its_graph_module() -> None:
    # A name re-spelled elsewhere drifts silently: a lane asking for a buffer the
    # graph no longer declares, a gate opened that no task waits on.
    literal = re.compile(r"""f?["'](?:grad|step|h2d|d2h|acc|slot|w):|"""
                         r"""\.(?:gate|buffer|events_for|add_task|add_buffer)\(\s*f?["']""")
    assert _offenders(literal, only=("pipeoff/optim/_full_offload/",),
                      skip=("pipeoff/optim/_full_offload/_graph.py",)) == []
