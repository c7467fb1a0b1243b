"""The interface every executor backend implements, and the host-side base."""

from __future__ import annotations

from typing import Any, Protocol

from pipeoff.executor._run import Run


class Backend(Protocol):
    """How a plan's tasks are issued and how their completion is observed."""

    name: str

    def launch(self, run: Run) -> None:
        """Issue the plan. Returns once issuing is done or handed to a background thread."""

    def query(self, run: Run, i: int) -> bool:
        """Whether task ``i`` has finished, without blocking."""

    def synchronize(self, run: Run, i: int, deadline: float | None) -> bool:
        """Block the host until task ``i`` has finished; False if the deadline passed."""

    def synchronize_all(self, run: Run, deadline: float | None) -> bool:
        """After every task is issued and host-terminal, block until the device is done too."""

    def stream_wait(self, run: Run, i: int, stream: Any) -> None:
        """Make ``stream`` wait for task ``i`` (blocks the host on host backends)."""

    def resolve_times(self, run: Run) -> None:
        """Fill ``run.start_ns``/``run.end_ns`` from device timers, if any."""

    def finalize(self, run: Run) -> None:
        """Return per-run resources (events) once every task is complete."""

    def check_wait(self, run: Run, i: int | None) -> None:
        """Refuse (``ConfigError``) a host wait for task ``i`` (or all) that can never end."""


class HostBackend:
    """Shared behaviour of backends whose tasks complete on the host."""

    name = "host"

    def query(self, run: Run, i: int) -> bool:
        return run.terminal(i)

    def synchronize(self, run: Run, i: int, deadline: float | None) -> bool:
        return run.wait_terminal(i, deadline)

    def synchronize_all(self, run: Run, deadline: float | None) -> bool:
        return True

    def stream_wait(self, run: Run, i: int, stream: Any) -> None:
        # No device stream carries host work: the reader must block until the
        # task is done, or it would read a buffer the lane is still writing.
        run.wait_terminal(i)

    def resolve_times(self, run: Run) -> None:
        return None

    def finalize(self, run: Run) -> None:
        return None

    def check_wait(self, run: Run, i: int | None) -> None:
        return None
