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
