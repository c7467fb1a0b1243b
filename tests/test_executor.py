from __future__ import annotations

import threading
import time
import traceback
import warnings
from typing import Any

import pytest
import torch

import pipeoff
import pipeoff.testing
from pipeoff import ConfigError, Schedule, StepTimeoutError, TaskGraph, TaskKind
from pipeoff.staging import StagingPool, pools_for
from tests.gpu_device import Gpu


def _live() -> int:
    return pools_for("cpu").device.stats().live_bytes


def test_concurrency_without_timing() -> None:
    """A task on lane A blocks until a task on lane B sets a flag."""
    flag = threading.Event()
    seen: dict[str, bool] = {}

    def a(ctx: pipeoff.TaskContext) -> None:
        # Under threads this returns as soon as B runs; sequentially B cannot
        # run until A gives up, so A sees the flag unset.
        seen["a"] = flag.wait(timeout=0.5 if ctx.lane == "main" else 30)

    g = TaskGraph()
    g.add_task("a", TaskKind.D2H, a)
    g.add_task("b", TaskKind.H2D, lambda ctx: flag.set())
    pipeoff.execute(g, Schedule.pipelined(), backend="threads").wait(timeout=60)
    assert seen["a"] is True

    flag.clear()
    ex = pipeoff.execute(g, Schedule.synchronous())
    ex.wait()
    assert seen["a"] is False
    recs = ex.trace.tasks
    assert [r.name for r in recs] == ["a", "b"]
    assert recs[1].start_ns >= recs[0].end_ns  # strictly sequential


def test_synchronous_order_is_strictly_sequential_on_threads_too() -> None:
    g = TaskGraph()
    for k in range(6):
        g.add_task(f"t{k}", list(TaskKind)[k % 5], lambda ctx: time.sleep(0.002))
    ex = pipeoff.execute(g, Schedule.synchronous(), backend="threads")
    ex.wait(timeout=30)
    recs = ex.trace.tasks
    assert {r.lane for r in recs} == {"main"}
    assert all(b.start_ns >= a.end_ns for a, b in zip(recs, recs[1:]))


def test_execute_returns_before_work_is_done() -> None:
    gate = threading.Event()
    g = TaskGraph()
    g.add_task("blocked", TaskKind.OPTIMIZER_CHUNK, lambda ctx: gate.wait(30))
    g.add_task("after", TaskKind.D2H, deps=["blocked"])
    ex = pipeoff.execute(g)
    assert not ex.done() and not ex.done("after")
    with pytest.raises(StepTimeoutError) as info:
        ex.wait(timeout=0.05)
    assert isinstance(info.value, TimeoutError)
    assert "'blocked'" in str(info.value) and "'after'" in str(info.value)
    assert set(info.value.pending) == {"blocked", "after"}
    gate.set()
    ex.wait(timeout=30)
    assert ex.done()


def _raises_boom(ctx: pipeoff.TaskContext) -> None:
    raise ValueError("boom in the collective")


def test_first_exception_reraised_dependents_cancelled_staging_released() -> None:
    ran: list[str] = []
    g = TaskGraph()
    g.add_buffer("stage", 4096)
    g.add_task("copy", TaskKind.H2D, lambda ctx: ran.append("copy"), buffers=["stage"])
    g.add_task("reduce", TaskKind.ALLREDUCE, _raises_boom, deps=["copy"], buffers=["stage"])
    g.add_task("d2h", TaskKind.D2H, lambda ctx: ran.append("d2h"), deps=["reduce"],
               buffers=["stage"])
    g.add_task("writeback", TaskKind.H2D, lambda ctx: ran.append("writeback"), deps=["d2h"])
    ex = pipeoff.execute(g, Schedule.pipelined(device_budget_bytes=4096))
    with pytest.raises(ValueError, match="boom in the collective") as info:
        ex.wait(timeout=30)
    # The original traceback, down to the task's own frame.
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "_raises_boom" in frames
    assert any("pipeoff task 'reduce'" in n for n in info.value.__notes__)
    assert ran == ["copy"]
    assert ex.exception is info.value and ex.failed_task == "reduce"
    statuses = {r.name: r.status for r in ex.trace.tasks}
    assert statuses == {"copy": "ok", "reduce": "failed", "d2h": "cancelled",
                        "writeback": "cancelled"}
    assert _live() == 0
    # Every later wait re-raises too, and the executor stays usable.
    with pytest.raises(ValueError):
        ex.wait("copy")
    g2 = TaskGraph()
    g2.add_task("fine", TaskKind.ALLREDUCE, lambda ctx: 7)
    assert pipeoff.execute(g2).result("fine") == 7


