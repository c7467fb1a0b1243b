"""Transfers that read an optimizer's host state: its next write waits for them."""

from __future__ import annotations

import threading
from typing import Any

from pipeoff._lowlevel import settle

__all__ = ["Readers"]


class Readers:
    """The executions (state transfers) reading an optimizer's host state.

    :meth:`pipeoff.transfer.StateTransfer.launch` registers itself with the
    optimizers whose state it reads (``LiveTensor.from_optimizer``); before the
    optimizer next writes that state (a step, a load), :meth:`wait` blocks until
    they are done. Their failures are theirs to report: they are not raised here.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: list[Any] = []

    def add(self, execution: Any) -> None:
        with self._lock:
            self._running = [e for e in self._running if not e.done()]
            self._running.append(execution)

    def wait(self) -> None:
        """Block until every registered execution is done.

        Raises:
            KeyboardInterrupt: Ctrl-C while waiting; the executions not yet done
                stay registered, so the next :meth:`wait` waits for them.
        """
        with self._lock:
            running = list(self._running)
        for ex in running:
            # Hazard: the next step (or a load) overwriting host state that a
            # transfer launched after the previous step is still copying.
            settle(ex)  # its failure is the transfer's caller's to report
            with self._lock:
                if ex in self._running:
                    self._running.remove(ex)
