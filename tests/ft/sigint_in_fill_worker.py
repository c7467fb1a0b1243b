"""Run as a script (``python -m tests.ft.sigint_in_fill_worker``): two real torchft
replicas behind a Lighthouse, LocalSGD with ``schedule="synchronous"`` (its tasks run
on the caller's thread). Replica 1 runs on the main thread, and a real SIGINT arrives
while its second bucket is copied into staging (a tester's find: the bucket was never
joined and the later ones joined one behind the peer's; gloo aborted the process).
Prints a JSON outcome. Run in a process of its own: that failure aborts the process."""

from __future__ import annotations

import json
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import nn, optim
from torchft.coordination import LighthouseServer

import pipeoff.ft
import pipeoff.ft._local_sgd as local_sgd
from tests.ft._managers import replica_manager

_copy = local_sgd._memory_order
_armed = threading.Event()
_copies = [0]


def _copy_then_interrupt(t: torch.Tensor) -> Any:
    """The fill's copy of a parameter into staging; on replica 1 (the main thread), a
    SIGINT at the second one, as a Ctrl-C there."""
    if _armed.is_set() and threading.current_thread() is threading.main_thread():
        _copies[0] += 1
        if _copies[0] == 2:
            signal.raise_signal(signal.SIGINT)
    return _copy(t)


def _replica(i: int, lighthouse: str) -> dict[str, Any]:
    g = torch.Generator().manual_seed(i)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8), nn.Linear(8, 3))
    opt = optim.SGD(model.parameters(), lr=0.1)
    manager, _store = replica_manager(
        f"r{i}", lighthouse, state_dict=model.state_dict,
        load_state_dict=model.load_state_dict, timeout_s=30)
    before: list[torch.Tensor] = []
    # Registered before LocalSGD's hook, so it runs first: the values the sync starts from.
    opt.register_step_post_hook(lambda *_: before.extend(
        p.detach().clone() for p in model.parameters()))
    raised = None
    try:
        with pipeoff.ft.LocalSGD(manager, model, opt, 1, offload_to_cpu=True,
                                 schedule="synchronous"):
            opt.zero_grad()
            model(torch.randn(4, 16, generator=g)).pow(2).mean().backward()
            if i == 1:
                _armed.set()
            try:
                opt.step()  # sync_every=1: syncs
            except KeyboardInterrupt:
                raised = "KeyboardInterrupt"
        errored = manager.errored()
        kept = all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
        return {"raised": raised, "errored": None if errored is None else str(errored),
                "kept_its_own": kept}
    finally:
        manager.shutdown(wait=False)


def main() -> None:
    local_sgd._memory_order = _copy_then_interrupt  # type: ignore[assignment]
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    try:
        with ThreadPoolExecutor(1) as pool:
            peer = pool.submit(_replica, 0, lighthouse.address())
            interrupted = _replica(1, lighthouse.address())
            runs = [peer.result(timeout=120), interrupted]
    finally:
        lighthouse.shutdown()
    print(json.dumps(runs))


if __name__ == "__main__":
    main()
