"""Run a worker in two gloo processes (``mp.spawn``) and collect what each rank reports."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


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
    returns ``{rank: result}`` for ranks ``0 .. world - 1`` (two by default).

    The ranks meet at a TCPStore this process serves on a port the OS gives it (port 0,
    held from bind to the end): a port found free and bound later by rank 0 could be
    taken in between by another run on the machine (EADDRINUSE). With
    ``TORCHELASTIC_USE_AGENT_STORE`` every rank's ``init_process_group`` connects to it
    as a client, as under torchrun's agent."""
    import torch.distributed as dist

    queue = mp.get_context("spawn").SimpleQueue()
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    old = os.environ.get("TORCHELASTIC_USE_AGENT_STORE")
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # (inherited by the spawned ranks)
    try:
        mp.spawn(_exit_after, args=(worker, world, store.port, queue), nprocs=world,
                 join=True)
    finally:
        if old is None:
            os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        else:
            os.environ["TORCHELASTIC_USE_AGENT_STORE"] = old
        del store
    out = {}
    while not queue.empty():
        rank, res = queue.get()
        out[rank] = res
    assert sorted(out) == list(range(world))
    return out
