"""Checks of user-facing arguments that many modules share, with one wording."""

from __future__ import annotations

import re
from typing import Any

from pipeoff._errors import ConfigError

__all__ = ["check_bool", "check_bytes", "check_int", "check_process_group", "parse_bytes",
           "short_repr"]


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is ``True`` or ``False``.

    Raises:
        ConfigError: anything else (``"no"``, ``1``), naming ``name``.
    """
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False, got {value!r}")
    return value


def check_int(name: str, value: Any, *, minimum: int = 1, optional: bool = False,
              unit: str = "", also: str = "", as_bound: bool = False) -> Any:
    """``value`` if it is an int (not a bool) of at least ``minimum``, or ``None`` when
    ``optional``; otherwise a :class:`ConfigError` naming ``name``.

    The message says "a positive int" for ``minimum=1`` (unless ``as_bound``),
    else "an int >= minimum", then ``(unit)``, "or None" and ``also`` (other
    accepted values), and the value given.

    Raises:
        ConfigError: ``value`` is not accepted.
    """
    if optional and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "a positive int" if minimum == 1 and not as_bound else f"an int >= {minimum}"
        parts = [f"{name} must be {kind}"]
        if unit:
            parts.append(f"({unit})")
        if optional:
            parts.append("or None")
        if also:
            parts.append(also)
        raise ConfigError(f"{' '.join(parts)}, got {value!r}")
    return value


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
"""SI units are powers of ten (``"1GB"`` is 10**9 bytes), IEC units powers of two
(``"1GiB"`` is 2**30), as PyTorch's and the HF Hub's tools spell them."""


def parse_bytes(text: Any, *, name: str = "size") -> int:
    """A byte size: an int, or a string as config files write one (``"4096"``,
    ``"256MiB"``, ``"1GB"``, ``"2e9"``; units ``B``, ``KB``/``MB``/``GB``/``TB`` in
    powers of ten, ``KiB``/``MiB``/``GiB``/``TiB`` in powers of two, any case).
    Returns the number of bytes (rounded down to an int).

    Raises:
        ConfigError: not a size of at least one byte, naming ``name``.
    """
    if isinstance(value := text, int) and not isinstance(value, bool):
        number, unit = float(value), ""
    elif isinstance(text, str) and (
            m := re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", text)):
        number, unit = float(m.group(1)), m.group(2).lower()
    else:
        raise ConfigError(f"{name} must be a positive int (bytes) or a size string such "
                          f"as '256MiB' or '1GB', got {text!r}")
    if unit not in _UNITS:
        raise ConfigError(f"{name}: unknown unit in {text!r}; use B, KB, MB, GB "
                          "(powers of 10) or KiB, MiB, GiB (powers of 2)")
    value = number * _UNITS[unit]
    if not value < 2**62:
        raise ConfigError(f"{name} is too large: {text!r}")
    if value < 1:
        raise ConfigError(f"{name} must be a positive int (bytes) or a size string such "
                          f"as '256MiB' or '1GB', got {text!r} (less than 1 byte)")
    return int(value)


def check_bytes(name: str, value: Any, *, optional: bool = False) -> int | None:
    """:func:`parse_bytes` of a user-facing argument ``name``; ``None`` passes when
    ``optional``.

    Raises:
        ConfigError: ``value`` is not a byte size (the message names ``name``).
    """
    if optional and value is None:
        return None
    return parse_bytes(value, name=name)


def check_process_group(value: Any, name: str = "process_group") -> Any:
    """``value`` if it is ``None`` or a ``torch.distributed.ProcessGroup`` (of an
    initialized ``torch.distributed``).

    Raises:
        ConfigError: anything else, naming ``name``.
    """
    if value is None:
        return None
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError(f"{name} was given, but torch.distributed is not initialized")
    if not isinstance(value, dist.ProcessGroup):
        raise ConfigError(f"{name} must be a torch.distributed.ProcessGroup (such as "
                          f"dist.group.WORLD or a DeviceMesh's get_group()) or None, got "
                          f"{short_repr(value)}")
    return value


def short_repr(value: Any, limit: int = 120) -> str:
    """``repr(value)`` cut to ``limit`` characters, for error messages (a param group's
    repr lists every tensor: thousands of characters)."""
    text = repr(value)
    if len(text) <= limit:
        return text
    close = text[-1] if text[-1] in ")]}>" else ""
    return f"{text[:limit - 5]} ...{close} ({type(value).__name__})"
