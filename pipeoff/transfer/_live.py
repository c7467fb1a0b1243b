"""``LiveTensor``: one local piece of a logical tensor, its geometry, residency and readiness."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from pipeoff import _accel, _compat
from pipeoff._contract import HostState
from pipeoff._errors import ConfigError

__all__ = ["RESIDENCIES", "LiveTensor", "Residency"]

Residency = Literal["device", "pinned", "pageable", "unavailable"]
RESIDENCIES: tuple[str, ...] = ("device", "pinned", "pageable", "unavailable")


def _ints(name: str, value: Any) -> tuple[int, ...]:
    try:
        out = tuple(value)
    except TypeError:
        raise ConfigError(f"{name} must be a sequence of ints, got {value!r}") from None
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in out):
        raise ConfigError(f"{name} must be a sequence of ints, got {value!r}")
    return out


def _storage_missing(t: torch.Tensor) -> bool:
    """A tensor whose storage was freed (FSDP2 resizes unsharded storage to 0) or
    never existed (meta)."""
    if t.device.type == "meta":
        return True
    if t.numel() == 0:
        return False
    try:
        nbytes = t.untyped_storage().nbytes()
    except RuntimeError:  # a tensor subclass without storage
        return True
    need = (t.storage_offset() + sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1)
    return nbytes < need * t.element_size()


@dataclass(frozen=True, eq=False)
class LiveTensor:
    """One local piece of a logical tensor, for :class:`~pipeoff.transfer.StateTransfer`.

    Three things are described apart (DeepSpeed proposal #8899):

    * **geometry**: ``global_shape``, and ``box = (offsets, sizes)``, the box of the
      global index space this rank holds. ``tensor`` may be larger than ``sizes``
      in any dimension (padded storage, as FSDP2 pads uneven shards): the piece is
      its leading corner, ``tensor[:sizes[0], :sizes[1], ...]``, and the rest is
      padding that a transfer never reads (a source) nor writes (a target).
    * **residency**: ``"device"``, ``"pinned"`` (page-locked host), ``"pageable"``
      host, or ``"unavailable"`` (``tensor=None``, a meta tensor, freed storage:
      a transfer refuses it rather than read a placeholder). Inferred from the
      tensor unless given; a declared residency is checked by the preflight.
      Without an accelerator (CPU-only torch) a CPU tensor may be declared
      ``"device"``: the stand-in that CPU tests use.
    * **readiness**: ``ready``, what must complete before the tensor may be read
      (a source) or written (a target): a :class:`pipeoff.Completion` (or
      several), a CUDA event, or anything with ``synchronize()``. A transfer may
      start while that work is still in flight; the preflight waits for it and
      refuses if it failed.

    ``replica=True`` says other ranks hold byte-identical copies of the same box
    (a ``Replicate`` placement); a transfer then reads one of them, picked
    deterministically (the target's own rank if it holds one).

    Args:
        tensor: the local storage, or ``None`` (unavailable).
        box: ``(offsets, sizes)``; default the whole ``global_shape``.
        global_shape: the logical tensor's shape; default ``tensor.shape``.
        residency: one of :data:`RESIDENCIES`, or ``None`` to infer it.
        ready: the readiness completion(s), or ``None`` (ready now).
        replica: see above.
        dtype: the element type, needed only with ``tensor=None``.
        optimizer: the pipeoff optimizer whose host state ``tensor`` is (set by
            :meth:`from_optimizer`): its next step waits for a transfer that
            reads it.

    Raises:
        ConfigError: an argument of the wrong type, or a box of another rank
            than ``global_shape``. Values (a box outside the shape, storage too
            small) are the preflight's to refuse, on every rank at once.
    """

    tensor: torch.Tensor | None
    box: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    global_shape: tuple[int, ...] | None = None
    residency: str | None = None
    ready: Any = None
    replica: bool = False
    dtype: torch.dtype | None = None
    optimizer: HostState | None = None

    def __post_init__(self) -> None:
        t = self.tensor
        if t is not None and not isinstance(t, torch.Tensor):
            raise ConfigError(f"LiveTensor: tensor must be a torch.Tensor or None, got "
                              f"{type(t).__name__}")
        if t is not None and hasattr(t, "device_mesh"):
            raise ConfigError("LiveTensor: tensor is a DTensor; use LiveTensor.from_dtensor(...) "
                              "(it reads the box from the placements)")
        if t is None and self.global_shape is None:
            raise ConfigError("LiveTensor: tensor=None (unavailable) needs global_shape=")
        gshape = _ints("global_shape", self.global_shape if self.global_shape is not None
                       else t.shape)  # type: ignore[union-attr]
        if self.box is None:
            box = (tuple(0 for _ in gshape), gshape)
        else:
            try:
                offsets, sizes = self.box
            except (TypeError, ValueError):
                raise ConfigError(f"LiveTensor: box must be (offsets, sizes), got {self.box!r}"
                                  ) from None
            box = (_ints("box offsets", offsets), _ints("box sizes", sizes))
            if len(box[0]) != len(gshape) or len(box[1]) != len(gshape):
                raise ConfigError(f"LiveTensor: box {self.box!r} has not one offset and one "
                                  f"size per dimension of global_shape {list(gshape)}")
        if self.residency is not None and self.residency not in RESIDENCIES:
            raise ConfigError(f"LiveTensor: residency must be one of {RESIDENCIES} or None, "
                              f"got {self.residency!r}")
        if not isinstance(self.replica, bool):
            raise ConfigError(f"LiveTensor: replica must be True or False, got {self.replica!r}")
        dtype = self.dtype if self.dtype is not None else (t.dtype if t is not None else None)
        if not isinstance(dtype, torch.dtype):
            raise ConfigError("LiveTensor: tensor=None needs dtype= (a torch.dtype)")
        if t is not None and self.dtype is not None and self.dtype != t.dtype:
            raise ConfigError(f"LiveTensor: dtype={self.dtype} but the tensor is {t.dtype}")
        _check_ready(self.ready)
        object.__setattr__(self, "global_shape", gshape)
        object.__setattr__(self, "box", box)
        object.__setattr__(self, "dtype", dtype)

    # -- constructors ---------------------------------------------------------------
    @classmethod
    def from_tensor(cls, tensor: torch.Tensor, *, ready: Any = None,
                    residency: str | None = None, replica: bool = False) -> LiveTensor:
        """A whole tensor: its box is its shape."""
        return cls(tensor, residency=residency, ready=ready, replica=replica)

    @classmethod
    def from_dtensor(cls, dtensor: Any, *, ready: Any = None, storage: torch.Tensor | None = None,
                     residency: str | None = None) -> LiveTensor:
        """This rank's shard of a DTensor: the box comes from its placements
        (``Shard`` and ``Replicate`` on any mesh; torch's chunking, so uneven shards
        are smaller at the end), and a shard replicated over a mesh dimension is a
        ``replica``.

        Args:
            dtensor: a ``torch.distributed.tensor.DTensor``.
            ready: see :class:`LiveTensor`.
            storage: padded storage whose leading corner is the local shard (FSDP2's
                padded sharded parameter), if the transfer should use that instead
                of ``dtensor.to_local()``.
            residency: see :class:`LiveTensor`.

        Raises:
            ConfigError: not a DTensor, or a ``Partial`` placement (a partial sum
                is no region of the tensor: reduce it first).
        """
        if not hasattr(dtensor, "device_mesh") or not hasattr(dtensor, "placements"):
            raise ConfigError(f"from_dtensor() takes a DTensor, got {type(dtensor).__name__}")
        if any(p.is_partial() for p in dtensor.placements):
            raise ConfigError(f"from_dtensor(): placements {dtensor.placements} include Partial; "
                              "a partial sum is no region of the tensor (redistribute first)")
        offsets, sizes = _compat.dtensor_box(dtensor)
        local = dtensor.to_local() if storage is None else storage
        replica = any(p.is_replicate() for p in dtensor.placements)
        return cls(local, box=(offsets, sizes), global_shape=tuple(dtensor.shape),
                   residency=residency, ready=ready, replica=replica)

    @classmethod
    def from_optimizer(cls, optimizer: Any, param: torch.Tensor, key: str) -> LiveTensor:
        """A parameter's optimizer state in host memory, ready when the step in flight has
        written it: ``key`` is a state name (``"exp_avg"``, ``"exp_avg_sq"``) or
        ``"master"`` (the FP32 master of a
        :class:`~pipeoff.optim.FullOffloadOptimizer`). The geometry is the
        parameter's (a DTensor's box). Works on
        :class:`~pipeoff.optim.OffloadOptimizer` and
        :class:`~pipeoff.optim.FullOffloadOptimizer`, without waiting for the step.
        The optimizer's next step (and ``load_state_dict``) waits for a transfer
        that reads it. It is a source only: to restore optimizer state, transfer
        into plain tensors and ``load_state_dict`` them (scalar state such as
        Adam's ``step`` is no tensor region: it travels in the state dict).

        Raises:
            ConfigError: not a pipeoff optimizer, or ``param`` has no such state.
        """
        if not isinstance(optimizer, HostState):
            raise ConfigError(f"from_optimizer() takes a pipeoff OffloadOptimizer or "
                              f"FullOffloadOptimizer, got {type(optimizer).__name__}")
        host, ready = optimizer.live_state(param, key)
        if hasattr(param, "device_mesh"):
            offsets, sizes = _compat.dtensor_box(param)
            replica = any(p.is_replicate() for p in param.placements)  # type: ignore[attr-defined]
            return cls(host, box=(offsets, sizes), global_shape=tuple(param.shape),
                       ready=ready, replica=replica, optimizer=optimizer)
        return cls(host, ready=ready, optimizer=optimizer)

    # -- what the preflight reads ----------------------------------------------------
    def resolved_residency(self) -> str:
        """The declared residency, or the one inferred from the tensor."""
        if self.residency is not None:
            return self.residency
        t = self.tensor
        if t is None or _storage_missing(t):
            return "unavailable"
        accel = _accel.current()
        if accel.available() and accel.on_device(t):
            return "device"
        if accel.available() and accel.is_pinned(t):
            return "pinned"
        return "pageable"

    def problem(self) -> str | None:
        """Why this piece cannot take part, or ``None``."""
        t = self.tensor
        declared = self.residency
        if declared == "unavailable" or t is None:
            return "its storage is unavailable (declared so, or tensor=None)"
        if t.device.type == "meta":
            return "it is a meta tensor: its storage is unavailable"
        if _storage_missing(t):
            return "its storage is unavailable (freed, or smaller than the tensor)"
        offsets, sizes = self.box  # type: ignore[misc]
        shape = self.global_shape
        assert shape is not None
        if any(o < 0 or s < 0 or o + s > g for o, s, g in zip(offsets, sizes, shape)):
            return (f"box offsets {list(offsets)}, sizes {list(sizes)} lie outside the global "
                    f"shape {list(shape)}")
        if t.dim() != len(shape) or any(s > d for s, d in zip(sizes, t.shape)):
            return (f"the local tensor of shape {list(t.shape)} cannot hold a box of sizes "
                    f"{list(sizes)} of a {len(shape)}-dimensional tensor (its leading corner)")
        accel = _accel.current()
        on_device = accel.available() and accel.on_device(t)
        if declared == "pinned" and (on_device or not accel.is_pinned(t)):
            return ("declared pinned, but it is not page-locked host memory"
                    + ("" if accel.available() else " (this torch cannot pin memory)"))
        if declared == "device" and not on_device and (accel.available() or t.is_cuda):
            return f"declared device, but it is in host memory ({t.device})"
        if declared in ("pinned", "pageable") and on_device:
            return f"declared {declared} host memory, but it is in device memory ({t.device})"
        return None

    def target_problem(self) -> str | None:
        """Why this piece cannot be written (beyond :meth:`problem`), or ``None``."""
        if self.tensor is None:
            return None
        t = self.region(*self.box)  # type: ignore[misc]
        if any(st == 0 and n > 1 for n, st in zip(t.shape, t.stride())):
            return ("its memory overlaps itself (a stride of 0: an expand()ed view), so "
                    "writing it is ambiguous")
        return None

    def region(self, lo: Sequence[int], size: Sequence[int]) -> torch.Tensor:
        """The local view of the global box ``(lo, size)`` (which this piece holds)."""
        t = self.tensor
        assert t is not None
        offsets = self.box[0]  # type: ignore[index]
        if t.dim() == 0:
            return t
        return t[tuple(slice(a - o, a - o + s) for a, o, s in zip(lo, offsets, size))]

    @property
    def nbytes(self) -> int:
        """Bytes of the piece (its box, not its padding)."""
        return math.prod(self.box[1]) * self.dtype.itemsize  # type: ignore[index,union-attr]

    def __repr__(self) -> str:
        t = self.tensor
        return (f"LiveTensor({'None' if t is None else f'{t.dtype} {list(t.shape)}'}, "
                f"box={self.box}, global_shape={self.global_shape}, "
                f"residency={self.residency or self.resolved_residency()!r})")


def _check_ready(ready: Any) -> None:
    if ready is None:
        return
    items = ready if isinstance(ready, (tuple, list)) else (ready,)
    for r in items:
        if not callable(getattr(r, "synchronize", None)):
            raise ConfigError(f"LiveTensor: ready must be a pipeoff.Completion, a CUDA event, a "
                              f"sequence of them, or None; got {type(r).__name__} (it has no "
                              "synchronize())")


def readiness_problem(ready: Any) -> str | None:
    """Wait (on the host) for ``ready``; why it failed, or ``None``.

    Raises:
        KeyboardInterrupt: Ctrl-C during the wait (never turned into a reason).
    """
    if ready is None:
        return None
    for r in ready if isinstance(ready, (tuple, list)) else (ready,):
        try:
            r.synchronize()
        except KeyboardInterrupt:
            raise  # the caller's Ctrl-C: the preflight tells the peers, then raises it
        except BaseException as err:  # noqa: BLE001 - reported on every rank, not raised here
            return f"waiting for its readiness raised {type(err).__name__}: {err}"
        status = getattr(r, "status", None)
        if status in ("failed", "cancelled"):
            return (f"its readiness completion (task {getattr(r, 'task', '?')!r} of another "
                    f"execution) {status}: the data was never written")
    return None


def _span(t: torch.Tensor) -> tuple[str, int, int] | None:
    """``(device, first address, end address)`` of the memory the view ``t`` spans, or
    ``None``. Addresses, not offsets in a storage: two storages may share memory
    (``torch.frombuffer`` or ``torch.from_numpy`` views of one buffer)."""
    if t.numel() == 0 or t.device.type == "meta":
        return None
    start = int(t.storage_offset())
    end = start + sum((int(n) - 1) * int(st) for n, st in zip(t.shape, t.stride())) + 1
    base, size = t.untyped_storage().data_ptr(), t.element_size()
    return str(t.device), base + start * size, base + end * size


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype)


def alias_problems(sources: Mapping[str, LiveTensor],
                   targets: Mapping[str, LiveTensor]) -> list[tuple[str, str]]:
    """Targets whose memory overlaps a source's or another target's on this rank.

    Allowed: a source that *is* the target's view of the same box, of the same key
    (an in-place gather: the target keeps its own piece). Anything else would read
    bytes that a round already overwrote, or write the same bytes twice, in an order
    that depends on the keys' names: another key's source inside a target reads it
    before or after the write; two keys' targets on the same memory (tied weights)
    keep the last key's values, whatever the other's source holds.
    """
    pieces: list[tuple[str, int, int, bool, str, LiveTensor, torch.Tensor]] = []
    for is_target, group in ((False, sources), (True, targets)):
        for key, lt in group.items():
            if lt.tensor is None or lt.problem() is not None:
                continue
            view = lt.region(*lt.box)  # type: ignore[misc]
            span = _span(view)
            if span is not None:
                pieces.append((*span, is_target, key, lt, view))
    pieces.sort(key=lambda p: (p[0], p[1]))
    problems: list[tuple[str, str]] = []
    active: list[tuple[str, int, int, bool, str, LiveTensor, torch.Tensor]] = []
    for p in pieces:
        active = [a for a in active if a[0] == p[0] and a[2] > p[1]]
        for a in active:
            if not (a[3] or p[3]):
                continue  # two sources may share memory: both are only read
            tgt, other = (a, p) if a[3] else (p, a)
            if not other[3] and other[4] == tgt[4] and _in_place(tgt[5], other[5]):
                continue
            if other[3]:
                why = ("two keys cannot write the same memory (tied weights: transfer one "
                       "key into it)")
            else:
                why = ("transfer through a separate tensor, or give the target exactly "
                       "its own source's view of its box")
            what = "target" if other[3] else "source"
            problems.append((tgt[4], f"its target memory overlaps the {what} of key "
                                     f"{other[4]!r} ({why})"))
        active.append(p)
    return problems


def _in_place(target: LiveTensor, other: LiveTensor) -> bool:
    """Whether the source ``other`` is ``target``'s own view of the source's box."""
    tbox, obox = target.box, other.box
    assert tbox is not None and obox is not None
    inside = all(t0 <= o0 and o0 + on <= t0 + tn
                 for t0, tn, o0, on in zip(tbox[0], tbox[1], obox[0], obox[1]))
    return inside and _same_view(target.region(*obox), other.region(*obox))
