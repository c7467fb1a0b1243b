"""The placeholder a parameter's ``.grad`` holds under full offload (:class:`HostGrad`)
and its slot: what it stands for and what the loop recorded on it. What the
placeholder answers, and the object that owns them, are in ``_grads.py``."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from pipeoff import _compat
from pipeoff._compat import local_tensor as local
from pipeoff._errors import GradientError, PipeoffError
from pipeoff.optim._tensors import wrap_like

if TYPE_CHECKING:
    from pipeoff.optim._full_offload._common import Accumulation
    from pipeoff.optim._full_offload._device_part import DeviceParam
    from pipeoff.optim._full_offload._edits import Edit
    from pipeoff.optim._full_offload._grads import LoopGrads
    from pipeoff.optim._full_offload._param import OffloadedParam

__all__ = ["GradSlot", "HostGrad", "NeedsRealGradient", "incoming_of", "is_placeholder",
           "real_of", "slots_in"]

_VALUE_READS = frozenset({torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__array__,
                          torch.Tensor.data.__set__})  # type: ignore[attr-defined]
"""Reads of the values that bypass aten (a wrapper subclass has no storage to give
them), and ``grad.data = t`` (which set_data would leave on the placeholder, unread: a
tester's find): they run on the real gradient."""


class GradSlot:
    """One parameter's gradient in one accumulation, as the loop sees it.

    Written on the caller's thread (and, for ``incoming``, on the thread running a
    backward), read there; the lanes never touch it.
    """

    __slots__ = ("acc", "applied", "dev", "dropped", "edits", "i", "incoming", "out", "owner",
                 "placeholder", "real", "rec", "shown")

    def __init__(self, owner: LoopGrads, acc: Accumulation, i: int, rec: OffloadedParam,
                 dev: DeviceParam | None = None) -> None:
        self.owner = weakref.ref(owner)
        self.acc = acc
        """The accumulation it stands for (a placeholder of an earlier one refuses)."""
        self.i = i
        """The host part's position of the parameter (-1 in the device part)."""
        self.rec = rec
        self.dev = dev
        """A device-part parameter's record (its sum in device memory), else ``None``."""
        self.edits: list[Edit] = []
        """In-place operations recorded on it, applied to the host sum in the step."""
        self.applied = False
        """Edits were applied to the host sum already (a read needed them): the norm the
        final fold took is not this sum's any more."""
        self.incoming: torch.Tensor | None = None
        """A gradient that autograd added into the placeholder (a backward whose forward
        the optimizer did not see), until the parameter's hook takes it."""
        self.real: torch.Tensor | None = None
        """The gradient copied to the device by an operation that needed its values."""
        self.dropped = False
        """The loop set every ``param.grad`` to ``None`` while this was shown there (its
        accumulation discarded): an edit of it reaches nothing, as torch's."""
        self.placeholder = HostGrad(local(rec.param), self)
        self.shown: torch.Tensor = wrap_like(rec.param, self.placeholder)
        self.out = False
        """Whether it was put in ``param.grad`` and not taken out since: what the loop did
        to ``.grad`` is read only from these (a slot of an earlier backward that was
        not shown again is not a gradient the loop dropped)."""
        """What ``param.grad`` holds: the placeholder, then the real gradient."""

    def loop_grads(self) -> LoopGrads:
        owner = self.owner()
        if owner is None:
            raise PipeoffError("this gradient placeholder's FullOffloadOptimizer was deleted")
        return owner

    def alias(self) -> HostGrad:
        """Another placeholder of the same gradient (``detach()``, ``.data``)."""
        return HostGrad(self.placeholder, self)


class HostGrad(torch.Tensor):
    """A parameter's gradient sum as the loop sees it (see ``_grads.py``'s docstring).

    Its shape, dtype, strides and device are the parameter's (local shard's); it has
    no storage. ``repr`` says what it stands for.
    """

    _slot: GradSlot

    @staticmethod
    def __new__(cls, like: torch.Tensor, slot: GradSlot) -> HostGrad:
        t: Any = _compat.make_wrapper_subclass(cls, like)
        t._slot = slot
        return t  # type: ignore[no-any-return]

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Sequence[Any] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        # Norms and in-place scaling are answered at the aten level (below); any
        # other operation runs on the real gradient, here above autograd, so that
        # views of it and writes through them are those of an ordinary tensor.
        kwargs = kwargs or {}
        slots = list(slots_in(args, kwargs))
        if func not in _VALUE_READS and not any(s.real is not None for s in slots):
            marks = [len(s.edits) for s in slots]
            try:
                with torch._C.DisableTorchFunctionSubclass():
                    return func(*args, **kwargs)
            except NeedsRealGradient:
                for s, n in zip(slots, marks):
                    del s.edits[n:]  # (a composite op that scaled, then needed values)
        return func(*real_of(args), **{k: real_of(v) for k, v in kwargs.items()})

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Sequence[Any] = (),  # type: ignore[override]
                           kwargs: dict[str, Any] | None = None) -> Any:
        slot = next(s for s in slots_in(args, kwargs or {}))
        return slot.loop_grads().dispatch(func, tuple(args), dict(kwargs or {}))

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        rec = self._slot.rec
        where = "device part's" if self._slot.dev is not None else "host"
        return (f"HostGrad(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device}: "
                f"the FP32 {where} gradient sum of {rec.name!r} under FullOffloadOptimizer)")

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Pickled or saved: the real gradient, in the parameter's dtype.
        return self._slot.loop_grads().materialize(self._slot).__reduce_ex__(protocol)

    def __deepcopy__(self, memo: dict[int, Any]) -> torch.Tensor:
        return self._slot.loop_grads().materialize(self._slot).clone()


def slots_in(args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, HostGrad):
            yield a._slot
        elif isinstance(a, (list, tuple)):
            yield from (t._slot for t in a if isinstance(t, HostGrad))


class NeedsRealGradient(GradientError):
    """An operation on a gradient placeholder that needs the gradient's values.

    Raised (and handled) inside :class:`HostGrad`: the operation is run again on the
    real gradient. It reaches the caller only where the operation cannot be re-run:
    through a DTensor parameter's placeholder (norms and in-place scaling work there)
    or from C++ code that writes ``.grad`` itself (DDP's reducer copying into a
    gradient the loop left in place).
    """


def real_of(a: Any) -> Any:
    # Each placeholder by its own optimizer's LoopGrads: one foreach call may span
    # the parameters of several (torchtitan clips all model parts in one call).
    if isinstance(a, HostGrad):
        return a._slot.loop_grads().materialize(a._slot)
    if isinstance(a, (list, tuple)):
        return type(a)(real_of(t) for t in a)
    return a


def is_placeholder(t: Any) -> bool:
    """Whether ``t`` (or a DTensor's local tensor) is a :class:`HostGrad`."""
    return t is not None and isinstance(local(t), HostGrad)


def incoming_of(grad: torch.Tensor) -> torch.Tensor | None:
    """The gradient autograd added into a placeholder (the local tensor), or ``None``."""
    loc = local(grad)
    if not isinstance(loc, HostGrad):
        return grad
    slot = loc._slot
    got, slot.incoming = slot.incoming, None
    return got
