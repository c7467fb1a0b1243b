"""The public surface: each name exported exactly once, integrations imported lazily."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

PUBLIC_MODULES = ["pipeoff", "pipeoff.trace", "pipeoff.testing", "pipeoff.sim", "pipeoff.ft",
                  "pipeoff.optim"]


def test_required_names_exist() -> None:
    import pipeoff

    for name in ["TaskGraph", "TaskKind", "Schedule", "execute", "Execution", "Trace",
                 "PipeoffError"]:
        assert hasattr(pipeoff, name), name
        assert name in pipeoff.__all__


@pytest.mark.parametrize("modname", PUBLIC_MODULES)
def test_each_public_name_is_exported_once(modname: str) -> None:
    mod = importlib.import_module(modname)
    names = list(mod.__all__)
    assert len(names) == len(set(names)), f"duplicates in {modname}.__all__"
    for n in names:
        assert getattr(mod, n) is not None
        assert not n.startswith("_")


def test_no_public_object_is_exported_under_two_names() -> None:
    import pipeoff

    objs = [id(getattr(pipeoff, n)) for n in pipeoff.__all__]
    assert len(objs) == len(set(objs))


def test_errors_derive_from_pipeoff_error_and_builtins() -> None:
    import pipeoff

    assert issubclass(pipeoff.BudgetError, ValueError)
    assert issubclass(pipeoff.StepTimeoutError, TimeoutError)
    assert issubclass(pipeoff.ConfigError, ValueError)
    for n in pipeoff.__all__:
        obj = getattr(pipeoff, n)
        if isinstance(obj, type) and issubclass(obj, Exception) and obj is not pipeoff.PipeoffError:
            assert issubclass(obj, pipeoff.PipeoffError), n
            assert obj.__doc__, n


@pytest.mark.slow  # runs a Python interpreter (subprocess)
def test_import_pipeoff_does_not_import_integrations() -> None:
    code = (
        "import sys, pipeoff, pipeoff.trace, pipeoff.testing\n"
        "bad = [m for m in ('torchft', 'matplotlib') if m in sys.modules]\n"
        "import torch.distributed as dist\n"
        "assert not bad, bad\n"
        "assert not (dist.is_available() and dist.is_initialized())\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("modname", PUBLIC_MODULES)
def test_dir_lists_every_public_name(modname: str) -> None:
    """Tab completion finds the names a module imports on first use (``pipeoff.ft``'s
    ``LocalSGD`` and ``DiLoCo``, ``pipeoff.testing``'s ``DataRaceError``)."""
    mod = importlib.import_module(modname)
    assert set(mod.__all__) <= set(dir(mod))
