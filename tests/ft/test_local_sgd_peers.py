"""A replica that fails mid-sync never leaves its peers waiting (issue 10, input 3).

Two real replicas (threads, a Lighthouse, Managers, ProcessGroupGloo with a 20 s
timeout). Replica 0's second all-reduce completes, but its ``wait()`` raises
(a process group wrapper). torchft issues every all-reduce before
waiting, so only replica 0 rejects and replica 1 commits the average. pipeoff's
sequential and pipelined syncs must give the same outcome, bit for bit.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torchft.process_group import ProcessGroupGloo, ProcessGroupWrapper

from tests.ft._replicas import ReplicaRun, run_replicas

MODES: dict[str, dict[str, Any]] = {
    "original": {},
    "sync": {"offload_to_cpu": True, "schedule": "synchronous"},
    "pipelined": {"offload_to_cpu": True, "schedule": "pipelined",
                  "bucket_bytes": "per_parameter", "device_budget_bytes": 256},
    "pipelined_split": {"offload_to_cpu": True, "schedule": "pipelined",
                        "bucket_bytes": 96, "device_budget_bytes": 192},
}


class _WaitRaises(dist._Work):  # type: ignore[misc]
    def __init__(self, work: Any) -> None:
        super().__init__()
        self._work = work

    def wait(self, timeout: Any = None) -> bool:
        self._work.wait()  # the collective completes on every replica...
        raise RuntimeError("injected: wait() failed after the collective completed")

    def get_future(self) -> Any:
        return self._work.get_future()


class FailingWait(ProcessGroupWrapper):  # type: ignore[misc]
    """The ``fail_at``-th all-reduce completes, but its ``wait()`` raises."""

    def __init__(self, fail_at: int) -> None:
        super().__init__(pg=ProcessGroupGloo(timeout=timedelta(seconds=20)))
        self.calls = 0
        self.fail_at = fail_at

    def allreduce(self, tensors: list[torch.Tensor], opts: object) -> Any:
        self.calls += 1
        work = super().allreduce(tensors, opts)
        return _WaitRaises(work) if self.calls == self.fail_at else work


def _run(kwargs: dict[str, Any], fail_at: int) -> list[ReplicaRun]:
    def pg(replica_id: int) -> Any:
        if replica_id == 0:
            return FailingWait(fail_at)
        return ProcessGroupGloo(timeout=timedelta(seconds=20))

    return run_replicas(kwargs, syncs=2, pg=pg)


@pytest.fixture(scope="module")
def original() -> list[ReplicaRun]:
    return _run(MODES["original"], fail_at=2)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", list(MODES))
def test_a_local_failure_mid_sync_costs_only_that_replica(mode: str,
                                                         original: list[ReplicaRun]) -> None:
    runs = original if mode == "original" else _run(MODES[mode], fail_at=2)
    r0, r1 = runs
    assert len(r0.errors_reported) == 1 and "injected" in str(r0.errors_reported[0])
    assert r1.errors_reported == []  # the peer was never left waiting
    # Replica 0 rejected its first sync: it kept its local values.
    assert all(torch.equal(a, b) for a, b in zip(r0.params_before_sync[0],
                                                 r0.params_after_sync[0]))
    # Replica 1 committed the average of both (replica 0 joined every collective).
    avg = [(a + b) / 2 for a, b in zip(r0.params_before_sync[0], r1.params_before_sync[0])]
    assert all(torch.allclose(a, b) for a, b in zip(avg, r1.params_after_sync[0]))
    # Bit for bit torchft's own outcome, in both syncs, on both replicas.
    for got, want in zip(runs, original):
        for sync_got, sync_want in zip(got.params_after_sync, want.params_after_sync):
            assert all(torch.equal(a, b) for a, b in zip(sync_got, sync_want))


class FailingIssue(ProcessGroupWrapper):  # type: ignore[misc]
    """The ``fail_at``-th all-reduce and the ``fails - 1`` after it raise as they are
    issued: torchft's ``Manager.allreduce`` reports the first and returns without
    joining that collective; pipeoff then joins it as a failed replica's, the
    ``fail_at + 1``-th call (``fails=2``: the process group is broken for the rest
    of the sync, and that raises too). ``issued``, if given, is set once an
    all-reduce has been issued (see ``IssuedAfter``)."""

    def __init__(self, fail_at: int, timeout_s: float,
                 issued: threading.Event | None = None, fails: int = 1) -> None:
        super().__init__(pg=ProcessGroupGloo(timeout=timedelta(seconds=timeout_s)))
        self.calls = 0
        self.fail_at = fail_at
        self.fails = fails
        self.issued = issued

    def allreduce(self, tensors: list[torch.Tensor], opts: object) -> Any:
        self.calls += 1
        if self.fail_at <= self.calls < self.fail_at + self.fails:
            raise RuntimeError("injected: issuing the all-reduce failed")
        work = super().allreduce(tensors, opts)
        if self.issued is not None:
            self.issued.set()
        return work


class IssuedAfter(ProcessGroupWrapper):  # type: ignore[misc]
    """The healthy peer of a ``FailingIssue`` replica: its k-th all-reduce is issued only
    once ``after[k]`` is set (the failing replica issued its first; it reported the
    failure of its second). The peer's timeout then starts after the failing replica's
    matching step, not at a time a busy host can outrun: it did, the peer timed out
    first, and its abort, not the injected failure, became the failing replica's error."""

    def __init__(self, after: list[threading.Event], timeout_s: float) -> None:
        super().__init__(pg=ProcessGroupGloo(timeout=timedelta(seconds=timeout_s)))
        self.calls = 0
        self.after = after

    def allreduce(self, tensors: list[torch.Tensor], opts: object) -> Any:
        self.calls += 1
        if self.calls <= len(self.after) and not self.after[self.calls - 1].wait(60):
            raise AssertionError(f"the failing replica never reached all-reduce {self.calls}")
        return super().allreduce(tensors, opts)


