"""The transfer planner: exact coverage by interval arithmetic, runs, rounds within capacity."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeoff.transfer import Piece, plan_transfer
from pipeoff.transfer._plan import ALIGN, PlanRefusal, find_gap

F32 = torch.float32


def piece(lo: tuple[int, ...], size: tuple[int, ...], shape: tuple[int, ...] = (5, 7),
          key: str = "w", dtype: torch.dtype = F32, replica: bool = False) -> Piece:
    return Piece(key=key, global_shape=shape, offsets=lo, sizes=size, dtype=dtype,
                 replica=replica)


def whole(shape: tuple[int, ...] = (5, 7), **kw: object) -> Piece:
    return piece((0,) * len(shape), shape, shape, **kw)  # type: ignore[arg-type]


def refusal(*args: object, **kw: object) -> list[tuple[int, str, str]]:
    with pytest.raises(PlanRefusal) as info:
        plan_transfer(*args, **kw)  # type: ignore[arg-type]
    return info.value.problems


def test_a_gap_and_an_overlap_of_equal_size_are_refused_where_a_count_would_pass() -> None:
    # 3 + 2 rows of 5: the count matches, but row 2 is held twice and row 4 never.
    srcs = [[piece((0, 0), (3, 7))], [piece((2, 0), (2, 7))]]
    problems = refusal(srcs, [[whole()], []], capacity=[1024, 1024])
    assert problems == [(1, "w", "source box [2:4, 0:7] overlaps rank 0's [0:3, 0:7] in "
                                 "[2:3, 0:7]")]


def test_a_gap_alone_is_located() -> None:
    srcs = [[piece((0, 0), (3, 7))], [piece((4, 0), (1, 7))]]
    problems = refusal(srcs, [[whole()], []], capacity=[1024, 1024])
    assert problems[0][0] == 0 and "nothing holds [3:4, 0:7]" in problems[0][2]


def test_find_gap_in_two_dimensions() -> None:
    target = ((0, 0), (4, 4))
    boxes = [((0, 0), (4, 2)), ((0, 2), (2, 2))]
    assert find_gap(target, boxes) == ((2, 2), (2, 2))
    assert find_gap(target, boxes + [((2, 2), (2, 2))]) is None


def test_replicas_need_identical_boxes_and_are_picked_deterministically() -> None:
    srcs = [[whole(replica=True)], [whole(replica=True)], [whole(replica=True)]]
    plan = plan_transfer(srcs, [[whole()], [whole()], [whole()]], capacity=[4096] * 3)
    # Every rank reads its own replica: nothing crosses ranks.
    assert all(u.src == u.dst for r in plan.rounds for u in r)
    plan2 = plan_transfer(srcs[:2] + [[]], [[], [], [whole()]], capacity=[4096] * 3)
    assert {u.src for r in plan2.rounds for u in r} == {0}  # rank 2 % 2 holders
    # Without replica=True the same boxes are an overlap.
    problems = refusal([[whole()], [whole()]], [[whole()], []], capacity=[4096] * 2)
    assert "replica=True" in problems[0][2]


@pytest.mark.parametrize(("declared", "expect"), [
    ([], "no cast is declared"),
    ([("w", torch.float16)], "declared cast is to torch.float16"),
])
def test_a_dtype_change_needs_a_matching_cast(declared: list[tuple[str, torch.dtype]],
                                              expect: str) -> None:
    problems = refusal([[whole()]], [[whole(dtype=torch.bfloat16)]], capacity=[1024],
                       casts=[declared])
    assert expect in problems[0][2]
    plan = plan_transfer([[whole()]], [[whole(dtype=torch.bfloat16)]], capacity=[1024],
                         casts=[[("x*", torch.float16), ("*", torch.bfloat16)]])
    assert {u.dtype for r in plan.rounds for u in r} == {torch.bfloat16}


def test_a_cast_named_exactly_matches_a_key_with_glob_characters() -> None:
    """"layers[0].w" as an fnmatch pattern is a character class ("layers0.w"): the
    exact key name was refused as having no cast declared."""
    key = "layers[0].w"
    plan = plan_transfer([[whole(key=key)]], [[whole(key=key, dtype=torch.bfloat16)]],
                         capacity=[1024], casts=[[(key, torch.bfloat16)]])
    assert {u.dtype for r in plan.rounds for u in r} == {torch.bfloat16}


def test_keys_without_a_source_or_a_target_shapes_and_boxes_are_refused() -> None:
    problems = refusal([[whole()], []], [[whole()], [whole(key="extra")]], capacity=[64, 64])
    assert (1, "extra", problems[0][2]) == problems[0] and "no source" in problems[0][2]
    problems = refusal([[whole(key="lonely")]], [[]], capacity=[64])
    assert "no target" in problems[0][2]
    problems = refusal([[whole()]], [[whole((5, 8))]], capacity=[64])
    assert "global shape [5, 8] disagrees" in problems[0][2]
    problems = refusal([[piece((0, 0), (6, 7))]], [[whole()]], capacity=[64])
    assert "outside the global shape" in problems[0][2]


def test_a_capacity_below_one_element_is_refused() -> None:
    problems = refusal([[whole()]], [[whole()]], capacity=[ALIGN - 1])
    assert "less than one torch.float32 element" in problems[0][2]


@pytest.mark.parametrize("capacity", [16, 64, 100, 4096])
def test_rounds_stay_within_each_ranks_capacity_and_cover_every_element_once(
        capacity: int) -> None:
    shape = (5, 7, 3)
    srcs = [[piece((0, 0, 0), (3, 7, 3), shape)], [piece((3, 0, 0), (2, 7, 3), shape)]]
    dsts = [[piece((0, 0, 0), (5, 4, 3), shape)], [piece((0, 4, 0), (5, 3, 3), shape)]]
    plan = plan_transfer(srcs, dsts, capacity=[capacity, capacity])
    seen = torch.zeros(shape, dtype=torch.int32)
    for r, runs in enumerate(plan.rounds):
        for rank in (0, 1):
            assert plan.send_bytes(r, rank) + plan.recv_bytes(r, rank) <= capacity
            local = sum(-(-u.nbytes // ALIGN) * ALIGN for u in runs if u.src == u.dst == rank)
            assert local <= capacity
        for u in runs:
            seen[tuple(slice(a, a + s) for a, s in zip(u.lo, u.size))] += 1
            assert u.offset % ALIGN == 0 or u.offset == -1
    assert bool((seen == 1).all())


@pytest.mark.parametrize("capacity", [16, 24, 31, 48, 4096])
@pytest.mark.parametrize("world", [3, 5])
def test_a_fan_out_stays_within_the_senders_capacity(capacity: int, world: int) -> None:
    """One rank holds the tensor, every rank wants it whole (a replicated rollout copy):
    the sender's copies for all destinations shared one round whatever its capacity, and
    its send buffer exceeded a small budget (a BudgetError on that rank alone, at launch:
    its peers waited in the preflight)."""
    srcs: list[list[Piece]] = [[] for _ in range(world)]
    srcs[-1] = [whole((3,))]
    plan = plan_transfer(srcs, [[whole((3,))] for _ in range(world)],
                         capacity=[capacity] * world)
    seen = torch.zeros(world, 3, dtype=torch.int32)
    for r, runs in enumerate(plan.rounds):
        for rank in range(world):
            assert plan.send_bytes(r, rank) + plan.recv_bytes(r, rank) <= capacity
        for u in runs:
            seen[u.dst, u.lo[0]:u.lo[0] + u.size[0]] += 1
    assert bool((seen == 1).all())


def test_plans_are_identical_for_identical_inputs() -> None:
    srcs = [[piece((0, 0), (3, 7))], [piece((3, 0), (2, 7))]]
    a = plan_transfer(srcs, [[whole()], [whole()]], capacity=[64, 64])
    b = plan_transfer(srcs, [[whole()], [whole()]], capacity=[64, 64])
    assert a == b and a.signature() == b.signature()
    c = plan_transfer(srcs, [[whole()], [whole()]], capacity=[64, 32])
    assert c.signature() != a.signature()


def test_zero_size_and_scalar_tensors() -> None:
    plan = plan_transfer([[whole((0, 4), key="a"), whole((), key="b")]],
                         [[whole((0, 4), key="a"), whole((), key="b")]], capacity=[64])
    runs = [u for r in plan.rounds for u in r]
    assert [(u.key, u.size, u.nbytes) for u in runs] == [("b", (), 4)]


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 40), m=st.integers(1, 9), world=st.integers(1, 4),
       capacity=st.sampled_from([16, 48, 64, 200, 1 << 12]), data=st.data())
def test_random_shardings_tile_exactly(n: int, m: int, world: int, capacity: int,
                                       data: st.DataObject) -> None:
    cuts = sorted(data.draw(st.lists(st.integers(0, n), min_size=world - 1,
                                     max_size=world - 1)))
    bounds = [0, *cuts, n]
    shape = (n, m)
    srcs = [[piece((bounds[r], 0), (bounds[r + 1] - bounds[r], m), shape)]
            for r in range(world)]
    col = data.draw(st.integers(0, m))
    dsts = [[piece((0, 0), (n, col), shape)] if r % 2 == 0 else
            [piece((0, col), (n, m - col), shape)] for r in range(world)]
    plan = plan_transfer(srcs, dsts, capacity=[capacity] * world)
    for rank, ds in enumerate(dsts):
        seen = torch.zeros(shape, dtype=torch.int32)
        for runs in plan.rounds:
            for u in runs:
                if u.dst == rank:
                    seen[tuple(slice(a, a + s) for a, s in zip(u.lo, u.size))] += 1
        (lo, size) = ds[0].offsets, ds[0].sizes
        want = torch.zeros(shape, dtype=torch.int32)
        want[lo[0]:lo[0] + size[0], lo[1]:lo[1] + size[1]] = 1
        assert torch.equal(seen, want)
    assert plan.nbytes == sum(math.prod(d[0].sizes) * 4 for d in dsts)


def test_ten_thousand_tensors_plan() -> None:
    shapes = [(64, 33 + k % 7) for k in range(10_000)]
    srcs: list[list[Piece]] = [[], []]
    for k, s in enumerate(shapes):
        srcs[0].append(piece((0, 0), (32, s[1]), s, key=f"p{k}"))
        srcs[1].append(piece((32, 0), (32, s[1]), s, key=f"p{k}"))
    dsts = [[whole(s, key=f"p{k}") for k, s in enumerate(shapes)], []]
    plan = plan_transfer(srcs, dsts, capacity=[8 << 20, 8 << 20])
    assert plan.nbytes == sum(math.prod(s) * 4 for s in shapes)


def test_a_region_for_several_ranks_shares_a_round_so_it_is_packed_once() -> None:
    shape = (7, 33)
    srcs = [[piece((3 * r, 0), (min(3, 7 - 3 * r), 33), shape)] for r in range(3)]
    plan = plan_transfer(srcs, [[whole(shape)] for _ in range(3)], capacity=[256] * 3)
    for runs in plan.rounds:
        remote = [(u.src, u.lo, u.size) for u in runs if u.src != u.dst]
        # Every piece a rank sends goes to both of its peers in the same round.
        assert all(remote.count(r) == 2 for r in remote), remote