def test_running_tasks_finish_after_a_failure() -> None:
    started = threading.Event()
    finished = threading.Event()
    holder: list[pipeoff.Execution] = []

    def slow(ctx: pipeoff.TaskContext) -> None:
        started.set()
        deadline = time.monotonic() + 30
        while holder[0].exception is None and time.monotonic() < deadline:
            time.sleep(0.001)  # running when the failure is recorded
        finished.set()

    def bad(ctx: pipeoff.TaskContext) -> None:
        assert started.wait(30)
        raise ValueError("boom")

    g = TaskGraph()
    g.add_task("slow", TaskKind.D2H, slow)
    g.add_task("bad", TaskKind.ALLREDUCE, bad)
    with pipeoff.testing.hold_task("slow") as release:
        ex = pipeoff.execute(g)
        holder.append(ex)
        release.set()
        with pytest.raises(ValueError):
            ex.wait(timeout=30)
    assert finished.is_set()
    assert {r.name: r.status for r in ex.trace.tasks} == {"slow": "ok", "bad": "failed"}


def test_failure_cancels_tasks_queued_on_other_lanes() -> None:
    ran: list[str] = []
    holder: list[pipeoff.Execution] = []

    def slow(ctx: pipeoff.TaskContext) -> None:
        deadline = time.monotonic() + 30
        while holder[0].exception is None and time.monotonic() < deadline:
            time.sleep(0.001)  # ends only once the failure is recorded

    g = TaskGraph()
    g.add_task("slow", TaskKind.D2H, slow)
    g.add_task("bad", TaskKind.ALLREDUCE, _raises_boom)
    # Independent of "bad", but queued behind "slow" on its lane, so it would
    # start after the failure is known: it must not run.
    g.add_task("independent_later", TaskKind.D2H, lambda ctx: ran.append("x"))
    with pipeoff.testing.hold_task("slow") as release:
        ex = pipeoff.execute(g)
        holder.append(ex)
        release.set()
        with pytest.raises(ValueError):
            ex.wait(timeout=30)
    assert ran == []
    assert {r.name: r.status for r in ex.trace.tasks}["independent_later"] == "cancelled"


def test_delayed_lane_turns_a_missing_dependency_into_a_wrong_number() -> None:
    """The harness that the feature tests rely on: a missing wait shows up."""
    x = torch.zeros(4)

    def produce(ctx: pipeoff.TaskContext) -> None:
        x.fill_(3.0)

    def consume(ctx: pipeoff.TaskContext) -> float:
        return float(x.sum())

    for with_dep, expected in ((True, 12.0), (False, 0.0)):
        x.zero_()
        g = TaskGraph()
        g.add_task("produce", TaskKind.H2D, produce)
        g.add_task("consume", TaskKind.OPTIMIZER_CHUNK, consume,
                   deps=["produce"] if with_dep else [])
        # The producer held (not delayed: a busy machine could still run it first) until
        # the consumer has run, where nothing orders it after the producer.
        with pipeoff.testing.hold_task("produce") as release:
            ex = pipeoff.execute(g)
            if not with_dep:
                ex.wait("consume")
            release.set()
            assert ex.result("consume") == expected


