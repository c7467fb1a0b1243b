"""The native kernels' ctypes signatures, declared once, and their check against the C source.

``ctypes`` trusts whatever ``argtypes`` it is given: an argument added, dropped or
moved in ``hoststep.c`` but not here still loads and calls, and passes a wrong
number (or a pointer where an integer was, a crash). :data:`SIGNATURES` is the
one table that :func:`pipeoff._native.library` binds, and :func:`mismatches`
reads the C definitions as text (no compiler needed) and names every
difference in count, order, name or type; ``tests/test_native_signatures.py``
runs it against the shipped source.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Mapping
from typing import Any, TypeAlias

__all__ = ["C_TYPES", "SIGNATURES", "CType", "Signature", "mismatches", "prototypes"]

CType: TypeAlias = "type[ctypes._SimpleCData[Any]]"
Signature: TypeAlias = "tuple[CType | None, tuple[tuple[str, CType], ...]]"
"""A function's return type (``None`` for ``void``) and its (name, type) arguments in order."""

_I, _L, _F, _P = ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p

# The scalars after the tensors, in the order both Adam entry points take them (and
# HostKernel.adam_step passes them, as one tuple).
_ADAM_SCALARS: tuple[tuple[str, CType], ...] = (
    ("out_kind", _I), ("n", _L), ("adam_wd", _I), ("wd", _F), ("decay", _F), ("sign", _F),
    ("scale", _F), ("w1", _F), ("beta2", _F), ("c2", _F), ("bc2_sqrt", _F), ("eps", _F),
    ("step_size", _F), ("fma", _I), ("tail_fma", _I), ("vec", _L), ("nan_bf16", _I),
    ("threads", _I),
)

SIGNATURES: Mapping[str, Signature] = {
    "pipeoff_adam_step": (_I, (("p", _P), ("g", _P), ("m", _P), ("v", _P), ("out", _P),
                               *_ADAM_SCALARS)),
    "pipeoff_adam_fold_step": (_I, (("p", _P), ("g", _P), ("g16", _P), ("m", _P), ("v", _P),
                                    ("out", _P), *_ADAM_SCALARS)),
    "pipeoff_adam_step_norm": (_I, (("p", _P), ("g", _P), ("g16", _P), ("m", _P), ("v", _P),
                                    ("out", _P), *_ADAM_SCALARS, ("sumsq", _P))),
    "pipeoff_adam_fast": (_I, ()),
    "pipeoff_sgd_step": (_I, (("p", _P), ("buf", _P), ("g", _P), ("n", _L), ("sign", _F),
                              ("wd", _F), ("momentum", _F), ("c", _F), ("neg_lr", _F),
                              ("has_wd", _I), ("mode", _I), ("nesterov", _I), ("fma", _I),
                              ("threads", _I))),
    "pipeoff_adam_moments": (_I, (("m", _P), ("v", _P), ("g", _P), ("p", _P), ("n", _L),
                                  ("maximize", _I), ("adam_wd", _I), ("wd", _F), ("w", _F),
                                  ("beta2", _F), ("c2", _F), ("fma", _I), ("threads", _I))),
    "pipeoff_adam_apply": (_I, (("p", _P), ("m", _P), ("s", _P), ("n", _L), ("has_decay", _I),
                                ("decay", _F), ("bc2_sqrt", _F), ("eps", _F),
                                ("neg_step_size", _F), ("threads", _I))),
    "pipeoff_fold": (_I, (("acc", _P), ("g", _P), ("kind", _I), ("n", _L), ("first", _I),
                          ("threads", _I))),
    "pipeoff_fold_norm": (_I, (("acc", _P), ("g", _P), ("kind", _I), ("n", _L), ("first", _I),
                               ("threads", _I), ("lanes", _P), ("offset", _L), ("total", _L),
                               ("tail_fma", _I), ("norm", _P))),
    "pipeoff_scale": (_I, (("a", _P), ("n", _L), ("s", _F), ("threads", _I))),
    "pipeoff_abi_version": (_I, ()),
}
"""Every function ``hoststep.c`` exports, by name: what ``ctypes`` binds."""

C_TYPES: Mapping[str, CType] = {
    "int": _I, "int64_t": _L, "float": _F, "double": ctypes.c_double,
}
"""The C scalar types the check knows; any pointer is ``c_void_p`` (the callers pass
``data_ptr()`` or ``None``). Another type is reported, never guessed."""

