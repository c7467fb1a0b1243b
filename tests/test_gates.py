"""Gates: inputs that reach a launched execution from outside it."""

from __future__ import annotations

import contextlib
import random
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pipeoff
import pipeoff.testing
from pipeoff import ConfigError, GraphError, Schedule, TaskGraph, TaskKind
from pipeoff.trace import Trace
from tests.gpu_device import Gpu


def gated_copy() -> tuple[TaskGraph, torch.Tensor]:
    out = torch.zeros(4)
    g = TaskGraph()
    g.add_gate("grad")
    g.add_task("copy", TaskKind.D2H, lambda ctx: out.copy_(ctx.gate("grad")), gates=["grad"])
    g.add_task("double", TaskKind.OPTIMIZER_CHUNK, lambda ctx: out.mul_(2), deps=["copy"])
    return g, out


def test_a_task_starts_only_once_its_gate_is_open() -> None:
    g, out = gated_copy()
    ex = pipeoff.execute(g)
    assert ex.gate("grad").state == "pending"
    with pytest.raises(pipeoff.StepTimeoutError, match="not yet opened: 'grad'") as info:
        ex.wait(timeout=0.05)
    assert info.value.pending_gates == ("grad",)
    assert not ex.done("copy")
    ex.gate("grad").open(torch.ones(4))
    ex.wait()
    assert torch.equal(out, torch.full((4,), 2.0))
    assert ex.gate("grad").state == "open"


def test_a_gate_opened_before_anyone_waits_lets_its_task_run_at_once() -> None:
    g, out = gated_copy()
    ex = pipeoff.execute(g)
    ex.gate("grad").open(torch.full((4,), 3.0))
    ex.wait()
    assert torch.equal(out, torch.full((4,), 6.0))


def test_a_gate_closed_empty_gives_its_tasks_none() -> None:
    seen = []
    g = TaskGraph()
    g.add_gate("grad")
    g.add_task("copy", TaskKind.D2H, lambda ctx: seen.append(ctx.gate("grad")), gates=["grad"])
    ex = pipeoff.execute(g)
    ex.gate("grad").close()
    ex.wait()
    assert seen == [None] and ex.gate("grad").state == "closed"


def test_a_failed_gate_fails_the_execution_and_nothing_behind_it_runs() -> None:
    g, out = gated_copy()
    ex = pipeoff.execute(g)
    err = RuntimeError("the backward raised")
    ex.gate("grad").fail(err)
    with pytest.raises(RuntimeError, match="the backward raised") as info:
        ex.wait()
    assert info.value is err and any("gate 'grad'" in n for n in err.__notes__)
    assert ex.failed_task == "grad"
    statuses = {t.name: t.status for t in ex.trace.tasks}
    assert statuses == {"copy": "cancelled", "double": "cancelled", "grad": "failed"}
    assert torch.equal(out, torch.zeros(4))


def test_a_task_failure_releases_tasks_waiting_on_gates_that_never_open() -> None:
    """No lane is left waiting forever for a gate after the execution failed."""
    g = TaskGraph()
    g.add_gate("never")
    g.add_task("boom", TaskKind.H2D, lambda ctx: 1 / 0)
    g.add_task("gated", TaskKind.OPTIMIZER_CHUNK, lambda ctx: None, gates=["never"])
    ex = pipeoff.execute(g)
    with pytest.raises(ZeroDivisionError):
        ex.wait(timeout=30)
    statuses = {t.name: t.status for t in ex.trace.tasks}
    assert statuses == {"boom": "failed", "gated": "cancelled", "never": "cancelled"}


def test_a_must_run_task_does_not_wait_for_its_gates_after_a_failure() -> None:
    seen = []
    g = TaskGraph()
    g.add_gate("peer")
    g.add_task("boom", TaskKind.H2D, lambda ctx: 1 / 0)
    g.add_task("collective", TaskKind.ALLREDUCE,
               lambda ctx: seen.append((ctx.gate("peer"), type(ctx.failed))),
               gates=["peer"], must_run=True)
    ex = pipeoff.execute(g)
    with pytest.raises(ZeroDivisionError):
        ex.wait(timeout=30)
    assert seen == [(None, ZeroDivisionError)]


