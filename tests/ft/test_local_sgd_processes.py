"""Two replica *processes* (spawned), a real Lighthouse, Manager and ProcessGroupGloo per mode.

The thread-based tests in test_local_sgd.py cover more cases quickly; this one
checks the same results where the replicas share nothing but the network.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from torchft.coordination import LighthouseServer

from tests.ft._replicas import process_main
from tests.ft.test_local_sgd import MODES

pytestmark = pytest.mark.slow  # spawns replica processes and a Lighthouse


@pytest.mark.timeout(240)
def test_two_replica_processes_match_the_original_path_bitwise_in_every_mode() -> None:
    modes = {"original": {}, **MODES}
    lighthouses = {m: LighthouseServer(bind="[::]:0", min_replicas=2) for m in modes}
    try:
        queue = mp.get_context("spawn").Queue()
        procs = mp.spawn(process_main, args=({m: lh.address() for m, lh in lighthouses.items()},
                                             modes, 2, queue), nprocs=2, join=False)
        # Read before joining: a result larger than a pipe's buffer blocks its
        # sender until it is read.
        results = dict(queue.get(timeout=180) for _ in range(2))
        while not procs.join():
            pass
    finally:
        for lh in lighthouses.values():
            lh.shutdown()
    assert sorted(results) == [0, 1]
    reference = results[0]["original"][0]
    for mode in modes:
        for rid in (0, 1):
            params, peaks, budgets, errors = results[rid][mode]
            assert errors == 0, (mode, rid)
            for sync, (got, want) in enumerate(zip(params, reference, strict=True)):
                assert all(torch.equal(torch.from_numpy(a), torch.from_numpy(b))
                           for a, b in zip(got, want, strict=True)), (mode, rid, sync)
            for peak, budget in zip(peaks, budgets, strict=True):
                if mode != "original":
                    assert peak is not None and (budget is None or peak <= budget), mode
