"""pipeoff's tests, a package: helpers are imported as ``tests.<path>`` (for example
``from tests.optim.full_reference import Reference``), so they need no edit of the
import path, and processes spawned by a test find them the same way.

Tests that take more than a couple of seconds, start other processes (mp.spawn,
a Python subprocess, an example or a benchmark) or compile with torch.compile
are marked ``slow``: ``./dev test -m "not slow"`` is the quick loop, ``./dev test``
runs everything.
"""
