"""The native kernels' ctypes signatures agree with ``hoststep.c`` (issue 34).

ctypes binds whatever it is told: an argument added, dropped or moved in the C
source but not in ``pipeoff/_native/_signatures.py`` would pass a wrong number, or
crash. These tests read the source as text, so they run without a C compiler, and
show on altered copies that each kind of drift is named.
"""

from __future__ import annotations

import ctypes
import re

import pytest

from pipeoff import _native
from pipeoff._native._signatures import SIGNATURES, mismatches, prototypes

SOURCE = _native.SOURCE.read_text()

_FOLD_STEP_TAIL = "int tail_fma, int64_t vec, int nan_bf16, int threads) {"


def altered(old: str, new: str) -> str:
    """The C source with ``old`` (which occurs exactly once) replaced by ``new``."""
    assert SOURCE.count(old) == 1, old
    return SOURCE.replace(old, new)


def test_the_bound_signatures_are_the_c_definitions() -> None:
    problems = mismatches(SOURCE)
    assert not problems, "\n".join(problems)


def test_the_parser_reads_every_exported_definition() -> None:
    """Not vacuous: the big entry points are found with every argument, and the
    static helpers are not taken for exports."""
    found = prototypes(SOURCE)
    assert set(found) == set(SIGNATURES)
    assert len(found["pipeoff_adam_step"][1]) == 23
    assert len(found["pipeoff_adam_fold_step"][1]) == 24
    assert found["pipeoff_adam_fold_step"][1][2] == ("g16", ctypes.c_void_p)
    assert found["pipeoff_scale"] == (ctypes.c_int, (("a", ctypes.c_void_p),
                                                     ("n", ctypes.c_int64),
                                                     ("s", ctypes.c_float),
                                                     ("threads", ctypes.c_int)))


def test_the_abi_version_is_the_one_the_loader_expects() -> None:
    (version,) = re.findall(r"int pipeoff_abi_version\(void\) \{ return (\d+); \}", SOURCE)
    assert int(version) == _native.ABI_VERSION


def test_a_changed_argument_type_is_named() -> None:
    source = altered("float decay, float sign, float scale, float w1, float beta2,\n",
                     "double decay, float sign, float scale, float w1, float beta2,\n")
    assert mismatches(source) == [
        "pipeoff_adam_fold_step: argument 10 is decay (double) in C, decay (float) as bound"]


def test_a_dropped_argument_is_named() -> None:
    source = altered(_FOLD_STEP_TAIL, "int tail_fma, int64_t vec, int threads) {")
    problems = mismatches(source)
    assert problems[0] == "pipeoff_adam_fold_step: takes 23 arguments in C, 24 as bound"
    assert "pipeoff_adam_fold_step: argument 22 is threads (int) in C, nan_bf16 (int) " \
           "as bound" in problems
    assert problems[-1] == ("pipeoff_adam_fold_step: argument 23 is nothing in C, "
                            "threads (int) as bound")


def test_an_added_argument_is_named() -> None:
    source = altered("int pipeoff_scale(float *a, int64_t n, float s, int threads) {",
                     "int pipeoff_scale(float *a, int64_t n, float s, int threads, int k) {")
    assert mismatches(source) == [
        "pipeoff_scale: takes 5 arguments in C, 4 as bound",
        "pipeoff_scale: argument 4 is k (int) in C, nothing as bound"]


def test_two_reordered_arguments_of_one_type_are_named() -> None:
    """Types alone cannot see this swap (both float): the names do."""
    source = altered("int64_t n, int adam_wd, float wd, float decay, float sign, float scale,\n",
                     "int64_t n, int adam_wd, float decay, float wd, float sign, float scale,\n")
    assert mismatches(source) == [
        "pipeoff_adam_step: argument 8 is decay (float) in C, wd (float) as bound",
        "pipeoff_adam_step: argument 9 is wd (float) in C, decay (float) as bound"]


def test_two_reordered_arguments_of_two_types_are_named() -> None:
    source = altered("int pipeoff_fold(float *acc, const void *g, int kind, int64_t n,",
                     "int pipeoff_fold(float *acc, const void *g, int64_t n, int kind,")
    assert mismatches(source) == [
        "pipeoff_fold: argument 2 is n (int64_t) in C, kind (int) as bound",
        "pipeoff_fold: argument 3 is kind (int) in C, n (int64_t) as bound"]


def test_a_changed_return_type_is_named() -> None:
    source = altered("int pipeoff_adam_fast(void)", "int64_t pipeoff_adam_fast(void)")
    assert mismatches(source) == ["pipeoff_adam_fast: returns int64_t in C, int as bound"]


def test_a_function_on_one_side_only_is_named() -> None:
    added = SOURCE + "\nint pipeoff_new(float *a, int64_t n) { return 0; }\n"
    assert mismatches(added) == [
        "pipeoff_new: defined in the C source but not in the bound signatures"]
    hidden = altered("int pipeoff_adam_fast(void)", "static int pipeoff_adam_fast(void)")
    assert mismatches(hidden) == [
        "pipeoff_adam_fast: bound but not an exported definition in the C source"]


@pytest.mark.parametrize(("old", "new", "words"), [
    ("int64_t n, float s, int threads) {", "size_t n, float s, int threads) {",
     "argument 1 ('size_t n') has C type 'size_t'"),
    ("int64_t n, float s, int threads) {", "int64_t, float s, int threads) {",
     "argument 1 ('int64_t') has no name"),
])
def test_a_definition_the_parser_cannot_read_is_a_mismatch(old: str, new: str,
                                                           words: str) -> None:
    """A type the table cannot map is reported, never guessed."""
    (problem,) = mismatches(altered(old, new))
    assert problem.startswith("pipeoff_scale's ") and words in problem, problem


def test_a_drifted_table_is_named_against_the_real_source() -> None:
    """The other direction: the Python side edited, the C source not."""
    restype, args = SIGNATURES["pipeoff_fold"]
    drifted = {**SIGNATURES, "pipeoff_fold": (restype, args[:-1])}
    assert mismatches(SOURCE, drifted) == [
        "pipeoff_fold: takes 6 arguments in C, 5 as bound",
        "pipeoff_fold: argument 5 is threads (int) in C, nothing as bound"]


def test_comments_and_declarations_are_not_definitions() -> None:
    extra = ("/* int pipeoff_ghost(int x) { } */\n"
             "// int pipeoff_ghost2(int x) {\n"
             "int pipeoff_declared(int x);\n")
    assert mismatches(extra + SOURCE) == []
