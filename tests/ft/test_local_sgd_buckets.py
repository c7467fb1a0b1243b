"""Bucket planning: dense packing, one dtype per bucket, splits within the limit."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeoff import ConfigError
from pipeoff.ft._buckets import TensorInfo, plan_buckets

F32, F64 = torch.float32, torch.float64


def _infos(spec: list[tuple[int, torch.dtype]]) -> list[TensorInfo]:
    return [TensorInfo(name=f"p{i}", numel=n, dtype=d, contiguous=True)
            for i, (n, d) in enumerate(spec)]


def _check(infos: list[TensorInfo], limit: int | None, per_parameter: bool) -> None:
    buckets = plan_buckets(infos, limit=limit, per_parameter=per_parameter)
    covered: dict[int, int] = {}
    for b in buckets:
        if limit is not None:
            assert b.nbytes <= limit
        offset = 0
        for pc in b.pieces:
            assert infos[pc.param].dtype == b.dtype  # never mixes dtypes
            assert pc.offset == offset  # dense
            assert pc.start == covered.get(pc.param, 0)  # slices in order, no gaps
            covered[pc.param] = pc.start + pc.numel
            offset += pc.numel
        assert offset == b.numel
        if per_parameter:
            assert len({pc.param for pc in b.pieces}) == 1
    assert covered == {i: t.numel for i, t in enumerate(infos) if t.numel}


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.tuples(st.integers(0, 300), st.sampled_from([F32, F64])), max_size=12),
    limit=st.one_of(st.none(), st.integers(8, 2000)),
    per_parameter=st.booleans(),
)
def test_plan_covers_every_element_once_within_limit(
    sizes: list[tuple[int, torch.dtype]], limit: int | None, per_parameter: bool
) -> None:
    _check(_infos(sizes), limit, per_parameter)


def test_dense_packing_fills_buckets() -> None:
    # 16 KiB weights and 256-byte biases: every bucket but the last is full.
    infos = _infos([(4096, F32), (64, F32)] * 3)
    buckets = plan_buckets(infos, limit=16384, per_parameter=False)
    assert [b.nbytes for b in buckets] == [16384, 16384, 16384, 768]


def test_per_parameter_keeps_one_bucket_per_parameter() -> None:
    infos = _infos([(12, F32), (4, F32), (20, F32), (5, F32)])
    buckets = plan_buckets(infos, limit=None, per_parameter=True)
    assert [b.numel for b in buckets] == [12, 4, 20, 5]


def test_non_contiguous_tensor_is_not_split() -> None:
    infos = [TensorInfo(name="a", numel=10, dtype=F32, contiguous=True),
             TensorInfo(name="t", numel=20, dtype=F32, contiguous=False)]
    buckets = plan_buckets(infos, limit=100, per_parameter=False)
    assert [b.numel for b in buckets] == [10, 20]
    with pytest.raises(ConfigError, match="'t'.*not contiguous"):
        plan_buckets(infos, limit=40, per_parameter=False)


def test_limit_below_one_element() -> None:
    with pytest.raises(ConfigError, match="smaller than one element of parameter 'p0'"):
        plan_buckets(_infos([(3, F64)]), limit=4, per_parameter=False)
