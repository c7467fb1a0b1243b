"""Ranks of ``test_transfer_exit.py``: state transfers, then ``destroy_process_group``.

``held_worker`` runs under ``tests/_two_ranks.py`` and reports whether the process
group and gloo's threads outlived ``destroy_process_group``. Run as a module
(``python -m tests.transfer.exit_worker RANK WORLD PORT``), a rank runs the transfer
of issue 37 and exits as a user's script does, through the interpreter's own
teardown (no ``os._exit``): that is where the abort was.
"""

from __future__ import annotations

import datetime
import os
import sys
import weakref
from typing import Any

import torch
import torch.distributed as dist

from tests.transfer import transfer_worker as tw


def _init(rank: int, world: int, port: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # the parent serves the store
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))


def gloo_threads() -> list[str]:
    """The names of this process's gloo threads (Linux: ``/proc/self/task``)."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue  # the thread ended meanwhile
        if "gloo" in name:
            names.append(name)
    return sorted(names)


def _uneven(rank: int, world: int) -> tuple[dict[str, Any], dict[str, Any], torch.Tensor]:
    """Uneven Shard(0) sources of a (5, 7) tensor, a replicated target, and the tensor."""
    from pipeoff.transfer import LiveTensor

    full = tw._full((5, 7), torch.float32, seed=1)
    return ({"w": tw._padded_source(full, rank, world)},
            {"w": LiveTensor(torch.full((5, 7), tw.SENTINEL))}, full)


def held_worker(rank: int, world: int, port: int, queue: Any) -> None:
    """Transfers on every path a user keeps objects from (a finished one, one given
    the group explicitly, a torn one, a refused one), all still referenced; then
    ``destroy_process_group``: the group must be destroyed (gloo's threads joined)
    there, while the interpreter is whole."""
    import pipeoff.testing as pt
    from pipeoff import ConfigError
    from pipeoff.transfer import StateTransfer, TransferRefusedError, TransferTornError

    _init(rank, world, port)
    src, dst, full = _uneven(rank, world)
    kept: dict[str, Any] = {}
    kept["default"] = StateTransfer(src, dst, host_budget_bytes=128)
    kept["default"].run()
    ok = torch.equal(dst["w"].tensor, full)
    kept["explicit"] = StateTransfer(src, dst, process_group=dist.group.WORLD,
                                     host_budget_bytes=128)
    kept["explicit"].launch().wait()
    kept["torn"] = StateTransfer(src, dst, host_budget_bytes=128)
    with pt.fail_work(r"unpack\d+:.*" if rank == 1 else "no such task", after_ops=0):
        try:
            kept["torn"].run()
        except TransferTornError as err:
            kept["torn_error"] = err
    kept["refused"] = StateTransfer(src, dst, host_budget_bytes=8)
    try:
        kept["refused"].run()
    except TransferRefusedError as err:
        kept["refused_error"] = err
    group = weakref.ref(dist.group.WORLD)
    before = gloo_threads()
    dist.destroy_process_group()
    after = gloo_threads()
    out: dict[str, Any] = {"ok": ok, "before": before, "after": after,
                           "group_alive": group() is not None,
                           "errors": sorted(k for k in kept if k.endswith("_error"))}
    for name in ("default", "explicit"):
        try:
            kept[name].launch()
            out[name] = None
        except Exception as err:  # noqa: BLE001 - reported, the test says what it wants
            out[name] = isinstance(err, ConfigError) and "destroyed" in str(err) or repr(err)
    queue.put((rank, out))


def run_rank(rank: int, world: int, port: int) -> None:
    """Issue 37's transfer (uneven Shard(0) sources to replicated targets, 128-byte
    budgets; with three ranks also one region to two dtypes), then the teardown a
    script should have: ``destroy_process_group``, and a normal exit."""
    _init(rank, world, port)
    res = tw.case_replicated(rank, world, torch.float32, torch.float32, False, 128)
    assert all(res["bitwise"].values()) and all(res["padding"].values()), res
    if world > 2:
        assert tw.case_mixed_dtypes(rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    run_rank(*(int(a) for a in sys.argv[1:4]))