@pytest.mark.slow  # the peer waits out a 3 s process group timeout, per mode
@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", list(MODES))
def test_an_all_reduce_that_could_not_be_issued_fails_the_sync_on_both(mode: str) -> None:
    """A replica whose second all-reduce could not be issued, nor joined after (its
    process group broken), skips the rest, as torchft's does; its peer waits out the
    timeout and rejects too. pipeoff's replica joined the
    later collectives, one behind its peer's: a bucket's all-reduce met another's, and
    gloo aborted the process on the size mismatch (a tester's find)."""
    order = [threading.Event(), threading.Event()]

    def pg(replica_id: int) -> Any:
        if replica_id == 0:
            # (torchft's own path issues no second one this sync: its third call is
            # the next sync's.)
            return FailingIssue(fail_at=2, timeout_s=3, issued=order[0],
                                fails=1 if mode == "original" else 2)
        return IssuedAfter(order, timeout_s=3)

    def reported(replica_id: int, e: Exception) -> None:
        if "injected" in str(e):
            order[1].set()

    runs = run_replicas(MODES[mode], syncs=2, pg=pg, on_report=reported)
    for r in runs:
        # Both rejected the first sync (local values kept), then averaged the second.
        assert any("injected" in str(e) for e in runs[0].errors_reported)
        assert all(torch.equal(a, b) for a, b in zip(r.params_before_sync[0],
                                                     r.params_after_sync[0]))
    second = [(a + b) / 2 for a, b in zip(runs[0].params_before_sync[1],
                                          runs[1].params_before_sync[1])]
    for r in runs:
        assert all(torch.allclose(a, b) for a, b in zip(second, r.params_after_sync[1]))


@pytest.mark.timeout(120)
def test_an_all_reduce_whose_issue_failed_once_is_joined_and_the_peer_commits() -> None:
    """torchft's ``allreduce`` reports an error issuing replica 0's second all-reduce and
    returns without joining it; pipeoff joins it on the process group directly, as a
    failed replica's, and so every later one: replica 0 rejects, its peer commits the
    average of values that are all right (torchft's peer would time out and reject)."""
    def pg(replica_id: int) -> Any:
        if replica_id == 0:
            return FailingIssue(fail_at=2, timeout_s=20)
        return ProcessGroupGloo(timeout=timedelta(seconds=20))

    r0, r1 = run_replicas(MODES["pipelined_split"], syncs=2, pg=pg)
    assert [str(e) for e in r0.errors_reported] == ["injected: issuing the all-reduce failed"]
    assert r1.errors_reported == []  # the peer was never left waiting
    assert all(torch.equal(a, b) for a, b in zip(r0.params_before_sync[0],
                                                 r0.params_after_sync[0]))
    avg = [(a + b) / 2 for a, b in zip(r0.params_before_sync[0], r1.params_before_sync[0])]
    assert all(torch.allclose(a, b) for a, b in zip(avg, r1.params_after_sync[0]))
