"""Checks of user-facing arguments that many modules share, with one wording."""

from __future__ import annotations

from typing import Any

from pipeoff._errors import ConfigError

__all__ = ["check_int"]


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
