"""Ctrl-C held back while work that must not be cut runs on the caller's thread.

A device part of an optimizer step (``offload_fraction < 1``) runs torch's own kernel
on the caller's thread; a ``KeyboardInterrupt`` inside it (CPython raises it at any
bytecode) leaves some parameters stepped and others not: a torn step, where the docs
promise that ``step()`` passes Ctrl-C on after the step, whole. :class:`HeldInterrupt`
holds the signal for the block and passes it on later, to the handler that was
installed (the default one raises ``KeyboardInterrupt``; a trainer's own may set a
flag), with a note saying what was completed first.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["HeldInterrupt", "held_through", "step_note"]


def step_note(completed: bool) -> str:
    """What a Ctrl-C held back during a step's device part says when passed on."""
    how = ("until the step had completed, both parts: it was taken whole" if completed else
           "until the device part had stepped; the host part goes on (call wait_for_step() "
           "to wait for it): the step is taken whole, it has not failed")
    return ("pipeoff: this Ctrl-C came while the step was launched or its device part ran "
            f"on this thread, and was held back {how}, and must not be repeated")


@contextlib.contextmanager
def held_through(what: str) -> Iterator[None]:
    """Hold Ctrl-C back for the block (``what`` it does, for the notes): passed on once
    the block has ended whole, or, if it raised, dropped with a note on its error."""
    held = HeldInterrupt(what)
    with held.passed_on(lambda: f"pipeoff: this Ctrl-C came while {what}, and was held "
                        "back until that had completed whole: it need not be repeated"):
        with held.hold():
            yield


class HeldInterrupt:
    """A SIGINT held back during :meth:`hold` blocks, passed on by :meth:`deliver`; a
    second one during the block is passed on at once.

    On the main thread with a Python handler installed only (Python runs handlers on
    the main thread); elsewhere the blocks run as they are.
    """

    __slots__ = ("_caught", "_depth", "_handler", "_what")

    def __init__(self, what: str = "the step was launched or its device part ran") -> None:
        self._what = what
        """What the blocks do, for the note on an error that came first."""
        self._caught: tuple[int, Any] | None = None
        self._handler: Callable[[int, Any], Any] | None = None
        self._depth = 0

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Hold SIGINT back for the block (not passed on at its end: :meth:`deliver`). A
        block inside another's holds it with the outer one."""
        if self._depth or threading.current_thread() is not threading.main_thread():
            yield
            return
        old = signal.getsignal(signal.SIGINT)
        if not callable(old):
            yield
            return

        def caught(signum: int, frame: Any) -> None:
            if self._caught is None:
                self._caught, self._handler = (signum, frame), old
            else:
                # A second Ctrl-C goes through at once: a block that never ends (a hang
                # in it) must not trap the user; what it cut is theirs to judge.
                self._caught = self._handler = None
                old(signum, frame)

        signal.signal(signal.SIGINT, caught)
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            signal.signal(signal.SIGINT, old)

    def deliver(self, note: str) -> None:
        """Pass a held SIGINT on to the handler it interrupted, adding ``note`` to the
        ``KeyboardInterrupt`` that handler raises (the default one does).

        Raises:
            KeyboardInterrupt: from the handler.
        """
        caught, handler = self._caught, self._handler
        self._caught = self._handler = None
        if caught is None or handler is None:
            return
        try:
            handler(*caught)
        except KeyboardInterrupt as err:
            err.add_note(note)
            raise

    @contextlib.contextmanager
    def passed_on(self, note: Callable[[], str], *, drop_only: bool = False) -> Iterator[None]:
        """Run the block, then :meth:`deliver` a SIGINT held meanwhile with ``note()``; an
        error from the block drops it instead (:meth:`drop`). ``drop_only``: not
        delivered at the block's end (a later ``passed_on`` does)."""
        try:
            yield
        except BaseException as err:
            self.drop(err)
            raise
        if not drop_only:
            self.deliver(note())

    def drop(self, err: BaseException) -> None:
        """A held SIGINT that ``err`` (raised in the meantime) supersedes: say so on it."""
        if self._caught is not None:
            self._caught = self._handler = None
            err.add_note(f"pipeoff: a Ctrl-C came while {self._what}; it was held back, "
                         "and this error came first")
