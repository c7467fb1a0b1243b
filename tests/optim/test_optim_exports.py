"""pipeoff.optim's public surface, and that importing it stays light."""

from __future__ import annotations

import subprocess
import sys

import pytest

import pipeoff.optim


def test_each_public_name_is_exported_once() -> None:
    names = list(pipeoff.optim.__all__)
    assert len(names) == len(set(names))
    objs = [id(getattr(pipeoff.optim, n)) for n in names]
    assert len(objs) == len(set(objs))
    assert not any(n.startswith("_") for n in names)


@pytest.mark.slow  # runs a Python interpreter (subprocess)
def test_import_does_not_load_fsdp_or_torchft() -> None:
    code = (
        "import sys, pipeoff.optim\n"
        "bad = [m for m in ('torchft', 'torch.distributed.fsdp', 'torch.distributed.tensor') "
        "if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