_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)
# A definition of an exported name: the words before it (its return type, and
# `static` if it is not exported) cannot hold ; { } ( ) or #, so they never reach
# back into the statement, function or directive before it.
_DEFINITION = re.compile(r"^(?P<head>[^;{}()#]*?)\b(?P<name>pipeoff_\w+)\s*"
                         r"\((?P<params>[^()]*)\)\s*\{", re.M)
_QUALIFIERS = frozenset({"const", "restrict", "__restrict", "__restrict__", "volatile",
                         "extern", "inline"})


def _ctype(decl: list[str], what: str) -> CType | None:
    """The ctypes type of C type tokens (``None`` for ``void``); ``ValueError`` naming
    ``what`` for a type :data:`C_TYPES` does not hold."""
    words = [t for t in decl if t != "*" and t not in _QUALIFIERS]
    if words and "*" in decl:
        return _P
    if words == ["void"]:
        return None
    found = C_TYPES.get(" ".join(words))
    if found is None:
        raise ValueError(f"{what} has C type {' '.join(decl) or '(none)'!r}, which the "
                         f"check does not map to ctypes (it knows {', '.join(C_TYPES)} and "
                         "pointers)")
    return found


def prototypes(source: str) -> dict[str, Signature]:
    """The exported (not ``static``) ``pipeoff_*`` definitions in C ``source``, as
    :data:`SIGNATURES` writes them. Raises ``ValueError`` for a type it cannot map or
    an argument without a name."""
    found: dict[str, Signature] = {}
    text = re.sub(r'extern\s*"C"', "", _COMMENT.sub(" ", source))
    for match in _DEFINITION.finditer(text):
        name, head = match["name"], re.findall(r"\w+|\*", match["head"])
        if "static" in head:
            continue  # not exported, so not bound
        restype = _ctype(head, f"{name}'s return")
        args: list[tuple[str, CType]] = []
        params = match["params"].strip()
        for i, param in enumerate(params.split(",") if params not in ("", "void") else ()):
            tokens = re.findall(r"\w+|\*", param)
            what = f"{name}'s argument {i} ({param.strip()!r})"
            if len(tokens) < 2 or tokens[-1] == "*" or tokens[-1] in C_TYPES \
                    or tokens[-1] in _QUALIFIERS:
                raise ValueError(f"{what} has no name")
            argtype = _ctype(tokens[:-1], what)
            if argtype is None:
                raise ValueError(f"{what} is void")
            args.append((tokens[-1], argtype))
        found[name] = (restype, tuple(args))
    return found


def _type_name(t: CType | None) -> str:
    """``t`` in C's words (``c_int64`` is ``c_long`` on one platform, ``c_longlong`` on
    another: the message should not depend on it)."""
    if t is None:
        return "void"
    if t is _P:
        return "a pointer"
    return next((c for c, mine in C_TYPES.items() if mine is t), t.__name__)


def _show(arg: tuple[str, CType] | None) -> str:
    return "nothing" if arg is None else f"{arg[0]} ({_type_name(arg[1])})"


def mismatches(source: str, signatures: Mapping[str, Signature] = SIGNATURES) -> list[str]:
    """Every difference between the C ``source``'s exported definitions and
    ``signatures``, one line each (empty when they agree): a function on one side
    only, another return type, another argument count, and each position whose
    name or type differs. A definition the parser cannot read is one line too."""
    try:
        c = prototypes(source)
    except ValueError as err:
        return [str(err)]
    problems = [f"{n}: defined in the C source but not in the bound signatures"
                for n in c if n not in signatures]
    problems += [f"{n}: bound but not an exported definition in the C source"
                 for n in signatures if n not in c]
    for name, (restype, args) in signatures.items():
        if name not in c:
            continue
        c_restype, c_args = c[name]
        if c_restype is not restype:
            problems.append(f"{name}: returns {_type_name(c_restype)} in C, "
                            f"{_type_name(restype)} as bound")
        if len(c_args) != len(args):
            problems.append(f"{name}: takes {len(c_args)} arguments in C, "
                            f"{len(args)} as bound")
        for i in range(max(len(c_args), len(args))):
            mine = args[i] if i < len(args) else None
            theirs = c_args[i] if i < len(c_args) else None
            if mine != theirs:
                problems.append(f"{name}: argument {i} is {_show(theirs)} in C, "
                                f"{_show(mine)} as bound")
    return problems