def test_fail_task_hook() -> None:
    g = TaskGraph()
    g.add_task("allreduce:bucket3", TaskKind.ALLREDUCE)
    with pipeoff.testing.fail_task(r"allreduce:bucket\d", OSError("injected")):
        with pytest.raises(OSError, match="injected"):
            pipeoff.execute(g).wait(timeout=30)
    pipeoff.execute(g).wait(timeout=30)  # the hook is gone


@pytest.mark.parametrize("backend", ["threads", "inline"])
def test_fail_work_raises_inside_the_work_after_it_started(backend: str) -> None:
    x = torch.zeros(3)

    def work(ctx: pipeoff.TaskContext) -> None:
        x[0] = 1.0
        x[1] = 2.0
        x[2] = 3.0

    g = TaskGraph()
    g.add_task("allreduce:b0", TaskKind.ALLREDUCE, work)
    g.add_task("after", TaskKind.H2D, lambda ctx: x.mul_(10), deps=["allreduce:b0"])
    sched = Schedule.synchronous() if backend == "inline" else Schedule.pipelined()
    # after_ops=1: the first write happened, the second raised.
    with pipeoff.testing.fail_work("allreduce:b0", OSError("mid-collective"), after_ops=1), \
            pytest.raises(OSError, match="mid-collective"):
        pipeoff.execute(g, sched, backend=backend).wait(timeout=30)  # type: ignore[arg-type]
    assert x.tolist() == [1.0, 0.0, 0.0]  # and "after" did not run
    # Default: the work ran to its end, then the task failed.
    x.zero_()
    with pipeoff.testing.fail_work("allreduce:b0"), \
            pytest.raises(RuntimeError, match="inside the work of 'allreduce:b0'"):
        pipeoff.execute(g, sched, backend=backend).wait(timeout=30)  # type: ignore[arg-type]
    assert x.tolist() == [1.0, 2.0, 3.0]
    with pytest.raises(ConfigError, match="after_ops must be an int >= 0"):
        pipeoff.testing.fail_work("x", after_ops=-1)


def test_fail_work_on_a_cuda_lane(gpu: Gpu) -> None:
    x = gpu.zeros(2)
    g = TaskGraph(device=gpu.device)
    g.add_task("w", TaskKind.OPTIMIZER_CHUNK, lambda ctx: (x.add_(1.0), x.mul_(3.0)))
    with pipeoff.testing.fail_work("w", after_ops=1), pytest.raises(RuntimeError):
        pipeoff.execute(g).wait(timeout=30)
    assert gpu.read(x).tolist() == [1.0, 1.0]  # the add ran on the stream, the mul raised


def test_results_and_context() -> None:
    def write(ctx: pipeoff.TaskContext) -> None:
        ctx.buffer("b", torch.float32).fill_(2.0)

    g = TaskGraph()
    g.add_buffer("b", 16)
    g.add_task("w", TaskKind.H2D, write, buffers=["b"])
    g.add_task("r", TaskKind.D2H, lambda ctx: float(ctx.buffer("b", torch.float32).sum()),
               deps=["w"], buffers=["b"])
    g.add_task("uses_result", TaskKind.HOST, lambda ctx: ctx.results["r"] * 2, deps=["r"])
    ex = pipeoff.execute(g)
    assert ex.result("r") == 8.0
    assert ex.result("uses_result") == 16.0
    with pytest.raises(ConfigError, match="unknown task 'nope'"):
        ex.result("nope")


def test_undeclared_buffer_access_is_named() -> None:
    g = TaskGraph()
    g.add_task("t", TaskKind.H2D, lambda ctx: ctx.buffer("missing"))
    with pytest.raises(pipeoff.GraphError, match="task 't' asked for buffer 'missing'"):
        pipeoff.execute(g).wait(timeout=30)


def test_events_for_completion_handles() -> None:
    gate = threading.Event()
    g = TaskGraph()
    g.add_task("slow", TaskKind.OPTIMIZER_CHUNK, lambda ctx: gate.wait(30))
    g.add_task("fast", TaskKind.D2H)
    ex = pipeoff.execute(g)
    slow, fast = ex.events_for(["slow", "fast"])
    fast.synchronize()
    assert fast.query() and not slow.query()
    assert slow.task == "slow"
    gate.set()
    slow.wait()  # no stream on CPU: blocks the host until done
    assert slow.query()


