"""Run as a script (``python -m tests.ft.allreduce_raises_worker KIND``): two real torchft
replicas (threads) behind a Lighthouse; replica 0's second ``manager.allreduce`` call
raises (as a Ctrl-C in its wait for the quorum does). Prints a JSON outcome. Run in a
process of its own: the failure it guards against aborts the process (gloo)."""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch
from torchft.coordination import LighthouseServer
from torchft.process_group import ProcessGroupGloo

from tests.ft._managers import replica_manager
from tests.ft.test_peer_failed import _model, _wrap


def _replica(i: int, lighthouse: str, kind: str) -> dict[str, Any]:
    model = _model(i)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    manager, _store = replica_manager(
        f"r{i}", lighthouse, state_dict=model.state_dict,
        load_state_dict=model.load_state_dict, timeout_s=20,
        pg=ProcessGroupGloo(timeout=timedelta(seconds=4)))
    if i == 0:
        calls = [0]
        allreduce = manager.allreduce

        def raising(*a: Any, **k: Any) -> Any:
            calls[0] += 1
            if calls[0] == 2:
                raise RuntimeError("injected: manager.allreduce raised")
            return allreduce(*a, **k)

        manager.allreduce = raising  # type: ignore[method-assign]
    raised = None
    try:
        with _wrap(kind, manager, model, opt) as w:
            opt.zero_grad()
            model(torch.randn(8, 16, generator=torch.Generator().manual_seed(i))).sum().backward()
            try:
                opt.step()  # sync_every=1: syncs
                getattr(w, "wait_for_sync", lambda: None)()
            except RuntimeError as err:
                raised = str(err)
        after = [p.detach().clone() for p in model.parameters()]
        errored = manager.errored()
        return {"raised": raised, "errored": None if errored is None else str(errored),
                "moved": [not torch.equal(a, b) for a, b in zip(after, before)]}
    finally:
        manager.shutdown(wait=False)


def main(kind: str) -> None:
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    try:
        with ThreadPoolExecutor(2) as pool:
            runs = list(pool.map(_replica, range(2), [lighthouse.address()] * 2, [kind] * 2))
    finally:
        lighthouse.shutdown()
    print(json.dumps(runs))


if __name__ == "__main__":
    main(sys.argv[1])
