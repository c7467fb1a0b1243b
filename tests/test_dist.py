"""Which memory a process group's collectives take (``pipeoff._dist``): the clipping
norm's all-reduce sends host tensors only to groups that accept them."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from pipeoff import _dist


class _Group:
    """A stand-in for a process group with backends for ``devices``."""

    def __init__(self, *devices: str) -> None:
        self._device_types = [torch.device(d) for d in devices]


@pytest.mark.parametrize(("devices", "host"), [
    (("cuda",), False),          # init_process_group("nccl"), its DeviceMesh groups
    (("cpu", "cuda"), True),     # torch's default "cpu:gloo,cuda:nccl"
    (("cpu",), True),
])
def test_a_group_takes_host_tensors_only_with_a_backend_for_them(devices: tuple[str, ...],
                                                                   host: bool) -> None:
    assert _dist.takes_host_tensors(_Group(*devices)) is host


@pytest.mark.parametrize(("backend", "host"), [
    ("nccl", False), ("cpu:gloo,cuda:nccl", True), ("gloo", True)])
def test_without_device_types_the_backend_name_decides(monkeypatch: pytest.MonkeyPatch,
                                                       backend: str, host: bool) -> None:
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    assert _dist.takes_host_tensors(object()) is host


def test_an_nccl_only_group_gets_a_device_copy_and_the_sum_comes_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Any] = []

    def all_reduce(t: torch.Tensor, op: Any = None, group: Any = None) -> None:
        seen.append(t)
        t.mul_(2)  # the peer's equal share

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(_dist, "takes_host_tensors", lambda group: False)
    t = torch.tensor(1.5, dtype=torch.float64)
    out = _dist.all_reduce_host(t, object(), torch.device("cpu"))
    assert seen and seen[0] is not t  # a copy crossed (in device memory on a GPU)
    assert out.device.type == "cpu" and float(out) == 3.0 and float(t) == 1.5


def test_a_group_that_takes_host_tensors_reduces_in_place(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Any] = []
    monkeypatch.setattr(dist, "all_reduce", lambda t, op=None, group=None: seen.append(t))
    t = torch.tensor(1.0)
    assert _dist.all_reduce_host(t, _Group("cpu"), torch.device("cuda", 0)) is t
    assert seen == [t]