def test_misuse_is_refused_clearly() -> None:
    g, _ = gated_copy()
    ex = pipeoff.execute(g)
    with pytest.raises(ConfigError, match="unknown gate 'grads'.*'grad'"):
        ex.gate("grads")
    ex.gate("grad").open(torch.ones(4))
    with pytest.raises(ConfigError, match="gate 'grad' is already open"):
        ex.gate("grad").close()
    with pytest.raises(ConfigError, match="takes an exception"):
        ex.gate("grad").fail("nope")  # type: ignore[arg-type]
    ex.wait()
    with pytest.raises(ConfigError, match="gate name must be a non-empty string"):
        TaskGraph().add_gate("")


def test_graph_validation_names_the_gate() -> None:
    g = TaskGraph()
    g.add_gate("grad")
    with pytest.raises(GraphError, match="gates and tasks share one namespace"):
        g.add_task("grad", TaskKind.HOST)
    with pytest.raises(GraphError, match="gates and tasks share one namespace"):
        g.add_gate("grad")
    g.add_task("a", TaskKind.HOST, deps=["grad"])
    with pytest.raises(GraphError, match="unknown task 'grad' \\(it is a gate: list it in gates"):
        g.validate()
    g2 = TaskGraph()
    g2.add_task("a", TaskKind.HOST)
    g2.add_task("b", TaskKind.HOST, gates=["a"])
    with pytest.raises(GraphError, match="unknown gate 'a' \\(it is a task: list it in deps"):
        g2.validate()
    g3 = TaskGraph()
    g3.add_gate("lonely")
    g3.add_task("a", TaskKind.HOST)
    with pytest.raises(GraphError, match="gate 'lonely' is declared but no task waits on it"):
        g3.validate()


def test_a_synchronous_schedule_with_gates_runs_off_the_callers_thread() -> None:
    g, out = gated_copy()
    with pytest.raises(ConfigError, match="backend='inline' cannot run a graph with gates"):
        pipeoff.execute(g, Schedule.synchronous(), backend="inline")
    ex = pipeoff.execute(g, Schedule.synchronous())
    assert ex.backend == "threads"
    ex.gate("grad").open(torch.ones(4))
    ex.wait()
    assert torch.equal(out, torch.full((4,), 2.0))


def test_the_trace_records_the_gate_wait() -> None:
    g, _ = gated_copy()
    ex = pipeoff.execute(g)
    # Event-ordered: open only once the lane is known to be waiting on the gate.
    waiting = ex._run.gates
    deadline = time.monotonic() + 10
    while waiting.first_wait_ns[0] is None and time.monotonic() < deadline:
        time.sleep(0.001)
    time.sleep(0.02)
    ex.gate("grad").open(torch.ones(4))
    trace = ex.trace
    gate = next(t for t in trace.tasks if t.name == "grad")
    copy = next(t for t in trace.tasks if t.name == "copy")
    assert gate.kind == "gate" and gate.duration_ns >= 20_000_000
    assert copy.gates == ("grad",) and copy.start_ns >= gate.end_ns
    summary = trace.summary()
    assert summary.tasks == 2 and summary.gates == 1
    assert summary.gate_wait_total_us >= 20_000
    # The lanes' busy time and the makespan are the tasks', not the gate's.
    assert "gates" not in dict(summary.lane_busy_us)
    assert "gate waits" in summary.format()


def test_gates_survive_a_saved_trace(tmp_path) -> None:  # type: ignore[no-untyped-def]
    g, _ = gated_copy()
    ex = pipeoff.execute(g)
    ex.gate("grad").open(torch.ones(4))
    path = ex.trace.save(tmp_path / "t.json")
    loaded = Trace.load(path)
    assert next(t for t in loaded.tasks if t.name == "copy").gates == ("grad",)
    assert loaded.summary().gates == 1


def test_the_simulator_opens_every_gate_at_launch() -> None:
    g = TaskGraph()
    g.add_gate("grad")
    g.add_task("copy", TaskKind.D2H, nbytes=1 << 20, gates=["grad"])
    ex = pipeoff.execute(g, backend="sim")
    ex.wait()
    assert ex.gate("grad").state == "open"
    assert ex.trace.summary().gate_wait_total_us == 0


