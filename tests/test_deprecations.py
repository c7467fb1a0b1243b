"""Every deprecated name still works, and warns once: a ``FutureWarning`` naming the
new name, shown once per call site under Python's default filters (a loop that
uses an old name prints one line, not one per step). Run in a fresh interpreter,
as a user's script runs, so pytest's own filters play no part."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# (what the user writes, run three times from one line; what the warning says)
OLD_NAMES = [
    ("OffloadOptimizer(torch.optim.AdamW(net.parameters()), chunk_bytes=4096, lookahead=1)",
     "now prefetch"),
    ("opt.lookahead", ".prefetch"),
    ("LocalSGD(manager(), net, torch.optim.SGD(net.parameters(), lr=0.1), 1, "
     "offload_averaged_parameters_to_cpu=True)", "now offload_to_cpu"),
    ("LocalSGD(manager(), net, torch.optim.SGD(net.parameters(), lr=0.1), 1, "
     "offload_to_cpu=True, schedule='sync')", "now schedule='synchronous'"),
    ("Schedule.pipelined(lookahead=3)", "now max_in_flight"),
    ("Schedule.pipelined(max_in_flight=3).lookahead", "Schedule.max_in_flight"),
    ("prepare_trainer(object())", "no longer needed"),
]

PRELUDE = """
import warnings
from unittest import mock
import torch
import torchft
from pipeoff import Schedule
from pipeoff.ft import LocalSGD
from pipeoff.integrations.hf import prepare_trainer
from pipeoff.optim import OffloadOptimizer

def manager():
    m = mock.create_autospec(torchft.Manager, instance=True)
    m.should_commit.return_value = True
    return m

net = torch.nn.Linear(4, 4)
opt = OffloadOptimizer(torch.optim.AdamW(net.parameters()), chunk_bytes=4096)
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("default")  # Python's own action for FutureWarning
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    for _ in range(3):
        _ = {expr}
print(len(seen), [str(w.message) for w in seen if w.category is FutureWarning])
"""


@pytest.mark.slow  # a fresh interpreter each (imports torch and torchft)
@pytest.mark.parametrize(("expr", "says"), OLD_NAMES, ids=[s for _, s in OLD_NAMES])
def test_each_old_name_works_and_warns_once_per_call_site(expr: str, says: str) -> None:
    proc = subprocess.run([sys.executable, "-c", PRELUDE.format(expr=expr)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    count, messages = proc.stdout.strip().split(" ", 1)
    assert count == "1", proc.stdout
    assert says in messages, messages
