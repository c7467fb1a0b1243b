"""The CUDA accelerator's own allocation and stream choices, at their unit edges.

A CPU-only machine has no CUDA runtime, so the runtime calls are faked here;
``benchmarks/gpu_suite.py`` checks the same promises on a GPU.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

from pipeoff import _accel


class _FakeCudart:
    class cudaError:  # noqa: N801 - the runtime's spelling
        success = 0

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[str, int]] = []
        self.fail = fail

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:  # noqa: N802
        self.calls.append(("register", nbytes))
        return 1 if self.fail else 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.calls.append(("unregister", 0))
        return 0


def test_large_pinned_state_is_exactly_sized_and_unlocked_when_last_used(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rt = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    monkeypatch.setattr(_accel.Cuda, "available", lambda self: True)
    monkeypatch.setattr(_accel, "REGISTER_MIN_BYTES", 1024)
    t = _accel.Cuda().host_empty((10, 100), torch.float32, pinned=True)
    assert t.shape == (10, 100) and t.dtype == torch.float32
    assert rt.calls == [("register", 4000)]  # not rounded up to 4096
    assert t.untyped_storage().nbytes() == 4000
    # A piece that outlives the tensor (host_alloc slices storages) keeps it locked.
    piece = torch.empty(0).set_(t.untyped_storage()[400:800], 0, (100,), (1,))
    t.fill_(3.0)
    del t
    gc.collect()
    assert rt.calls == [("register", 4000)]
    assert torch.all(piece == 3.0)
    del piece
    gc.collect()
    assert rt.calls == [("register", 4000), ("unregister", 0)]


def test_a_failed_page_lock_falls_back_to_the_pinned_allocator(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rt = _FakeCudart(fail=True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    with pytest.warns(RuntimeWarning, match="cudaHostRegister of 4000 bytes failed"):
        assert _accel._registered_empty(1000, torch.float32) is None
    gc.collect()
    assert rt.calls == [("register", 4000)]  # never registered: nothing to unregister


def test_lanes_fall_back_to_pooled_streams_with_a_warning(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_accel, "_libcudart", False)
    with pytest.warns(RuntimeWarning, match="pooled streams"):
        assert _accel._dedicated_stream(torch.device("cuda", 0), -1) is None

    class _Lib:
        def cudaStreamCreateWithPriority(self, handle: Any, flags: Any, priority: Any  # noqa: N802
                                         ) -> int:
            return 2  # cudaErrorMemoryAllocation

    monkeypatch.setattr(_accel, "_libcudart", _Lib())
    monkeypatch.setattr(torch.cuda, "device", lambda d: __import__("contextlib").nullcontext())
    with pytest.warns(RuntimeWarning, match="cudaStreamCreateWithPriority failed"):
        assert _accel._dedicated_stream(torch.device("cuda", 0), 0) is None
