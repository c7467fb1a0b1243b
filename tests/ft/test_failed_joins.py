"""A replica that has failed a sync still joins its peers' collectives (so that none
waits out the process group's timeout), one for one with theirs, on the process group
the quorum configured: two testers' finds, each of which made gloo abort the process
(a collective joined one behind the peer's). Each runs in a process of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _worker(module: str, *args: str) -> Any:
    out = subprocess.run([sys.executable, "-m", module, *args], cwd=_ROOT,
                         capture_output=True, text=True, timeout=200,
                         env={**os.environ, "PYTHONPATH": _ROOT})
    assert out.returncode == 0, (out.returncode, out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # a subprocess with two replicas and three quorums
@pytest.mark.timeout(240)
@pytest.mark.parametrize("schedule", ["pipelined", "synchronous"])
def test_a_failed_replica_joins_on_the_group_its_asynchronous_quorum_configured(
        schedule: str) -> None:
    """torchft's asynchronous quorum: the failed replica reached its first collective
    before its quorum had reconfigured the process group, and joined it on the old
    group (torchft's allreduce waits for the quorum; pipeoff's join of a failed
    replica's did not)."""
    runs = _worker("tests.ft.join_before_quorum_worker", schedule)
    assert runs == [{"errors": [], "step": 2}, {"errors": [], "step": 2}]


@pytest.mark.slow  # a subprocess with two replicas
@pytest.mark.timeout(240)
def test_a_ctrl_c_while_a_bucket_is_filled_joins_it_and_the_peer_rejects() -> None:
    """The synchronous schedule fills buckets on the caller's thread: a Ctrl-C there
    left the bucket unjoined (the later ones one behind the peer's). Now the bucket is
    joined with what it holds, the Ctrl-C reaches the caller, and the vote says this
    replica failed: the peer rejects rather than average a half-filled bucket."""
    peer, interrupted = _worker("tests.ft.sigint_in_fill_worker")
    assert interrupted["raised"] == "KeyboardInterrupt"
    assert "peer replica group(s) failed this sync" in str(peer["errored"])
    assert peer["kept_its_own"] and interrupted["kept_its_own"]


@pytest.mark.slow  # a subprocess with two replicas
@pytest.mark.timeout(240)
def test_a_ctrl_c_in_the_write_back_after_the_commit_is_reported_as_a_failed_one() -> None:
    """The synchronous schedule writes the average back on the caller's thread: a Ctrl-C
    there, after the quorum committed, left the replica partly averaged with nothing
    said (torchft's Manager not told, no note). Now it is a failed write-back: reported
    to torchft (the replica group's next should_commit() is False), noted on the
    Ctrl-C, raised; the peer keeps its commit."""
    peer, interrupted = _worker("tests.ft.sigint_in_fill_worker", "write-back")
    assert peer["errored"] is None and peer["params"] == ["average"] * 6
    assert interrupted["raised"] == "KeyboardInterrupt"
    assert interrupted["params"] == ["average"] + ["own"] * 5  # (the interrupted write-back)
    assert "write-back after the quorum committed was interrupted" in interrupted["errored"]
    assert any("partly averaged" in n for n in interrupted["notes"])


@pytest.mark.slow  # a subprocess with two replicas, and the peer's timeout (10 s)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("which", ["before-bucket", "before-last-bucket"])
def test_a_ctrl_c_before_a_bucket_reaches_its_all_reduce_skips_the_later_ones(
        which: str) -> None:
    """A Ctrl-C in a bucket's task before it reached ``allreduce_bucket`` (the
    synchronous schedule runs it on the caller's thread): that collective was never
    joined and the later ones joined one behind the peer's (gloo aborted the process).
    Now the next bucket sees one was skipped and the sync's later collectives are
    skipped too, as torchft skips them after an error: the peer times out and rejects,
    both keep their own values. The last bucket's gap is seen by the vote, which is
    skipped (it met the peer's last bucket: gloo aborted; a tester's find). The peer's
    manager keeps the first cause, its all-reduce's timeout (the vote's failure
    replaced it: a tester's find)."""
    peer, interrupted = _worker("tests.ft.sigint_in_fill_worker", which)
    assert interrupted["raised"] == "KeyboardInterrupt"
    assert "Timed out waiting" in str(peer["errored"])
    assert peer["params"] == ["own"] * 6 and interrupted["params"] == ["own"] * 6