# -- property: random DAGs, gates opened in random order from other threads ---------
@st.composite
def gated_dags(draw: st.DrawFn) -> tuple[int, list[list[int]], int, list[list[int]], int]:
    n = draw(st.integers(1, 12))
    deps = [sorted(draw(st.sets(st.integers(0, i - 1), max_size=3))) if i else []
            for i in range(n)]
    n_gates = draw(st.integers(1, 5))
    gates = [sorted(draw(st.sets(st.integers(0, n_gates - 1), max_size=2))) for _ in range(n)]
    seed = draw(st.integers(0, 2**16))
    return n, deps, n_gates, gates, seed


@settings(max_examples=40, deadline=None)
@given(gated_dags(), st.sampled_from(["pipelined", "synchronous"]))
def test_random_dags_with_gates_opened_from_other_threads(
        dag: tuple[int, list[list[int]], int, list[list[int]], int], schedule: str) -> None:
    n, deps, n_gates, gates, seed = dag
    rng = random.Random(seed)
    kinds = list(TaskKind)
    lock = threading.Lock()
    done: set[int] = set()
    opened: set[int] = set()
    violations: list[str] = []
    payload_seen: dict[int, list[object]] = {}

    def work(i: int):  # type: ignore[no-untyped-def]
        def run(ctx: pipeoff.TaskContext) -> None:
            with lock:
                for d in deps[i]:
                    if d not in done:
                        violations.append(f"t{i} started before its dependency t{d}")
                for k in gates[i]:
                    if k not in opened:
                        violations.append(f"t{i} started before gate g{k} opened")
            payload_seen[i] = [ctx.gate(f"g{k}") for k in gates[i]]
            with lock:
                done.add(i)
        return run

    g = TaskGraph()
    used = sorted({k for gs in gates for k in gs})
    for k in used:
        g.add_gate(f"g{k}")
    for i in range(n):
        g.add_task(f"t{i}", rng.choice(kinds), work(i), deps=[f"t{d}" for d in deps[i]],
                   gates=[f"g{k}" for k in gates[i]])
    sched = Schedule.synchronous() if schedule == "synchronous" else Schedule.pipelined()
    ex = pipeoff.execute(g, sched)
    order = used[:]
    rng.shuffle(order)

    def opener(k: int, delay: float) -> None:
        time.sleep(delay)
        with lock:
            opened.add(k)
        ex.gate(f"g{k}").open(("payload", k))

    threads = [threading.Thread(target=opener, args=(k, rng.random() * 0.01)) for k in order]
    for t in threads:
        t.start()
    ex.wait(timeout=30)
    for t in threads:
        t.join()
    assert not violations, violations
    assert done == set(range(n))
    for i in range(n):
        assert payload_seen[i] == [("payload", k) for k in gates[i]]


# -- CUDA: the payload's event ---------------------------------------------------------
def test_a_cuda_lane_waits_for_the_payloads_event(gpu: Gpu) -> None:
    """The producer opens the gate right after enqueuing the payload's writes on its
    own stream: the lane's stream, not the producer, waits for them."""

    def scenario(event_from: str) -> None:
        accel = gpu.accel
        producer = accel.new_stream(gpu.device, name="producer")
        grad = gpu.zeros(1 << 10)
        out = gpu.zeros(1 << 10)
        g = TaskGraph(device=gpu.device)
        g.add_gate("grad")
        g.add_task("copy", TaskKind.D2H, lambda ctx: out.copy_(ctx.gate("grad")),
                   gates=["grad"])
        ex = pipeoff.execute(g)
        producer.wait_stream(gpu.current_stream())  # grad was zeroed on the default stream
        with accel.use_stream(producer):
            accel.sleep(producer, 0.03)  # the backward is still running
            grad.fill_(5.0)
            if event_from == "explicit":
                ev = accel.new_event()
                ev.record(producer)
                ex.gate("grad").open(grad, event=ev)
            else:  # the default: an event on the caller's current stream (producer)
                ex.gate("grad").open(grad)
        ex.wait()
        assert torch.all(gpu.read(out) == 5.0)

    for event_from in ("explicit", "default"):
        scenario(event_from)
        if gpu.simulated:
            with pipeoff.testing.disable("gate_wait"), \
                    pytest.raises(pipeoff.testing.DataRaceError):
                scenario(event_from)
                gpu.synchronize()


