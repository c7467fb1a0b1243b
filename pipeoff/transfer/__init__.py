"""Live state transfer: host-resident tensors to targets of any layout across ranks.

:class:`StateTransfer` copies optimizer masters, moments or weights, sharded over
ranks and resident anywhere (device, pinned or pageable host memory), into
targets of any layout: replicated weights for a rollout engine, a new sharding
after the world size changed, the live state of a recovering replica. Staging
is bounded on both the host and the device, a collective preflight refuses on
every rank before any write, and a fault afterwards is reported as torn on every
rank, never as a hang (DeepSpeed proposal #8899). See ``docs/state_transfer.md``.
"""

from __future__ import annotations

from pipeoff._errors import TransferRefusedError, TransferTornError
from pipeoff.transfer._live import RESIDENCIES, LiveTensor
from pipeoff.transfer._plan import Piece, Run, TransferPlan, plan_transfer
from pipeoff.transfer._transfer import StateTransfer

__all__ = [
    # describing tensors
    "LiveTensor",
    "RESIDENCIES",
    # planning
    "Piece",
    "Run",
    "TransferPlan",
    "plan_transfer",
    # running
    "StateTransfer",
    # errors
    "TransferRefusedError",
    "TransferTornError",
]
