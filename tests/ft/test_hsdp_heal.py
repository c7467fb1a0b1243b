"""HSDP under torchft with OffloadOptimizer state: kill a replica group, restart it, heal it.

2 replica groups x 2 FSDP2 ranks (4 gloo processes, a real Lighthouse). Group
1 crashes before step 3 and is restarted; it heals from group 0 over torchft's
HTTP checkpoint transport, which pickles the optimizer state of DTensor
parameters, and only the healing group's ranks load it. Every rank's final
parameters and optimizer state are bitwise those of the same run with plain
AdamW (issue 10).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from typing import Any

import numpy as np
import pytest
import torch.multiprocessing as mp

from tests.ft import _hsdp_worker as hw


def _run(optimizer: str) -> dict[tuple[int, int, int], Any]:
    from torchft.coordination import LighthouseServer

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    procs: dict[tuple[int, int, int], Any] = {}
    tmp = tempfile.mkdtemp(prefix="pipeoff-hsdp-")
    results: dict[tuple[int, int, int], Any] = {}

    def start(group: int, attempt: int) -> None:
        rendezvous = f"{tmp}/group{group}-attempt{attempt}"
        for rank in (0, 1):
            p = ctx.Process(target=hw.worker, args=(
                group, rank, attempt, lighthouse.address(), rendezvous, optimizer, queue),
                daemon=True)
            p.start()
            procs[(group, rank, attempt)] = p

    try:
        start(0, 0)
        start(1, 0)
        deadline = time.monotonic() + 240
        restarted = False
        while time.monotonic() < deadline:
            while not queue.empty():
                key, out = queue.get()
                results[key] = out
            if (not restarted and all(not procs[(1, r, 0)].is_alive() for r in (0, 1))):
                codes = [procs[(1, r, 0)].exitcode for r in (0, 1)]
                assert codes == [hw.KILLED] * 2, codes
                start(1, 1)  # the restarted group heals from group 0
                restarted = True
            if restarted and all(not p.is_alive() for p in procs.values()):
                break
            time.sleep(0.05)
        while not queue.empty():
            key, out = queue.get()
            results[key] = out
        bad = {k: p.exitcode for k, p in procs.items() if p.exitcode not in (0, hw.KILLED)}
        assert not bad, f"ranks failed: {bad}"
        return results
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
        lighthouse.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def reference() -> dict[tuple[int, int, int], Any]:
    return _run("plain")


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("optimizer", ["overlap", "chunked"])
def test_a_killed_replica_group_heals_bitwise_with_offloaded_state(
        optimizer: str, reference: dict[tuple[int, int, int], Any]) -> None:
    ref = reference
    got = _run(optimizer)
    keys = [(0, 0, 0), (0, 1, 0), (1, 0, 1), (1, 1, 1)]
    assert sorted(ref) == sorted(got) == sorted(keys)
    for key in keys:
        assert got[key]["step"] == ref[key]["step"] == hw.STEPS
        for a, b in zip(ref[key]["params"], got[key]["params"]):
            assert np.array_equal(a, b), key
        assert ref[key]["state"].keys() == got[key]["state"].keys()
        for k, st in ref[key]["state"].items():
            for name, v in st.items():
                assert np.array_equal(v, got[key]["state"][k][name]), (key, k, name)
    # The healed group holds exactly what group 0 holds.
    for rank in (0, 1):
        for a, b in zip(got[(0, rank, 0)]["params"], got[(1, rank, 1)]["params"]):
            assert np.array_equal(a, b)
