"""A replica group's torchft Manager for the tests: one rank over gloo, behind a real
Lighthouse, with a TCPStore of its own (returned with it: keep it alive as long as the
manager)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torchft.manager import Manager
from torchft.process_group import ProcessGroupGloo


def replica_manager(replica_id: str, lighthouse: str, *,
                    state_dict: Callable[[], Any], load_state_dict: Callable[[Any], Any],
                    min_replica_size: int = 2, use_async_quorum: bool = False,
                    timeout_s: float = 60, quorum_timeout_s: float | None = None,
                    pg: Any = None) -> tuple[Manager, dist.TCPStore]:
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    extra: dict[str, Any] = {}
    if quorum_timeout_s is not None:
        extra["quorum_timeout"] = timedelta(seconds=quorum_timeout_s)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=timeout_s)) if pg is None else pg,
        min_replica_size=min_replica_size, load_state_dict=load_state_dict,
        state_dict=state_dict, replica_id=replica_id, store_addr="localhost",
        store_port=store.port, rank=0, world_size=1, lighthouse_addr=lighthouse,
        use_async_quorum=use_async_quorum, init_sync=False,
        timeout=timedelta(seconds=timeout_s), **extra)
    return manager, store