def test_async_work_is_refused_not_left_unawaited() -> None:
    async def rpc(ctx: pipeoff.TaskContext) -> str:
        return "committed"

    g = TaskGraph()
    with pytest.raises(ConfigError, match="work is an async function"):
        g.add_task("should_commit", TaskKind.HOST, rpc)
    # One add_task cannot recognize: it fails at run time, the coroutine closed.
    g.add_task("should_commit", TaskKind.HOST, lambda ctx: rpc(ctx))
    with pytest.raises(ConfigError, match="returned an awaitable"):
        pipeoff.execute(g).wait(timeout=30)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_wait_async(anyio_backend: str) -> None:
    import anyio

    gate = threading.Event()
    g = TaskGraph()
    g.add_task("slow", TaskKind.D2H, lambda ctx: gate.wait(30))
    ex = pipeoff.execute(g)
    ticks = 0
    async with anyio.create_task_group() as tg:
        async def ticker() -> None:
            nonlocal ticks
            for _ in range(3):
                await anyio.sleep(0.01)
                ticks += 1
            gate.set()

        tg.start_soon(ticker)
        await ex.wait_async(timeout=30)  # the loop keeps running meanwhile
    assert ticks == 3 and ex.done()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_wait_async_reraises(anyio_backend: str) -> None:
    g = TaskGraph()
    g.add_task("bad", TaskKind.ALLREDUCE, _raises_boom)
    ex = pipeoff.execute(g)
    with pytest.raises(ValueError, match="boom"):
        await ex.wait_async()


def test_max_in_flight_bounds_tasks_in_flight() -> None:
    running = 0
    peak = 0
    lock = threading.Lock()

    overlap = threading.Condition(lock)
    wait_for_company = False

    def work(ctx: pipeoff.TaskContext) -> None:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
            overlap.notify_all()
            if wait_for_company:
                # Unbounded: tasks on other lanes start meanwhile (event-ordered,
                # not a sleep racing the other lanes).
                overlap.wait_for(lambda: peak > 1, timeout=30)
            running -= 1

    g = TaskGraph()
    for k in range(12):
        g.add_task(f"t{k}", list(TaskKind)[k % 4], work)  # 4 lanes, no deps
    pipeoff.execute(g, Schedule.pipelined(max_in_flight=1)).wait(timeout=30)
    assert peak == 1
    peak = 0
    wait_for_company = True
    pipeoff.execute(g, Schedule.pipelined()).wait(timeout=30)
    assert peak > 1


def test_staging_is_allocated_once_and_reused() -> None:
    def build() -> TaskGraph:
        g = TaskGraph()
        for k in range(4):
            g.add_buffer(f"s{k}", 1 << 16)
            g.add_task(f"in{k}", TaskKind.H2D, buffers=[f"s{k}"])
            g.add_task(f"out{k}", TaskKind.D2H, deps=[f"in{k}"], buffers=[f"s{k}"])
        return g

    pool = pools_for("cpu").device
    pipeoff.execute(build(), Schedule.pipelined(device_budget_bytes=2 << 16)).wait(timeout=30)
    before = pool.stats().allocations
    for _ in range(3):
        pipeoff.execute(build(), Schedule.pipelined(device_budget_bytes=2 << 16)).wait(timeout=30)
    assert pool.stats().allocations == before
    assert pool.stats().live_bytes == 0