# -- from a review that tried to break gates ---------------------------------------
def test_an_event_that_fails_to_synchronize_fails_the_execution_not_the_lane() -> None:
    class StickyError:
        def synchronize(self) -> None:
            raise RuntimeError("CUDA error: an illegal memory access (sticky)")

        def wait(self, stream: object = None) -> None:
            self.synchronize()

    g, _ = gated_copy()
    ex = pipeoff.execute(g)
    ex.gate("grad").open(torch.ones(4), event=StickyError())
    with pytest.raises(RuntimeError, match="illegal memory access"):
        ex.wait(timeout=30)
    g2, out = gated_copy()  # the same lanes go on
    ex2 = pipeoff.execute(g2)
    ex2.gate("grad").open(torch.ones(4))
    ex2.wait(timeout=30)
    assert torch.equal(out, torch.full((4,), 2.0))
    with pytest.raises(ConfigError, match="event must be a CUDA event or a pipeoff.Completion"):
        pipeoff.execute(gated_copy()[0]).gate("grad").open(torch.ones(4), event=torch.ones(1))


def test_a_payload_ready_after_a_task_that_never_ran_is_refused() -> None:
    producer = TaskGraph()
    producer.add_task("boom", TaskKind.H2D, lambda ctx: 1 / 0)
    producer.add_task("produce", TaskKind.OPTIMIZER_CHUNK, lambda ctx: None, deps=["boom"])
    first = pipeoff.execute(producer)
    with pytest.raises(ZeroDivisionError):
        first.wait(timeout=30)
    (done,) = first.events_for("produce")
    assert done.status == "cancelled"
    g, out = gated_copy()
    ex = pipeoff.execute(g)
    ex.gate("grad").open(torch.ones(4), event=done)
    with pytest.raises(RuntimeError, match="gate 'grad'.*'produce'.*cancelled"):
        ex.wait(timeout=30)
    assert torch.equal(out, torch.zeros(4))


def late_producer_failure(device: torch.device | None, wait: str) -> None:
    """The reader's gate opens while the producer's task is still pending; the
    producer fails after. The failure reaches the reader as its gate's refusal
    (full offload's next micro-step must not fold on after the previous one's fold
    failed). The refusal is not the wait: with the wait switched off (the mutation
    tests' runs) the failure still arrives, or the race such a run reports is lost."""
    producer = TaskGraph(device=device)
    producer.add_gate("go")
    producer.add_task("boom", TaskKind.H2D, lambda ctx: 1 / 0, gates=["go"])
    producer.add_task("produce", TaskKind.OPTIMIZER_CHUNK, lambda ctx: None, deps=["boom"])
    first = pipeoff.execute(producer)
    (done,) = first.events_for("produce")
    assert done.status == "pending"
    out = torch.zeros(4, device=device)
    g = TaskGraph(device=device)
    g.add_gate("grad")
    g.add_task("copy", TaskKind.D2H, lambda ctx: out.copy_(ctx.gate("grad")), gates=["grad"])
    with (pipeoff.testing.disable("gate_wait") if wait == "switched_off"
          else contextlib.nullcontext()):
        ex = pipeoff.execute(g)
        ex.gate("grad").open(torch.ones(4, device=device), event=done)
        first.gate("go").open(None)  # the producer fails now, after the reader's gate opened
        with pytest.raises(ZeroDivisionError):
            first.wait(timeout=30)
        with pytest.raises(RuntimeError, match="gate 'grad'.*'produce'.*cancelled"):
            ex.wait(timeout=30)
    assert torch.equal(out.cpu(), torch.zeros(4))


@pytest.mark.parametrize("wait", ["on", "switched_off"])
def test_a_later_failure_of_the_task_a_payload_is_ready_after_reaches_the_reader(
        wait: str) -> None:
    late_producer_failure(None, wait)


