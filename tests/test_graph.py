from __future__ import annotations

import pytest

from pipeoff import ConfigError, GraphError, TaskGraph, TaskKind


def chain(names: list[str]) -> TaskGraph:
    g = TaskGraph()
    prev: list[str] = []
    for n in names:
        g.add_task(n, TaskKind.HOST, deps=prev)
        prev = [n]
    return g


def test_duplicate_task_name_is_named() -> None:
    g = chain(["a"])
    with pytest.raises(GraphError, match="duplicate task name 'a'"):
        g.add_task("a", TaskKind.HOST)


def test_duplicate_buffer_name_is_named() -> None:
    g = TaskGraph()
    g.add_buffer("buf", 8)
    with pytest.raises(GraphError, match="duplicate buffer name 'buf'"):
        g.add_buffer("buf", 8)


def test_unknown_dependency_is_named() -> None:
    g = TaskGraph()
    g.add_task("a", TaskKind.HOST, deps=["ghost"])
    with pytest.raises(GraphError, match="task 'a' depends on unknown task 'ghost'"):
        g.validate()


def test_self_dependency() -> None:
    g = TaskGraph()
    g.add_task("a", TaskKind.HOST, deps=["a"])
    with pytest.raises(GraphError, match="'a' depends on itself"):
        g.validate()


def test_unknown_and_unused_buffers() -> None:
    g = TaskGraph()
    g.add_task("a", TaskKind.D2H, buffers=["nope"])
    with pytest.raises(GraphError, match="task 'a' uses unknown buffer 'nope'"):
        g.validate()
    g2 = TaskGraph()
    g2.add_buffer("idle", 16)
    g2.add_task("a", TaskKind.D2H)
    with pytest.raises(GraphError, match="buffer 'idle' is declared but no task uses it"):
        g2.validate()


def test_cycle_is_printed() -> None:
    g = TaskGraph()
    g.add_task("a", TaskKind.HOST, deps=["c"])
    g.add_task("b", TaskKind.HOST, deps=["a"])
    g.add_task("c", TaskKind.HOST, deps=["b"])
    g.add_task("d", TaskKind.HOST)
    with pytest.raises(GraphError) as info:
        g.validate()
    msg = str(info.value)
    assert "dependency cycle" in msg
    # Printed in execution order: each must finish before the next.
    assert "a -> b -> c -> a" in msg or "b -> c -> a -> b" in msg or "c -> a -> b -> c" in msg
    assert "d" not in msg.split(":", 1)[1]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kind": "d2h"}, "kind must be a pipeoff.TaskKind"),
        ({"work": 3}, "work must be callable"),
        ({"nbytes": -1}, "nbytes must be an int >= 0"),
        ({"nbytes": 1.5}, "nbytes must be an int >= 0"),
    ],
)
def test_bad_task_arguments(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"kind": TaskKind.HOST}
    args.update(kwargs)
    with pytest.raises(ConfigError, match=match):
        TaskGraph().add_task("t", **args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("nbytes", "where", "match"),
    [
        (0, "device", "nbytes must be a positive int"),
        (8, "gpu", "where must be 'device' or 'host'"),
    ],
)
def test_bad_buffer_arguments(nbytes: int, where: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        TaskGraph().add_buffer("b", nbytes, where=where)  # type: ignore[arg-type]


def test_order_is_deterministic_and_ties_break_by_insertion() -> None:
    def build() -> TaskGraph:
        g = TaskGraph()
        g.add_task("late_root", TaskKind.HOST)
        g.add_task("x", TaskKind.HOST, deps=["root"])  # forward reference
        g.add_task("root", TaskKind.HOST)
        g.add_task("y", TaskKind.HOST, deps=["root", "late_root"])
        g.add_task("z", TaskKind.HOST, deps=["x", "y"])
        return g

    order = build().topological_order()
    assert order == ("late_root", "root", "x", "y", "z")
    assert all(build().topological_order() == order for _ in range(5))


def test_deps_accepts_a_single_name() -> None:
    g = TaskGraph()
    g.add_task("a", TaskKind.HOST)
    g.add_task("b", TaskKind.HOST, deps="a")
    assert g.tasks["b"].deps == ("a",)