def test_pool_accounting_and_pinned_fallback_logs_once(caplog: pytest.LogCaptureFixture) -> None:
    import pipeoff.staging as staging

    staging._pin_warned = False
    with warnings.catch_warnings(record=True) as caught, caplog.at_level("INFO", "pipeoff"):
        warnings.simplefilter("always")
        p1 = StagingPool("cpu", pinned=True)
        StagingPool("cpu", pinned=True)
    if torch.cuda.is_available():
        assert p1.pinned
        return
    assert not p1.pinned
    # Information through the "pipeoff" logger, once, and no warning: nothing to act on.
    assert not [w for w in caught if "pinned" in str(w.message)]
    assert [r.getMessage() for r in caplog.records].count(caplog.records[0].getMessage()) == 1
    assert "pinned host memory" in caplog.records[0].getMessage()
    a = p1.acquire(100)
    b = p1.acquire(50)
    assert p1.stats().live_bytes == 150 and p1.stats().peak_live_bytes == 150
    p1.release(a)
    assert p1.stats().live_bytes == 50 and p1.stats().peak_live_bytes == 150
    c = p1.acquire(90)  # reuses a's 100-byte block
    assert c is a and p1.stats().allocations == 2
    p1.release(b)
    p1.release(c)
    assert p1.trim() == 150 and p1.stats().reserved_bytes == 0


def test_backend_choice() -> None:
    g = TaskGraph()
    g.add_task("t", TaskKind.HOST)
    assert pipeoff.execute(g, Schedule.synchronous()).backend == "inline"
    assert pipeoff.execute(g).backend == "threads"
    with pytest.raises(ConfigError, match="backend must be one of"):
        pipeoff.execute(g, backend="gpu")  # type: ignore[arg-type]
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="backend='cuda' needs a graph on a CUDA device"):
            pipeoff.execute(g, backend="cuda")
    with pytest.raises(ConfigError, match="schedule must be a pipeoff.Schedule"):
        pipeoff.execute(g, "pipelined")  # type: ignore[arg-type]


def test_inline_runs_on_the_callers_thread() -> None:
    me = threading.get_ident()
    g = TaskGraph()
    g.add_task("t", TaskKind.HOST, lambda ctx: threading.get_ident())
    assert pipeoff.execute(g, backend="inline").result("t") == me
    assert pipeoff.execute(g, backend="threads").result("t") != me


def test_an_idle_lane_keeps_nothing_of_its_last_execution() -> None:
    # An idle lane that kept its last items kept their execution alive, and all its
    # graph's work closes over: a StateTransfer's process group, which then outlived
    # destroy_process_group into interpreter finalization (issue 37).
    import gc
    import weakref

    from pipeoff.executor import threads

    class Held:
        pass

    held = Held()
    ref = weakref.ref(held)
    ran = threading.Event()
    parked = threading.Event()

    class Watched:
        """The lane's queue, telling when the lane asks it for the batch after ours."""

        def __init__(self, q: Any) -> None:
            self._q = q

        def put(self, items: Any) -> None:
            self._q.put(items)

        def get(self) -> Any:
            if ran.is_set():
                parked.set()
            return self._q.get()

    first = TaskGraph()
    first.add_task("t", TaskKind.HOST, lambda ctx: None, lane="issue37-idle")
    pipeoff.execute(first, backend="threads").wait(timeout=30)
    (worker,) = threads._lanes["issue37-idle"]
    worker._q = Watched(worker._q)  # type: ignore[assignment]
    g = TaskGraph()
    g.add_task("t", TaskKind.HOST, lambda ctx, h=held: ran.set(), lane="issue37-idle")
    ex = pipeoff.execute(g, backend="threads")
    ex.wait(timeout=30)
    del ex, g, held
    # Parked again (waiting for the next batch): what it keeps while idle, it keeps
    # for good.
    assert parked.wait(30)
    gc.collect()
    assert ref() is None


def test_lane_threads_are_created_once() -> None:
    from pipeoff.executor.threads import lane_threads

    g = TaskGraph()
    for kind in TaskKind:
        g.add_task(kind.value, kind)
    pipeoff.execute(g).wait(timeout=30)
    first = dict(lane_threads())
    for _ in range(5):
        pipeoff.execute(g).wait(timeout=30)
    assert lane_threads() == first


