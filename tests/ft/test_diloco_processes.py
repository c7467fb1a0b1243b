"""Two replica *processes* (spawned), a real Lighthouse, Manager and ProcessGroupGloo per
mode: pipeoff's DiLoCo in every mode against torchft's own, bit for bit.

The thread-based tests in test_diloco.py cover more cases quickly; this one
checks the same results where the replicas share nothing but the network.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from torchft.coordination import LighthouseServer

from tests.ft._diloco_replicas import process_main
from tests.ft.test_diloco import MODES

pytestmark = pytest.mark.slow  # spawns replica processes and Lighthouses


@pytest.mark.timeout(240)
def test_two_replica_processes_match_torchft_bitwise_in_every_mode() -> None:
    modes = {"torchft": {}, **MODES}
    lighthouses = {m: LighthouseServer(bind="[::]:0", min_replicas=2) for m in modes}
    try:
        queue = mp.get_context("spawn").Queue()
        procs = mp.spawn(process_main, args=({m: lh.address() for m, lh in lighthouses.items()},
                                             modes, 8, queue), nprocs=2, join=False)
        # Read before joining: a result larger than a pipe's buffer blocks its
        # sender until it is read.
        results = dict(queue.get(timeout=180) for _ in range(2))
        while not procs.join():
            pass
    finally:
        for lh in lighthouses.values():
            lh.shutdown()
    assert sorted(results) == [0, 1]
    for rid in (0, 1):
        ref_params, ref_backups, *_ = results[rid]["torchft"]
        for mode in modes:
            params, backups, peaks, budget, errors = results[rid][mode]
            assert errors == 0, (mode, rid)
            assert len(params) == len(ref_params) == 8
            for step, (got, want) in enumerate(zip(params, ref_params, strict=True)):
                assert all(torch.equal(torch.from_numpy(a), torch.from_numpy(b))
                           for a, b in zip(got, want, strict=True)), (mode, rid, step)
            assert backups.keys() == ref_backups.keys()
            for k in backups:
                assert torch.equal(torch.from_numpy(backups[k]), torch.from_numpy(ref_backups[k]))
            if mode in ("torchft", "original"):
                assert not peaks
            else:
                assert peaks, mode
                assert budget is None or all(p <= budget for p in peaks), (mode, peaks)