@pytest.mark.parametrize("wait", ["on", "switched_off"])
def test_a_later_failure_of_the_task_a_payload_is_ready_after_reaches_a_cuda_reader(
        gpu: Gpu, wait: str) -> None:
    if wait == "switched_off" and not gpu.simulated:
        pytest.skip("the switch is the simulated device's")
    late_producer_failure(gpu.device, wait)


def test_a_gate_opened_after_a_failure_does_not_distort_the_trace() -> None:
    g = TaskGraph()
    g.add_gate("grad")
    g.add_task("boom", TaskKind.H2D, lambda ctx: 1 / 0)
    g.add_task("copy", TaskKind.D2H, lambda ctx: None, gates=["grad"])
    ex = pipeoff.execute(g)
    with pytest.raises(ZeroDivisionError):
        ex.wait(timeout=30)
    # Ordered by events, not by a time budget (a loaded machine can take any time
    # to fail): the failure was recorded before wait() raised, and the gate opens
    # after that. Times are on the trace's clock (ns from the execution's origin).
    failed_by_ns = time.perf_counter_ns() - ex.origin_ns
    time.sleep(0.01)
    opened_at_ns = time.perf_counter_ns() - ex.origin_ns
    ex.gate("grad").open(torch.ones(4))  # late: after the execution failed
    s = ex.trace.summary()
    gate = next(t for t in ex.trace.tasks if t.name == "grad")
    assert gate.status == "cancelled"
    # The wait ended when the execution failed, not when the gate opened late.
    assert gate.end_ns <= failed_by_ns < opened_at_ns, (gate, failed_by_ns, opened_at_ns)
    assert s.critical_path_us <= s.makespan_us + 1
    assert s.gate_wait_total_us <= failed_by_ns / 1e3


def test_a_recorded_region_does_not_wait_for_a_gate_nobody_opened() -> None:
    g, _ = gated_copy()
    with pytest.warns(RuntimeWarning, match="gate.*'grad'.*left out of the trace"):
        with pipeoff.trace.record() as rec:
            ex = pipeoff.execute(g)
        assert rec.trace.summary().tasks == 0
    ex.gate("grad").open(torch.ones(4))
    ex.wait(timeout=30)


@pytest.mark.slow  # runs a Python interpreter (subprocess)
def test_exit_does_not_wait_for_a_gate_nobody_opens() -> None:
    import subprocess
    import sys

    # The child times its own exit handlers (atexit runs them last in, first out:
    # "start" before pipeoff's, "end" after it), so neither the interpreter's start
    # nor a loaded machine's import of torch counts: waiting for the gate would
    # take EXIT_TIMEOUT_S (30 s), not exiting at once takes milliseconds.
    script = (
        "import atexit, time\n"
        "t = []\n"
        "atexit.register(lambda: print(f'exit took {time.monotonic() - t[0]:.3f} s',"
        " flush=True))\n"
        "import torch, pipeoff\n"
        "from pipeoff import TaskGraph, TaskKind\n"
        "g = TaskGraph(); g.add_gate('grad')\n"
        "g.add_task('copy', TaskKind.D2H, lambda ctx: None, gates=['grad'])\n"
        "pipeoff.execute(g)\n"
        "atexit.register(lambda: t.append(time.monotonic()))\n"
        "print('exiting', flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "exiting" in proc.stdout, proc.stderr
    assert "still running" not in proc.stderr
    took = [float(line.split()[2]) for line in proc.stdout.splitlines()
            if line.startswith("exit took")]
    assert len(took) == 1, proc.stdout
    assert took[0] < 15, took  # not EXIT_TIMEOUT_S (30 s) of waiting


def test_the_same_producer_code_runs_under_the_simulator() -> None:
    for backend in ("threads", "sim"):
        g = TaskGraph()
        g.add_gate("grad")
        g.add_task("copy", TaskKind.D2H, nbytes=1 << 20, gates=["grad"])
        ex = pipeoff.execute(g, backend=backend)  # type: ignore[arg-type]
        ex.gate("grad").open(torch.ones(4))  # a no-op under the simulator
        ex.wait(timeout=30)
