"""The mutants cannot go stale in silence: each edit applies exactly once and compiles,
its tests exist, and every mutation switch's call site has its mutant.

(Fast, runs in CI. The harness itself, ``python -m tests.mutation.run``, runs on demand.)
"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from pipeoff import _faults
from tests.mutation.mutants import MUTANTS, Mutant
from tests.mutation.run import ROOT, missing_test, mutated, select, stale_reason

_SITE = re.compile(r'_faults\.disabled\("(\w+)"\)')


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_each_mutant_applies_once_and_its_tests_exist(mutant: Mutant) -> None:
    assert stale_reason(mutant) is None, f"{mutant.name}: {stale_reason(mutant)}"
    for test in mutant.tests:
        assert missing_test(test) is None, (mutant.name, test)
    if mutant.file.endswith(".py"):
        compile(mutated(mutant), mutant.file, "exec")  # a mutant is an edit, not a typo


def test_names_are_unique_and_select_themselves() -> None:
    names = [m.name for m in MUTANTS]
    assert len(names) == len(set(names))
    for m in MUTANTS:
        assert select(MUTANTS, [m.name]) == [m]


def test_every_switch_site_has_its_mutant() -> None:
    """A new ``_faults.disabled(NAME)`` call site lands with a mutant of that site."""
    sites = {(path.relative_to(ROOT).as_posix(), name)
             for path in (ROOT / "pipeoff").rglob("*.py") if path.name != "_faults.py"
             for name in _SITE.findall(path.read_text())}
    covered = {(m.file, name) for m in MUTANTS for name in _SITE.findall(m.old)}
    assert sites - covered == set(), "switch call sites without a mutant"
    assert covered - sites == set(), "mutants of switch call sites that are gone"
    assert {name for _, name in sites} == set(_faults.MUTATIONS)


def test_stale_text_and_missing_tests_are_reported() -> None:
    m = MUTANTS[0]
    assert "occurs 0 times" in (stale_reason(replace(m, old="no such text here")) or "")
    assert "does not exist" in (stale_reason(replace(m, tests=("tests/gone.py",))) or "")
    gone = replace(m, tests=("tests/test_cuda.py::test_not_there[simulated]",))
    assert "not defined" in (stale_reason(gone) or "")
