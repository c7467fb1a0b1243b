from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.gpu_device import Gpu


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a real GPU (the simulated device cannot show this)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(params=["simulated"] + (["cuda"] if torch.cuda.is_available() else []))
def gpu(request: pytest.FixtureRequest) -> Iterator[Gpu]:
    """The simulated CUDA device, and a real GPU where there is one."""
    if request.param == "cuda":
        yield Gpu()
        torch.cuda.synchronize()
        return
    import pipeoff.testing

    with pipeoff.testing.simulated_cuda() as sim:
        yield Gpu(sim)
