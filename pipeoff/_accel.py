"""The accelerator interface: every CUDA call pipeoff makes goes through here.

pipeoff talks to CUDA in a few ways only: streams and events, launching a
task's work on a stream, pinned host memory, ``record_stream``, GPU-side
sleeps (test delays) and NVTX ranges. :class:`Accelerator` names exactly those.
:class:`Cuda` implements them with ``torch.cuda``; tests replace it with the
simulated device of :mod:`pipeoff.testing` (``simulated_cuda()``), whose streams
run asynchronously and which checks every access against CUDA's ordering
rules, so that a missing ``wait_event`` fails on a CPU-only machine.

Streams and events keep torch's method names (``stream.wait_event(ev)``,
``ev.record(stream)``, ``ev.query()``, ``ev.synchronize()``,
``ev.elapsed_time(end)``, ``stream.synchronize()``), so that code outside
pipeoff (FSDP, a user's stream) can use them as usual.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from pipeoff import _compat

__all__ = ["TORCH_CUDA", "Accelerator", "Cuda", "CudaRuntime", "current", "use"]


class Accelerator(Protocol):
    """What pipeoff needs from an accelerator runtime."""

    name: str
    """``"cuda"``."""

    @property
    def device_type(self) -> str:
        """The ``torch.device`` type of device memory (``"cpu"`` on the simulated device)."""

    def available(self) -> bool:
        """Whether a device is usable here."""

    def is_device(self, device: torch.device) -> bool:
        """Whether ``device`` is this accelerator's (selects the CUDA backend)."""

    def on_device(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lives in device memory (not host memory)."""

    def normalize(self, device: torch.device) -> torch.device:
        """``device`` with an explicit index (the current device's if it has none)."""

    def host_empty(self, shape: Any, dtype: torch.dtype, *, pinned: bool) -> torch.Tensor:
        """Uninitialized host memory, page-locked if ``pinned`` (and possible)."""

    def is_pinned(self, t: torch.Tensor) -> bool:
        """Whether host tensor ``t`` is page-locked."""

    def new_stream(self, device: torch.device, priority: int = 0, name: str = "") -> Any:
        """A new stream on ``device`` (lower ``priority`` runs first, as in CUDA); ``name``
        labels it where the accelerator can (the simulated device's messages)."""

    def current_stream(self, device: torch.device | None = None) -> Any:
        """The calling thread's current stream on ``device``."""

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """Make ``stream`` current on the calling thread inside the block."""

    def use_device(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        """Make ``device`` current on the calling thread inside the block."""

    def new_event(self, timing: bool = False) -> Any:
        """A new event: with timing if ``timing``, else a blocking one (a host
        ``synchronize()`` on it sleeps instead of spinning)."""

    def launch(self, stream: Any, fn: Callable[[], None]) -> None:
        """Run ``fn``, whose kernels go to ``stream``, in ``stream``'s order.

        CUDA: ``fn`` runs at once on the calling thread with ``stream`` current
        (its kernels are enqueued). The simulated device enqueues ``fn`` itself,
        to run later on the stream's worker.
        """

    def sleep(self, stream: Any, seconds: float) -> None:
        """Delay ``stream`` (not the host) by ``seconds``."""

    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        """Tell the allocator that ``stream`` uses ``t``: its memory is not reused
        before ``stream``'s work enqueued so far is done."""

    def synchronize(self, device: torch.device | None = None) -> None:
        """Block the host until every stream of ``device`` is idle."""

    def is_capturing(self) -> bool:
        """Whether the calling thread's current stream is capturing a CUDA graph."""

    def range(self, name: str) -> contextlib.AbstractContextManager[Any]:
        """A named range for profilers (NVTX)."""

    def host_thread(self) -> contextlib.AbstractContextManager[Any]:
        """Entered by pipeoff's threads around each unit of host work they run."""


_SLEEP_CYCLES_PER_S = 1.98e9  # torch.cuda._sleep spins in clock cycles; ~H200 boost clock


class CudaRuntime(Protocol):
    """The torch and CUDA runtime entry points :class:`Cuda` calls, and nothing more.

    :class:`Cuda` holds one: :data:`TORCH_CUDA` (``torch.cuda`` itself) on a
    GPU, or the simulated device's (:func:`pipeoff.testing.simulated_cuda`), so
    that the same :class:`Cuda` code, which stream is current for a launch,
    what ``record_stream`` and ``synchronize`` reach, how streams and pinned
    memory are made, runs in CI and on a GPU, and its mistakes are races there.
    Names follow ``torch.cuda``'s where it has one.
    """

    device_type: str
    """The ``torch.device`` type of device memory: ``"cuda"`` (``"cpu"`` simulated)."""

    def is_available(self) -> bool: ...
    def current_device(self) -> int: ...
    def current_stream(self, device: torch.device | None) -> Any: ...
    def stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]: ...
    def device(self, device: torch.device) -> contextlib.AbstractContextManager[Any]: ...
    def Event(self, enable_timing: bool, blocking: bool) -> Any: ...  # noqa: N802
    def Stream(self, device: torch.device, priority: int) -> Any: ...  # noqa: N802
    def ExternalStream(self, stream_ptr: int, device: torch.device) -> Any: ...  # noqa: N802
    def synchronize(self, device: torch.device | None) -> None: ...
    def is_current_stream_capturing(self) -> bool: ...
    def cudart(self) -> Any:
        """``torch.cuda.cudart()``: ``cudaHostRegister`` / ``cudaHostUnregister``."""
    def libcudart(self) -> Any:
        """The CUDA runtime library (``ctypes``; ``cudaStreamCreateWithPriority``), or
        ``None`` when it cannot be loaded."""
    def sleep(self, cycles: int) -> None:
        """Spin the current stream (``torch.cuda._sleep``)."""
    def range_push(self, name: str) -> None: ...
    def range_pop(self) -> None: ...
    def label_stream(self, stream: Any, name: str) -> None:
        """Name ``stream`` where the runtime can (the simulated device's messages)."""
    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        """``t.record_stream(stream)``."""
    def is_pinned(self, t: torch.Tensor) -> bool:
        """``t.is_pinned()``."""
    def on_device(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is in device memory (``t.device.type == "cuda"``)."""
    def empty(self, shape: Any, dtype: torch.dtype, pin_memory: bool) -> torch.Tensor:
        """``torch.empty(shape, dtype=dtype, pin_memory=pin_memory)``."""
    def host_thread(self) -> contextlib.AbstractContextManager[Any]:
        """Entered by pipeoff's threads around host work (nothing on CUDA)."""


class _TorchCuda:
    """:class:`CudaRuntime` as ``torch.cuda`` (looked up at each call)."""

    device_type = "cuda"

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def current_stream(self, device: torch.device | None) -> Any:
        return torch.cuda.current_stream(device)

    def stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def device(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.device(device)

    def Event(self, enable_timing: bool, blocking: bool) -> Any:  # noqa: N802
        return torch.cuda.Event(enable_timing=enable_timing, blocking=blocking)

    def Stream(self, device: torch.device, priority: int) -> Any:  # noqa: N802
        return torch.cuda.Stream(device=device, priority=priority)

    def ExternalStream(self, stream_ptr: int, device: torch.device) -> Any:  # noqa: N802
        return torch.cuda.ExternalStream(stream_ptr, device=device)

    def synchronize(self, device: torch.device | None) -> None:
        torch.cuda.synchronize(device)

    def is_current_stream_capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

    def cudart(self) -> Any:
        return torch.cuda.cudart()

    def libcudart(self) -> Any:
        return _cudart_library() or None

    def sleep(self, cycles: int) -> None:
        _compat.cuda_sleep(cycles)

    def range_push(self, name: str) -> None:
        torch.cuda.nvtx.range_push(name)

    def range_pop(self) -> None:
        torch.cuda.nvtx.range_pop()

    def label_stream(self, stream: Any, name: str) -> None:
        pass  # CUDA streams have no names

    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        t.record_stream(stream)

    def is_pinned(self, t: torch.Tensor) -> bool:
        return t.is_pinned()

    def on_device(self, t: torch.Tensor) -> bool:
        return t.device.type == "cuda"

    def empty(self, shape: Any, dtype: torch.dtype, pin_memory: bool) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=pin_memory)

    def host_thread(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()


TORCH_CUDA: CudaRuntime = _TorchCuda()
"""The real CUDA runtime, through ``torch.cuda``."""


class Cuda:
    """:class:`Accelerator` over a :class:`CudaRuntime` (``torch.cuda`` by default)."""

    name = "cuda"

    def __init__(self, runtime: CudaRuntime | None = None) -> None:
        self.runtime: CudaRuntime = TORCH_CUDA if runtime is None else runtime

    @property
    def device_type(self) -> str:
        return self.runtime.device_type

    def available(self) -> bool:
        return self.runtime.is_available()

    def is_device(self, device: torch.device) -> bool:
        return device.type == self.runtime.device_type

    def on_device(self, t: torch.Tensor) -> bool:
        return self.runtime.on_device(t)

    def normalize(self, device: torch.device) -> torch.device:
        if device.type == "cuda" and device.index is None:
            return torch.device("cuda", self.runtime.current_device())
        return device

    def host_empty(self, shape: Any, dtype: torch.dtype, *, pinned: bool) -> torch.Tensor:
        """Host memory; pinned memory of ``REGISTER_MIN_BYTES`` or more is page-locked
        in place (``cudaHostRegister``) rather than taken from torch's caching host
        allocator, which rounds every size up to a power of two (12.9 GB of state
        would hold 16 GiB). Locking pages costs about as much as ``cudaHostAlloc``
        (seconds for tens of GB); ``OffloadOptimizer(reserve=True)`` pays it at
        construction."""
        if not (pinned and self.available()):
            return self.runtime.empty(shape, dtype, False)
        numel = 1
        for d in (shape if isinstance(shape, (tuple, list, torch.Size)) else (shape,)):
            numel *= int(d)
        if numel * dtype.itemsize >= REGISTER_MIN_BYTES:
            registered = _registered_empty(numel, dtype, self.runtime)
            if registered is not None:
                return registered.view(shape)
        return self.runtime.empty(shape, dtype, True)

    def is_pinned(self, t: torch.Tensor) -> bool:
        return self.runtime.is_pinned(t)

    def new_stream(self, device: torch.device, priority: int = 0, name: str = "") -> Any:
        """A stream of pipeoff's own (``cudaStreamCreateWithPriority``, non-blocking).

        ``torch.cuda.Stream()`` hands out one of 32 pooled streams per priority in
        turn, shared with NCCL, FSDP2 and torchft: a lane could share a stream with
        one of them and lose its overlap. Falls back to a pooled stream, with a
        warning, when the CUDA runtime library cannot be called.
        """
        stream = _dedicated_stream(device, priority, self.runtime)
        if stream is None:
            stream = self.runtime.Stream(device, priority)
        if name:
            self.runtime.label_stream(stream, name)
        return stream

    def current_stream(self, device: torch.device | None = None) -> Any:
        return self.runtime.current_stream(device)

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return self.runtime.stream(stream)

    def use_device(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        return self.runtime.device(device)

    def new_event(self, timing: bool = False) -> Any:
        return self.runtime.Event(enable_timing=timing, blocking=not timing)

    def launch(self, stream: Any, fn: Callable[[], None]) -> None:
        # The kernels fn enqueues go to the lane's stream, not to whatever stream
        # the issuing thread had current (hazard: a task's work running outside
        # its lane's order, before the waits made on that stream).
        with self.runtime.stream(stream):
            fn()

    def sleep(self, stream: Any, seconds: float) -> None:
        with self.runtime.stream(stream):
            self.runtime.sleep(int(seconds * _SLEEP_CYCLES_PER_S))

    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        self.runtime.record_stream(t, stream)

    def synchronize(self, device: torch.device | None = None) -> None:
        # Every stream of the device, not the current one: callers wait here for
        # lanes' work (hazard: reading a result a lane's stream still writes).
        self.runtime.synchronize(device)

    def is_capturing(self) -> bool:
        return self.runtime.is_available() and self.runtime.is_current_stream_capturing()

    @contextlib.contextmanager
    def range(self, name: str) -> Iterator[None]:
        self.runtime.range_push(name)
        try:
            yield
        finally:
            self.runtime.range_pop()

    def host_thread(self) -> contextlib.AbstractContextManager[Any]:
        return self.runtime.host_thread()


REGISTER_MIN_BYTES = 64 << 20
"""Pinned host allocations from this size on are page-locked in place (exact size)."""

_CUDA_STREAM_NON_BLOCKING = 1  # cudaStreamNonBlocking: no implicit sync with stream 0
_CUDA_HOST_REGISTER_DEFAULT = 0


class _PageLocked(mmap.mmap):
    """Anonymous host memory, page-locked with ``cudaHostRegister``.

    ``torch.frombuffer`` keeps this object alive for as long as any storage uses
    its memory; when the last one goes, the pages are unregistered before they
    are unmapped (CUDA requires it).
    """

    address = 0
    cudart: Any = None

    def __del__(self) -> None:
        if self.address:
            self.cudart.cudaHostUnregister(self.address)
            self.address = 0


def _registered_empty(numel: int, dtype: torch.dtype,
                      runtime: CudaRuntime = TORCH_CUDA) -> torch.Tensor | None:
    nbytes = max(1, numel) * dtype.itemsize
    memory = _PageLocked(-1, nbytes)
    t = torch.frombuffer(memory, dtype=torch.uint8, count=nbytes)
    address = t.data_ptr()
    cudart = runtime.cudart()
    err = cudart.cudaHostRegister(address, nbytes, _CUDA_HOST_REGISTER_DEFAULT)
    if err != cudart.cudaError.success:
        warnings.warn(f"pipeoff: cudaHostRegister of {nbytes} bytes failed ({err}); using "
                      "torch's pinned allocator, which rounds sizes up to a power of two",
                      RuntimeWarning, stacklevel=3)
        return None
    memory.cudart = cudart
    memory.address = address
    return t.view(dtype)[:numel]


_libcudart: Any = None


def _cudart_library() -> Any:
    """The CUDA runtime that torch loaded (by soname: ``dlopen`` finds it loaded)."""
    global _libcudart
    if _libcudart is None:
        major = (torch.version.cuda or "12").split(".")[0]
        for soname in (f"libcudart.so.{major}", "libcudart.so"):
            try:
                _libcudart = ctypes.CDLL(soname)
                break
            except OSError:
                continue
        else:
            _libcudart = False
    return _libcudart


def _dedicated_stream(device: torch.device, priority: int,
                      runtime: CudaRuntime = TORCH_CUDA) -> Any:
    lib = runtime.libcudart()
    if not lib:
        warnings.warn("pipeoff: the CUDA runtime library could not be loaded; lanes use "
                      "torch's pooled streams, which NCCL and FSDP2 may share",
                      RuntimeWarning, stacklevel=3)
        return None
    handle = ctypes.c_void_p()
    with runtime.device(device):
        err = lib.cudaStreamCreateWithPriority(ctypes.byref(handle),
                                               ctypes.c_uint(_CUDA_STREAM_NON_BLOCKING),
                                               ctypes.c_int(priority))
    if err != 0 or not handle.value:
        warnings.warn(f"pipeoff: cudaStreamCreateWithPriority failed ({err}); lanes use "
                      "torch's pooled streams", RuntimeWarning, stacklevel=3)
        return None
    # Never destroyed: pipeoff keeps its lanes' streams for the life of the process.
    return runtime.ExternalStream(handle.value, device)


_lock = threading.Lock()
_current: Accelerator = Cuda()


def current() -> Accelerator:
    """The accelerator pipeoff uses (CUDA, unless a test installed the simulated one)."""
    return _current


@contextlib.contextmanager
def use(accel: Accelerator) -> Iterator[Accelerator]:
    """Make ``accel`` the accelerator inside the block (for tests)."""
    global _current
    with _lock:
        prior, _current = _current, accel
    try:
        yield accel
    finally:
        with _lock:
            _current = prior
