"""What the tests that interrupt the main thread (a real SIGINT, or ``interrupt_main()``)
need beyond the signal itself."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def no_collection() -> Iterator[None]:
    """Cyclic garbage collection off for the block (on again after, if it was on).

    Hazard (of the test, not of pipeoff): a collection that the main thread runs
    inside the interrupted wait (any allocation may start one) calls finalizers
    (``weakref.finalize`` callbacks, ``__del__``: torchft's leaked ``Work`` objects,
    pipeoff's hook removers). CPython drops an exception raised in one ("Exception
    ignored in ..."), so a ``KeyboardInterrupt`` that lands there never reaches the
    caller, and a test that holds a task until the interrupt arrives waits forever
    (seen once in a CI run, under load; a slow finalizer that ``gc.collect()`` runs
    in a loop of sliced waits loses a ``pthread_kill`` SIGINT the same way). A
    user's Ctrl-C can be lost like this in any Python program; a second one works.
    """
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()
