"""Run as a script (``python -m tests.ft.sigint_in_fill_worker [fill|write-back]``): two
real torchft replicas behind a Lighthouse, LocalSGD with ``schedule="synchronous"`` (its
tasks run on the caller's thread; one bucket per parameter). Replica 1 runs on the main
thread, and a real SIGINT arrives there:

- ``fill`` (the default): while its second bucket is copied into staging (a tester's
  find: the bucket was never joined and the later ones joined one behind the peer's;
  gloo aborted the process);
- ``write-back``: after the commit, once the first parameter is written back and before
  the second is (a tester's find: a partly averaged replica, and nothing said so);
- ``before-bucket``: in the second bucket's task, before it reaches ``allreduce_bucket``
  (a tester's find: that collective was never joined, the later ones one behind the
  peer's; gloo aborted the process); ``before-last-bucket``: in the last one's (the
  vote met the peer's last bucket: gloo aborted, the last layer being wider than 1).

Prints a JSON outcome. Run in a process of its own: a failure can abort the process."""

from __future__ import annotations

import json
import signal
import sys
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
_BUCKETS = 6  # (the model's parameters: the fill copies each once, then the write-back)
_MODE = (sys.argv[1:] or ["fill"])[0]
_AT = {"fill": 2, "write-back": _BUCKETS + 2, "before-bucket": 2,
       "before-last-bucket": _BUCKETS}[_MODE]
_allreduce_bucket = local_sgd.allreduce_bucket
_entered = [0]
_before: dict[int, list[torch.Tensor]] = {}


def _copy_then_interrupt(t: torch.Tensor) -> Any:
    """The fill's copy of a parameter into staging, or the write-back's of one into the
    model; on replica 1 (the main thread), a SIGINT at the ``_AT``-th, as a Ctrl-C."""
    if _armed.is_set() and threading.current_thread() is threading.main_thread():
        _copies[0] += 1
        if _copies[0] == _AT:
            signal.raise_signal(signal.SIGINT)
    return _copy(t)


def _interrupt_then_allreduce(*args: Any) -> None:
    """A bucket's task on its way to ``allreduce_bucket``; on replica 1 (the main
    thread), a SIGINT before the ``_AT``-th gets there."""
    if _armed.is_set() and threading.current_thread() is threading.main_thread():
        _entered[0] += 1
        if _entered[0] == _AT:
            signal.raise_signal(signal.SIGINT)
    _allreduce_bucket(*args)


def _replica(i: int, lighthouse: str) -> dict[str, Any]:
    g = torch.Generator().manual_seed(i)
    # (The last bucket wider than the vote: a vote met in its place aborts gloo.)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8), nn.Linear(8, 300))
    opt = optim.SGD(model.parameters(), lr=0.1)
    manager, _store = replica_manager(
        f"r{i}", lighthouse, state_dict=model.state_dict,
        load_state_dict=model.load_state_dict,
        timeout_s=10 if _MODE.startswith("before") else 30)  # (the peer times out)
    before = _before.setdefault(i, [])
    # Registered before LocalSGD's hook, so it runs first: the values the sync starts from.
    opt.register_step_post_hook(lambda *_: before.extend(
        p.detach().clone() for p in model.parameters()))
    raised = None
    notes: list[str] = []
    try:
        with pipeoff.ft.LocalSGD(manager, model, opt, 1, offload_to_cpu=True,
                                 schedule="synchronous"):
            opt.zero_grad()
            model(torch.randn(4, 16, generator=g)).pow(2).mean().backward()
            if i == 1:
                _armed.set()
            try:
                opt.step()  # sync_every=1: syncs
            except KeyboardInterrupt as err:
                raised = "KeyboardInterrupt"
                notes = getattr(err, "__notes__", [])
        errored = manager.errored()
        kept = all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
        return {"raised": raised, "errored": None if errored is None else str(errored),
                "kept_its_own": kept, "notes": notes,
                "after": [p.detach().clone() for p in model.parameters()]}
    finally:
        manager.shutdown(wait=False)


def main() -> None:
    if _MODE.startswith("before"):
        local_sgd.allreduce_bucket = _interrupt_then_allreduce  # type: ignore[assignment]
    else:
        local_sgd._memory_order = _copy_then_interrupt  # type: ignore[assignment]
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    try:
        with ThreadPoolExecutor(1) as pool:
            peer = pool.submit(_replica, 0, lighthouse.address())
            interrupted = _replica(1, lighthouse.address())
            runs = [peer.result(timeout=120), interrupted]
    finally:
        lighthouse.shutdown()
    average = [(a + b) / 2 for a, b in zip(_before[0], _before[1], strict=True)]
    for i, run in enumerate(runs):
        # Each parameter: the replica's own values, or the average (SGD's sum of two
        # in FP32 then halved, as torchft's allreduce: to rounding).
        run["params"] = ["own" if torch.equal(p, b) else
                         "average" if torch.allclose(p, v, rtol=0, atol=1e-6) else "other"
                         for p, b, v in zip(run.pop("after"), _before[i], average, strict=True)]
    print(json.dumps(runs))


if __name__ == "__main__":
    main()
