"""``FullOffloadOptimizer.state``: torch's ``optimizer.state`` over the host state, with
the writes torch's code makes to it passed on to that state.

The view is built at each read of ``opt.state`` (a ``defaultdict(dict)`` as torch's):
per parameter with state, an entry whose tensors *are* the host state's (an in-place
edit, ``.mul_()``, ``.copy_()``, reaches it directly). What replaces an entry or one of
its values (``opt.state[p] = {}``, ``del opt.state[p]``, ``opt.state[p]["step"] = t``,
``opt.state[p].clear()``, ``opt.state.clear()``) goes to the optimizer's ``write``,
which makes the host state (or the device part's) say so, as torch's optimizer would
step from it next. Writing a value equal to the one there (Lightning moving the state
to a device and back) changes nothing.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping
from typing import Any

import torch

from pipeoff._compat import local_tensor as local

__all__ = ["StateView"]

Write = Callable[[torch.Tensor, dict[str, Any]], None]
"""Make a parameter's state the entry given (``{}``: none, as if never stepped)."""
Read = Callable[[torch.Tensor], dict[str, Any]]
"""A parameter's entry as it is now (``{}``: none)."""

_MISSING = object()


def same_value(a: Any, b: Any) -> bool:
    """Whether writing ``b`` where ``a`` is changes nothing: the same object, or a tensor
    of the same dtype, shape and bits (wherever it lives)."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        a, b = local(a), local(b)
        return (a.dtype == b.dtype and a.shape == b.shape
                and bool(torch.equal(a, b.to(a.device))))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    return bool(a == b)


class Entry(dict):  # type: ignore[type-arg]
    """One parameter's state: a dict whose replacing writes go to the optimizer."""

    def __init__(self, param: torch.Tensor, values: Mapping[str, Any], write: Write,
                 read: Read) -> None:
        super().__init__(values)
        self._param, self._write, self._read = param, write, read

    def _set(self, new: dict[str, Any]) -> None:
        self._write(self._param, new)
        super().clear()
        super().update(new)

    def _now(self) -> dict[str, Any]:
        # (the state as it is now: a view kept across steps holds an older step count,
        # which a write of another key must not put back)
        return self._read(self._param)

    def __setitem__(self, key: str, value: Any) -> None:
        if key in self and same_value(dict.__getitem__(self, key), value):
            super().__setitem__(key, value)
            return
        self._set({**self._now(), key: value})

    def __delitem__(self, key: str) -> None:
        if key not in self:
            raise KeyError(key)
        self._set({k: v for k, v in self._now().items() if k != key})

    def pop(self, key: str, default: Any = _MISSING) -> Any:
        if key not in self:
            if default is _MISSING:
                raise KeyError(key)
            return default
        value = dict.__getitem__(self, key)
        del self[key]
        return value

    def popitem(self) -> tuple[str, Any]:
        if not self:
            raise KeyError("popitem(): the state entry is empty")
        key = next(reversed(list(self)))
        return key, self.pop(key)

    def clear(self) -> None:
        if self:
            self._set({})

    def update(self, *args: Any, **kwargs: Any) -> None:
        new = dict(*args, **kwargs)
        if any(k not in self or not same_value(dict.__getitem__(self, k), v)
               for k, v in new.items()):
            self._set({**self._now(), **new})
        else:
            super().update(new)

    def setdefault(self, key: str, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return dict.__getitem__(self, key)

    def __ior__(self, other: Any) -> Entry:  # type: ignore[override,misc]
        self.update(other)
        return self


class StateView(collections.defaultdict):  # type: ignore[type-arg]
    """``opt.state``: per parameter, its :class:`Entry` (an empty one for a parameter
    without state, made on first access as torch's ``defaultdict`` does)."""

    def __init__(self, entries: Mapping[torch.Tensor, Mapping[str, Any]], write: Write,
                 read: Read) -> None:
        super().__init__(None)
        self._write, self._read = write, read
        for p, values in entries.items():
            dict.__setitem__(self, p, Entry(p, values, write, read))

    def __missing__(self, param: torch.Tensor) -> Entry:
        entry = Entry(param, {}, self._write, self._read)
        dict.__setitem__(self, param, entry)
        return entry

    def __setitem__(self, param: torch.Tensor, values: Mapping[str, Any]) -> None:
        if not isinstance(values, Mapping):
            raise TypeError(f"opt.state[param] takes a dict of the parameter's state, got "
                            f"{type(values).__name__}")
        old = dict.get(self, param)
        if isinstance(old, Entry) and old.keys() == values.keys() and all(
                same_value(dict.__getitem__(old, k), v) for k, v in values.items()):
            return
        self._write(param, dict(values))
        dict.__setitem__(self, param, Entry(param, values, self._write, self._read))

    def __delitem__(self, param: torch.Tensor) -> None:
        if param not in self:
            raise KeyError(param)
        self._write(param, {})
        dict.__delitem__(self, param)

    def pop(self, param: torch.Tensor, default: Any = _MISSING) -> Any:
        if param not in self:
            if default is _MISSING:
                raise KeyError(param)
            return default
        entry = dict.__getitem__(self, param)
        del self[param]
        return entry

    def popitem(self) -> tuple[torch.Tensor, Any]:
        if not self:
            raise KeyError("popitem(): the optimizer has no state")
        param = next(reversed(list(self)))
        return param, self.pop(param)

    def clear(self) -> None:
        for param in list(self):
            del self[param]

    def update(self, *args: Any, **kwargs: Any) -> None:
        for param, values in dict(*args, **kwargs).items():
            self[param] = values

    def setdefault(self, param: torch.Tensor, default: Any = None) -> Any:
        if param not in self:
            self[param] = {} if default is None else default
        return dict.__getitem__(self, param)

    def __ior__(self, other: Any) -> StateView:  # type: ignore[override,misc]
        self.update(other)
        return self

    def __reduce__(self) -> Any:
        # (pickled or deep-copied, as torch's state: a plain defaultdict of plain dicts)
        return (collections.defaultdict,
                (dict, {p: dict(e) for p, e in self.items()}))

