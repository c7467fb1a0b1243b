"""Bucket plans: how parameters' local tensors are packed into flat all-reduce buckets.

Planning is pure bookkeeping over sizes and dtypes; it touches no tensor
data. A bucket holds one dtype only and at most ``limit`` bytes. Tensors are
packed densely: one that does not fit in the open bucket's room is split into
flat slices across consecutive buckets, so every bucket of a dtype but its
last is exactly ``limit`` bytes (``ceil(S / limit)`` collectives), and two
buckets fill a budget of ``2 * limit``. Only a non-contiguous local tensor,
which cannot be viewed flat, is kept whole in a bucket of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pipeoff._errors import ConfigError

__all__ = ["DEFAULT_BUCKET_BYTES", "Bucket", "Piece", "TensorInfo", "plan_buckets"]

DEFAULT_BUCKET_BYTES = 16 << 20
"""Bucket size of ``LocalSGD(schedule="pipelined")`` when ``bucket_bytes`` is not given."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorInfo:
    """What planning needs to know about one parameter's local tensor."""

    name: str
    """The parameter's qualified name, for error messages."""
    numel: int
    """Elements in the local tensor (the local shard of a DTensor)."""
    dtype: torch.dtype
    """Its dtype; a bucket never mixes dtypes."""
    contiguous: bool
    """Whether the local tensor can be viewed flat (needed to split it)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Piece:
    """A flat slice of one parameter placed at an offset of a bucket."""

    param: int
    """Index of the parameter in ``model.parameters()`` order."""
    start: int
    """First element of the slice in the flattened local tensor."""
    numel: int
    """Elements in the slice."""
    offset: int
    """Element offset of the slice inside the bucket."""
    whole: bool
    """Whether the slice is the whole local tensor."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Bucket:
    """One flat all-reduce buffer: its dtype, size and the slices packed into it."""

    dtype: torch.dtype
    """The dtype of every slice in the bucket."""
    numel: int
    """Elements in the bucket."""
    pieces: tuple[Piece, ...]
    """The slices, in parameter order, densely packed from offset 0."""

    @property
    def nbytes(self) -> int:
        """Bytes of the bucket's staging buffers."""
        return self.numel * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def plan_buckets(
    tensors: Sequence[TensorInfo], *, limit: int | None, per_parameter: bool,
    limit_name: str = "bucket_bytes",
) -> tuple[Bucket, ...]:
    """Pack tensors, in order and densely, into buckets of one dtype and at most ``limit`` bytes.

    Args:
        tensors: the local tensors, in ``model.parameters()`` order.
        limit: the most bytes a bucket may hold, or ``None`` for no limit.
        per_parameter: give each tensor its own bucket(s) instead of packing
            several into one (a tensor over ``limit`` is still split, into
            ``limit``-sized slices and a remainder).
        limit_name: the user's name for ``limit``, for error messages.

    Returns:
        The buckets, in the order their all-reduces are issued. Empty tensors
        are skipped: they have nothing to average.

    Raises:
        ConfigError: ``limit`` is smaller than one element of some dtype, or a
            non-contiguous tensor would have to be split.
    """
    buckets: list[Bucket] = []
    open_dtype: torch.dtype | None = None
    open_pieces: list[Piece] = []
    open_numel = 0

    def close() -> None:
        nonlocal open_dtype, open_pieces, open_numel
        if open_pieces:
            assert open_dtype is not None
            buckets.append(Bucket(dtype=open_dtype, numel=open_numel, pieces=tuple(open_pieces)))
        open_dtype, open_pieces, open_numel = None, [], 0

    for i, t in enumerate(tensors):
        if t.numel == 0:
            continue
        size = _itemsize(t.dtype)
        cap = None if limit is None else limit // size
        if cap is not None and cap < 1:
            raise ConfigError(
                f"{limit_name}={limit} is smaller than one element of parameter {t.name!r} "
                f"({t.dtype}, {size} bytes); use at least {size}"
            )
        if per_parameter or open_dtype != t.dtype:
            close()
        if cap is not None and open_numel + t.numel > cap and not t.contiguous:
            close()  # a tensor that cannot be split starts a bucket of its own
        if cap is not None and t.numel > cap and not t.contiguous:
            raise ConfigError(
                f"parameter {t.name!r} ({t.numel * size} bytes) must be split to fit "
                f"{limit_name}={limit}, but its local tensor is not contiguous; raise "
                f"{limit_name} to at least {t.numel * size}"
            )
        start = 0
        while start < t.numel:
            take = t.numel - start if cap is None else min(t.numel - start, cap - open_numel)
            open_dtype = t.dtype
            open_pieces.append(Piece(param=i, start=start, numel=take, offset=open_numel,
                                     whole=take == t.numel))
            open_numel += take
            start += take
            if cap is not None and open_numel == cap:
                close()
    close()
    return tuple(buckets)



