"""The simulator predicts the real threads/inline makespans on this machine (cpu_here)."""

from __future__ import annotations

import pytest

import pipeoff
from pipeoff.sim import CostModel
from pipeoff.sim._validate import validation_cases

pytestmark = pytest.mark.slow  # calibrates cpu_here (memory-bandwidth runs) and times real runs

# Accuracy is a measurement, not a test: benchmarks/bench_sim.py reports it against
# the 25 % target (docs/performance.md). A shared CI machine swings a measured
# makespan by tens of percent, so this test guards against a broken model only.
SANITY = 3.0
# Load-proofing. A prediction is compared with a real run measured in the same
# attempt: the calibration (cpu_here, a best-of-N figure) and the real makespan
# (the best of REAL_RUNS runs, as the first one also pays for first-touch page
# faults) see the same load, so a busy machine slows both. A burst that hits
# only one of them is ridden out by another attempt; a broken model is off by
# the same factor in every attempt and fails them all.
ATTEMPTS = 3
REAL_RUNS = 3


@pytest.fixture
def one_intra_op_thread():  # type: ignore[no-untyped-def]
    """Lanes, not torch's intra-op threads, are the parallelism being modelled."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("case", validation_cases(), ids=lambda c: c.name)
def test_prediction_is_the_same_graph_within_a_sane_factor(  # type: ignore[no-untyped-def]
    case, one_intra_op_thread
) -> None:
    from pipeoff.sim._calibrate import cpu_here

    ratios = []
    for _ in range(ATTEMPTS):
        cpu_here.cache_clear()
        cost = CostModel.cpu_here()
        reals = []
        for _ in range(REAL_RUNS):
            ex = pipeoff.execute(case.build(), case.schedule, backend=case.backend)
            ex.wait()
            reals.append(ex.trace)
        real = min(reals, key=lambda t: t.makespan_ns())
        pred = pipeoff.execute(case.build(), case.schedule, backend="sim",
                               cost_model=cost).trace
        assert [(t.name, t.kind, t.lane, t.nbytes, t.deps) for t in real.tasks] == \
            [(t.name, t.kind, t.lane, t.nbytes, t.deps) for t in pred.tasks]
        ratios.append(pred.makespan_ns() / real.makespan_ns())
        if 1 / SANITY < ratios[-1] < SANITY:
            break
    assert 1 / SANITY < ratios[-1] < SANITY, ratios
