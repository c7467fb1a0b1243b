"""What a pipeoff hook on a user's module becomes when the module is copied.

A forward hook that pipeoff puts on a model belongs to one optimizer or
recorder. A model pickled (``torch.save(model)``) or deep-copied with it gets
an inert hook instead: the copy is attached to nothing. Such a hook names
:func:`inert` as its ``__reduce__`` constructor.
"""

from __future__ import annotations

from typing import Any

__all__ = ["InertHook", "inert"]


class InertHook:
    """A module hook that does nothing: a copied pipeoff hook."""

    __slots__ = ()

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None


def inert(*args: Any) -> InertHook:
    """The pickle constructor of a copied pipeoff hook."""
    return InertHook()
