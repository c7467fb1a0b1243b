"""At interpreter exit pipeoff drains and joins its threads before CPython finalizes.

A daemon thread still alive during finalization can abort the process
("terminate called without an active exception") when torch re-takes the GIL
on it; the FSDP2 test processes hit this about one exit in four before the fix.
The abort itself is a race, so these tests check what prevents it, which is
deterministic: no pipeoff thread is left when finalization begins, and work
launched just before exit has finished.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow  # each test runs a Python interpreter (subprocess)

SCRIPT = textwrap.dedent(
    """
    import atexit, threading

    def check():
        # Registered before pipeoff's handler, so it runs after it (atexit is LIFO).
        alive = sorted(t.name for t in threading.enumerate() if t.name.startswith("pipeoff-"))
        print("alive:", alive, flush=True)

    atexit.register(check)

    import time
    import pipeoff
    from pipeoff import Schedule, TaskGraph, TaskKind

    def rpc(ctx):
        time.sleep(0.05)

    g = TaskGraph()
    g.add_task("copy", TaskKind.D2H, lambda ctx: time.sleep(0.5))  # still running at exit
    g.add_task("rpc", TaskKind.HOST, rpc, deps=["copy"])
    g.add_task("last", TaskKind.HOST, lambda ctx: print("landed", flush=True), deps=["rpc"])
    pipeoff.execute(g, SCHEDULE, backend="threads")  # deliberately not waited for
    print("main done", flush=True)
    """
)


@pytest.mark.parametrize(
    "schedule", ["Schedule.synchronous()", "Schedule.pipelined(max_in_flight=1)"],
    ids=["all_at_once", "windowed"],
)
def test_exit_lets_queued_work_land_and_leaves_no_thread(schedule: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT.replace("SCHEDULE", schedule)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "main done" in lines
    assert "landed" in lines, proc.stdout
    assert lines[-1] == "alive: []", proc.stdout


def test_exit_warns_and_gives_up_on_a_lane_that_never_finishes() -> None:
    script = textwrap.dedent(
        """
        import threading
        import pipeoff
        import pipeoff.executor._exit as ex
        from pipeoff import TaskGraph, TaskKind

        ex.EXIT_TIMEOUT_S = 0.5
        never = threading.Event()
        g = TaskGraph()
        g.add_task("stuck", TaskKind.HOST, lambda ctx: never.wait())
        pipeoff.execute(g, backend="threads")
        """
    )
    proc = subprocess.run([sys.executable, "-W", "always", "-c", script],
                          capture_output=True, text=True, timeout=120)
    assert "still running after waiting" in proc.stderr, proc.stderr
    assert "pipeoff-host" in proc.stderr, proc.stderr


UNRAISED = textwrap.dedent(
    """
    import contextlib, sys, torch
    from pipeoff import testing
    from pipeoff.optim import FullOffloadOptimizer, OffloadOptimizer

    kind, how = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    m = torch.nn.Linear(8, 8)
    if kind == "full":
        m = m.to(torch.bfloat16)
        opt = FullOffloadOptimizer(m, torch.optim.AdamW, lr=1e-2, overlap="forward")
    else:
        opt = OffloadOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-2), overlap="forward")
    with testing.fail_task("step:.*|opt.*", RuntimeError("the injected failure")):
        m(torch.randn(2, 8).to(m.weight.dtype)).float().sum().backward()
        opt.step()  # returns: the failure comes on a lane, after it
        opt.zero_grad()
    if how == "waited":
        with contextlib.suppress(RuntimeError):
            opt.wait_for_step()  # (raises it: the caller has it)
    elif how == "raised_elsewhere":  # (a tester's finds: these raised it, and exit said not)
        with contextlib.suppress(RuntimeError):
            opt.grad_norm if kind == "full" else opt.last_execution.wait()
    print("main done", flush=True)
    """
)


@pytest.mark.parametrize("kind", ["offload", "full"])
@pytest.mark.parametrize("how", ["never_waited", "waited", "raised_elsewhere"])
def test_exit_says_what_a_failed_last_step_raised_nowhere(kind: str, how: str) -> None:
    """The last step of a loop failed on a lane after ``step()`` returned, and nothing
    came after it to raise the failure: the script ended with status 0 and no word
    (a tester's find). Exit says so, as asyncio's "exception was never retrieved";
    a failure raised to the caller is not repeated."""
    proc = subprocess.run([sys.executable, "-c", UNRAISED, kind, how],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "main done" in proc.stdout
    said = "nothing raised its failure" in proc.stderr
    assert said == (how == "never_waited"), proc.stderr
    if said:
        name = "FullOffloadOptimizer" if kind == "full" else "OffloadOptimizer"
        assert f"the last step of a {name} failed" in proc.stderr
        assert "the injected failure" in proc.stderr
