"""Both optimizers implement the typed contract their readers use (pipeoff._contract)."""

from __future__ import annotations

import torch

from pipeoff._contract import (
    AsyncStep,
    Attachable,
    Health,
    HostState,
    MasterCopy,
    OffloadedOptimizer,
)
from pipeoff.optim import FullOffloadOptimizer, OffloadOptimizer


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def test_both_optimizers_implement_the_contract() -> None:
    m = _model()
    offload = OffloadOptimizer(torch.optim.AdamW(m.parameters()), mode="overlap")
    full = FullOffloadOptimizer(_model().to(torch.bfloat16), torch.optim.AdamW)
    for opt in (offload, full):
        assert isinstance(opt, OffloadedOptimizer)
        assert isinstance(opt, (AsyncStep, HostState, Attachable))
        assert isinstance(opt.health, Health)
    assert isinstance(full, MasterCopy)  # its FP32 masters are the truth
    assert not isinstance(offload, MasterCopy)  # the weights are its parameters


def test_a_plain_optimizer_is_none_of_it() -> None:
    plain = torch.optim.AdamW(_model().parameters())
    for proto in (AsyncStep, HostState, Attachable, MasterCopy):
        assert not isinstance(plain, proto)


def test_a_reader_registered_through_the_contract_is_waited_for() -> None:
    """add_reader(): the optimizer's next write of its host state waits for it."""
    import threading

    from pipeoff import TaskGraph, TaskKind, execute

    full = FullOffloadOptimizer(_model().to(torch.bfloat16), torch.optim.AdamW)
    gate = threading.Event()
    g = TaskGraph()
    g.add_task("read", TaskKind.HOST, lambda ctx: gate.wait(10))
    ex = execute(g)
    full.add_reader(ex)
    threading.Timer(0.05, gate.set).start()
    full.refresh_masters()  # writes the masters: waits for the reader first
    assert ex.done()


def test_health_names_what_is_refused_and_how_to_go_on() -> None:
    import pytest

    from pipeoff import StepFailedError

    h = Health()
    h.check("step()")  # healthy: nothing refused
    h.stale = RuntimeError("copy failed")
    h.check("state_dict()", stale=False)  # a stale weight does not spoil the host state
    with pytest.raises(StepFailedError, match=r"step\(\) refused.*refresh_device_weights"):
        h.check("step()")
    h.torn = "a step failed in 'step:1' after chunk(s) [0] had stepped their masters"
    with pytest.raises(StepFailedError,
                       match=r"state_dict\(\) refused.*partly stepped.*checkpoint"):
        h.check("state_dict()", stale=False)
