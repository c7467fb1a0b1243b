"""An error the training loop reports while a pipelined DiLoCo sync's all-reduces run on
pipeoff's lanes, forced to land between pipeoff's ``errored()`` check and torchft's own
inside ``Manager.allreduce`` (which then returns without joining). A CI run hit this
race (``test_diloco_masters.py::test_a_healed_replica_syncs_from_the_healed_weights``):
the replica took the unjoined all-reduce for one that could not be issued, skipped the
sync's later collectives and its vote, and its peer timed out and rejected a sync that
torchft's peer commits (torchft had issued every all-reduce at ``prepare_sync``)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from torch import nn, optim

from pipeoff.optim import FullOffloadOptimizer
from tests.ft._diloco_replicas import assert_bitwise
from tests.ft.test_diloco import reference, run


class _ReportInside:
    """Replica 0's manager: once armed, its next ``allreduce`` reports an error first,
    as the training loop's thread would between pipeoff's check and torchft's."""

    def __init__(self) -> None:
        self.armed = False
        self.fired = threading.Event()

    def __call__(self, replica: int, step: int, diloco: Any) -> None:
        if replica != 0:
            return
        manager = diloco._manager
        if step == 1:  # sync_every 4, delay 2: the sync is prepared in this step
            allreduce = manager.allreduce

            def reporting(tensor: Any, *args: Any, **kwargs: Any) -> Any:
                if not self.fired.is_set():
                    self.fired.set()
                    manager.report_error(RuntimeError("injected"))
                return allreduce(tensor, *args, **kwargs)

            manager.allreduce = reporting
        elif step == 4:
            del manager.allreduce  # (the instance attribute: torchft's method again)


def _reject_at_step_3(replica: int, step: int, diloco: Any) -> None:
    """torchft's reference: the loop reports the error once the sync's all-reduces were
    all issued (at ``prepare_sync``, step 1), before it is performed (step 3)."""
    if replica == 0 and step == 3:
        diloco._manager.report_error(RuntimeError("injected"))


@pytest.mark.slow  # four replicas' runs (two of them torchft's reference)
@pytest.mark.timeout(240)
def test_an_error_reported_inside_a_lanes_all_reduce_joins_it_as_torchfts_peer_expects(
) -> None:
    def inner(model: nn.Module) -> optim.Optimizer:
        return FullOffloadOptimizer(model, optim.AdamW, lr=1e-2, weight_decay=0.1)

    race = _ReportInside()
    cfg = {"sync_every": 4, "fragment_sync_delay": 2, "steps": 12, "n_fragments": 1}
    runs = run("pipelined", **cfg, on_step=race, inner=inner)
    assert race.fired.is_set()
    assert [str(e) for e in runs[0].errors_reported] == ["injected"]
    assert runs[1].errors_reported == []  # the peer was never left waiting
    assert_bitwise(runs, reference(**cfg, on_step=_reject_at_step_3))
