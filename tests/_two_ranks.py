"""Run a worker in two gloo processes (``mp.spawn``) and collect what each rank reports."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _exit_after(rank: int, worker: Callable[..., None], *args: Any) -> None:
    """Run ``worker``, then leave without the interpreter's teardown: a rank that has
    reported its results sometimes aborted there ("terminate called without an
    active exception", in torch's or gloo's thread teardown), failing a test whose
    checks all passed. A failure in ``worker`` still raises (a non-zero exit)."""
    worker(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_two_ranks(worker: Callable[..., None], world: int = 2) -> dict[int, Any]:
    """``worker(rank, world, port, queue)`` puts ``(rank, result)`` on ``queue``;
    returns ``{rank: result}`` for ranks ``0 .. world - 1`` (two by default)."""
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_exit_after, args=(worker, world, free_port(), queue), nprocs=world, join=True)
    out = {}
    while not queue.empty():
        rank, res = queue.get()
        out[rank] = res
    assert sorted(out) == list(range(world))
    return out