def test_concurrent_executions_do_not_deadlock() -> None:
    def build(tag: str) -> TaskGraph:
        g = TaskGraph()
        prev: list[str] = []
        for k in range(30):
            name = f"{tag}{k}"
            g.add_task(name, list(TaskKind)[k % 5], lambda ctx: time.sleep(0.0005), deps=prev)
            prev = [name]
        return g

    results: list[BaseException | None] = []

    def launch(tag: str, max_in_flight: int | None) -> None:
        try:
            pipeoff.execute(build(tag),
                            Schedule.pipelined(max_in_flight=max_in_flight)).wait(timeout=60)
            results.append(None)
        except BaseException as err:  # noqa: BLE001
            results.append(err)

    threads = [threading.Thread(target=launch, args=(f"x{i}", 3 if i % 2 else None))
               for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert results == [None] * 6


class _FakeEvent:
    """Stands in for a CUDA event at the pool's unit edge (CPU torch has none)."""

    def __init__(self) -> None:
        self.synchronized = False

    def synchronize(self) -> None:
        self.synchronized = True


def test_pool_keeps_an_unmet_reuse_marker_and_trim_waits_for_it() -> None:
    pool = StagingPool("cpu")
    first = _FakeEvent()
    block = pool.acquire(64)
    pool.release(block, first)  # its last user's end event
    again = pool.acquire(64)
    assert again is block and again.ready is first
    pool.release(again, None)  # a cancelled user that never ran sets no new marker
    assert block.ready is first  # so the next user still waits for the old one
    pool.forget_events({first})
    assert block.ready is None
    pool.release(pool.acquire(64), first)
    assert pool.trim() == 64 and first.synchronized


def test_a_failure_under_a_window_keeps_the_staging_of_running_tasks() -> None:
    """The dispatcher must not cancel (and so release) a block a running task writes."""
    inside, release = threading.Event(), threading.Event()

    def bad(ctx: pipeoff.TaskContext) -> None:
        assert inside.wait(10)
        raise ValueError("boom")

    g = TaskGraph()
    g.add_buffer("b", 4096)
    g.add_task("t0", TaskKind.ALLREDUCE, bad)
    g.add_task("t1", TaskKind.H2D, lambda ctx: (inside.set(), release.wait(10)), buffers=["b"])
    g.add_task("t2", TaskKind.D2H, lambda ctx: None, buffers=["b"])
    pool = pools_for("cpu").device
    before = pool.stats().live_bytes
    ex = pipeoff.execute(g, Schedule.pipelined(max_in_flight=2))
    assert inside.wait(10)
    while ex.exception is None:
        time.sleep(0.001)
    # t1 is still writing b: for as long as it runs, b stays out of the pool.
    for _ in range(50):
        assert pool.stats().live_bytes == before + 4096
        time.sleep(0.005)
    release.set()
    with pytest.raises(ValueError, match="boom"):
        ex.wait(timeout=30)
    assert [r.status for r in ex.trace.tasks] == ["failed", "ok", "cancelled"]
    assert pool.stats().live_bytes == before


def test_a_lane_may_be_named_like_pipeoffs_own_threads() -> None:
    g = TaskGraph()
    for k in range(3):
        g.add_task(f"t{k}", TaskKind.HOST, lane="dispatch", deps=[f"t{k - 1}"] if k else [])
    pipeoff.execute(g, Schedule.pipelined(max_in_flight=1), backend="threads").wait(timeout=30)


@pytest.mark.parametrize("lane", ["", 5])
def test_a_bad_lane_is_refused(lane: object) -> None:
    with pytest.raises(ConfigError, match="lane must be a non-empty string"):
        TaskGraph().add_task("t", TaskKind.HOST, lane=lane)  # type: ignore[arg-type]


@pytest.mark.parametrize("timeout", [float("nan"), "1", -1])
def test_a_bad_wait_timeout_is_refused(timeout: object) -> None:
    g = TaskGraph()
    g.add_task("t", TaskKind.HOST)
    ex = pipeoff.execute(g)
    with pytest.raises(ConfigError, match="timeout must be a number >= 0"):
        ex.wait(timeout=timeout)  # type: ignore[arg-type]
    ex.wait()


def test_a_bad_graph_device_is_refused() -> None:
    with pytest.raises(ConfigError, match="device must be a torch.device"):
        TaskGraph(device="bogus")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without CUDA")
def test_a_cuda_graph_without_cuda_is_refused_clearly() -> None:
    g = TaskGraph(device="cuda")
    g.add_task("t", TaskKind.HOST)
    with pytest.raises(ConfigError, match="no usable CUDA device"):
        pipeoff.execute(g)


def test_waiting_from_a_task_on_its_own_lane_is_refused_not_a_deadlock() -> None:
    """A task waiting for a task of its own execution queued behind it on its lane could
    never see it run: refused. Another execution, on the same lane names, gets lane
    instances of its own and runs: nested executions work."""
    handle: list[pipeoff.Execution] = []
    ready = threading.Event()

    def first(ctx: pipeoff.TaskContext) -> None:
        ready.wait(30)
        handle[0].wait("second")

    g = TaskGraph()
    g.add_task("first", TaskKind.HOST, first)
    g.add_task("second", TaskKind.HOST, lambda c: None)  # queued behind, same lane
    handle.append(pipeoff.execute(g))
    ready.set()
    with pytest.raises(ConfigError, match="queued on that same lane behind the caller"):
        handle[0].wait(timeout=30)

    def outer(ctx: pipeoff.TaskContext) -> int:
        inner = TaskGraph()
        inner.add_task("inner", TaskKind.HOST, lambda c: 1)  # the same lane name: "host"
        return pipeoff.execute(inner).result("inner")  # type: ignore[no-any-return]

    g2 = TaskGraph()
    g2.add_task("outer", TaskKind.HOST, outer)
    assert pipeoff.execute(g2).result("outer") == 1


def test_an_execution_waiting_on_its_lanes_never_blocks_another() -> None:
    """Issue 10, input 4, at the executor: execution A's h2d task waits for a gate (a
    commit that needs a peer); execution B's h2d task, launched after it, runs anyway.
    A task blocked inside its work (a collective waiting for its peer) likewise holds
    only its own execution's lane: two such executions meet instead of deadlocking."""
    gate = threading.Event()
    a = TaskGraph()
    a.add_task("decide", TaskKind.HOST, lambda c: gate.wait(30))
    a.add_task("write_back", TaskKind.H2D, lambda c: None, deps=["decide"])
    b = TaskGraph()
    b.add_task("copy", TaskKind.H2D, lambda c: 7)
    ex_a = pipeoff.execute(a)
    ex_b = pipeoff.execute(b)
    assert ex_b.result("copy") == 7  # not queued behind A's write-back
    assert not ex_a.done()
    gate.set()
    ex_a.wait(timeout=30)

    # Two "collectives" that each wait for the other, on the same lane name.
    met = threading.Barrier(2, timeout=30)
    pair = []
    for name in ("x", "y"):
        g = TaskGraph()
        g.add_task(f"allreduce:{name}", TaskKind.ALLREDUCE, lambda c: met.wait())
        pair.append(pipeoff.execute(g))
    for ex in pair:
        ex.wait(timeout=30)


def test_lane_instances_are_reused_once_free() -> None:
    from pipeoff.executor.threads import lane_instances

    def run_once() -> None:
        g = TaskGraph()
        g.add_task("t", TaskKind.D2H, lambda c: None)
        pipeoff.execute(g).wait()

    run_once()
    before = lane_instances()
    for _ in range(20):
        run_once()
    assert lane_instances() == before  # sequential executions share the first instance


def test_idle_lane_threads_are_reaped(monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeoff.executor import threads

    g = TaskGraph()
    for k in range(3):
        g.add_task(f"t{k}", TaskKind.HOST, lambda ctx: None, lane=f"one-off-{k}")
    pipeoff.execute(g).wait(timeout=30)
    workers = {lane: ws[0]._thread for lane, ws in threads._lanes.items()
               if lane.startswith("one-off-")}
    assert len(workers) == 3
    # Used recently: kept (a lane reused within LANE_IDLE_S keeps its thread).
    assert not [n for n in threads.reap_idle(threads.LANE_IDLE_S) if "one-off" in n]
    # The next release reaps what has been idle longer than LANE_IDLE_S.
    monkeypatch.setattr(threads, "LANE_IDLE_S", 0.0)
    pipeoff.execute(TaskGraph()).wait(timeout=30)  # no lanes: releases nothing
    g2 = TaskGraph()
    g2.add_task("other", TaskKind.HOST, lambda ctx: None, lane="one-off-other")
    pipeoff.execute(g2).wait(timeout=30)
    deadline = time.monotonic() + 10
    for t in workers.values():
        t.join(max(0.0, deadline - time.monotonic()))
        assert not t.is_alive()
    assert not any(lane.startswith("one-off-") for lane in threads.lane_instances())
    # A reaped lane comes back on demand.
    pipeoff.execute(g).wait(timeout=30)


def test_hold_task_refuses_an_inline_execution() -> None:
    g = TaskGraph()
    g.add_task("a", TaskKind.HOST, lambda ctx: None)
    with pipeoff.testing.hold_task("a"), pytest.raises(ConfigError, match="inline"):
        pipeoff.execute(g, Schedule.synchronous())


def test_fail_work_fires_once_and_never_silently_skips() -> None:
    x = torch.zeros(3)
    cleaned: list[bool] = []

    def work(ctx: pipeoff.TaskContext) -> None:
        try:
            x.add_(1.0)
            x.add_(1.0)
        finally:
            x.zero_()  # cleanup after the injected failure runs normally
            cleaned.append(True)

    g = TaskGraph()
    g.add_task("a", TaskKind.H2D, work)
    with pipeoff.testing.fail_work("a", after_ops=1), pytest.raises(RuntimeError):
        pipeoff.execute(g).wait(timeout=30)
    assert cleaned == [True] and x.tolist() == [0.0, 0.0, 0.0]
    # More ops asked for than the work makes: it fails once the work returns.
    with pipeoff.testing.fail_work("a", after_ops=50), pytest.raises(RuntimeError):
        pipeoff.execute(g).wait(timeout=30)


@pytest.mark.parametrize("how", ["staging", "injected"])
@pytest.mark.parametrize("schedule", ["pipelined", "synchronous"])
def test_a_must_run_task_runs_after_its_own_failure_to_start(how: str, schedule: str) -> None:
    """A collective every rank joins (must_run) whose staging could not be allocated, or
    whose start failed (an injected failure; a Ctrl-C landing in an injected delay): its
    work runs anyway, without the buffer, and sees the failure. Cancelled, it left its
    peers waiting in the collective until the group's timeout."""
    seen: list[tuple[type, bool]] = []
    g = TaskGraph()
    g.add_buffer("wire", 64)
    g.add_task("exchange", TaskKind.HOST, lambda ctx: seen.append(
        (type(ctx.failed), "wire" in ctx.buffers)), buffers=["wire"], must_run=True)
    sched = Schedule.synchronous() if schedule == "synchronous" else Schedule.pipelined()
    real = StagingPool.acquire

    def oom(pool: StagingPool, nbytes: int) -> object:
        raise torch.OutOfMemoryError("injected: out of memory allocating staging")

    fault = (pytest.MonkeyPatch.context() if how == "staging"
             else pipeoff.testing.fail_task("exchange", MemoryError("injected")))
    with fault as mp:
        if how == "staging":
            mp.setattr(StagingPool, "acquire", oom)
        ex = pipeoff.execute(g, sched)
        with pytest.raises(torch.OutOfMemoryError if how == "staging" else MemoryError):
            ex.wait(timeout=30)
    assert StagingPool.acquire is real
    assert seen == [(torch.OutOfMemoryError if how == "staging" else MemoryError,
                     how != "staging")]
    assert ex.trace.summary() is not None

