"""Chunk plans: coverage, the byte bound, alignment and rank independence."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pipeoff
from pipeoff.optim import ParamMeta, plan_chunks

metas = st.lists(
    st.builds(ParamMeta, numel=st.integers(0, 3000), itemsize=st.sampled_from([2, 4, 8]),
              nkeys=st.integers(0, 3), group=st.integers(0, 2)),
    min_size=1, max_size=12,
)


@settings(max_examples=200, deadline=None)
@given(params=metas, chunk_bytes=st.one_of(st.none(), st.integers(1, 40_000)),
       align=st.sampled_from([1, 128]))
def test_plan_covers_every_element_once_within_the_bound(
    params: list[ParamMeta], chunk_bytes: int | None, align: int
) -> None:
    plan = plan_chunks(params, chunk_bytes, align=align)
    covered: dict[int, list[tuple[int, int]]] = {}
    for c in plan.chunks:
        assert c.segments
        end = 0
        for s in c.segments:
            covered.setdefault(s.param, []).append((s.lo, s.hi))
            assert s.offset == end  # slots are laid out back to back
            end += params[s.param].nkeys * s.slot_bytes
            assert s.offset % 16 == 0
        assert c.nbytes == end
        if chunk_bytes is not None and c.nbytes > chunk_bytes:
            # Only a single smallest unit may exceed a bound below one unit's state.
            assert len(c.segments) == 1
            s = c.segments[0]
            assert s.hi - s.lo <= align
    for i, m in enumerate(params):
        ranges = covered[i]
        assert ranges[0][0] == 0 and ranges[-1][1] == m.numel
        for (_, a), (b, _) in zip(ranges, ranges[1:]):
            assert a == b  # contiguous, in order
        assert all(lo % align == 0 for lo, _ in ranges)
    if chunk_bytes is None:
        assert len(plan.chunks) == 1


def test_plan_is_a_pure_function_of_the_metadata() -> None:
    params = [ParamMeta(numel=2000, itemsize=4, nkeys=2, group=0),
              ParamMeta(numel=3, itemsize=4, nkeys=2, group=0)]
    a = plan_chunks(params, 4096)
    b = plan_chunks(list(params), 4096)
    assert a == b and a.signature() == b.signature()
    assert a.chunks_of(0) == (0, 1, 2, 3)


@pytest.mark.parametrize("bad", [0, -5, 2.5, True])
def test_bad_chunk_bytes(bad: object) -> None:
    with pytest.raises(pipeoff.ConfigError, match="chunk_bytes"):
        plan_chunks([ParamMeta(numel=4, itemsize=4, nkeys=2, group=0)], bad)  # type: ignore[arg-type]


def test_whole_chunks_packs_whole_items_under_the_bound() -> None:
    from pipeoff.optim._plan import whole_chunks

    sizes = [4, 4, 10, 0, 3, 3]
    assert whole_chunks(sizes, 8) == ((0, 1), (2,), (3, 4, 5))  # 10 > 8: a chunk alone
    assert whole_chunks(sizes, 8, last_first=True) == ((5, 4, 3), (2,), (1, 0))
    assert whole_chunks(sizes, None) == tuple((i,) for i in range(6))  # one per item
    assert whole_chunks([], 8) == ()
