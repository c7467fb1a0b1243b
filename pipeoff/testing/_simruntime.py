"""The simulated device's fake of the torch and CUDA runtime calls of :class:`pipeoff._accel.Cuda`.

:func:`pipeoff.testing.simulated_cuda` installs ``Cuda(SimRuntime(sim))``: the
real class, whose every runtime call lands here, on the simulated device.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from pipeoff.testing._simcuda import SimEvent, SimStream, SimulatedCuda

__all__ = ["SimRuntime"]


class SimRuntime:
    """:class:`pipeoff._accel.CudaRuntime` over a :class:`SimulatedCuda`: the few torch and
    CUDA runtime entry points that :class:`pipeoff._accel.Cuda` calls, faked, so that the
    real ``Cuda`` class runs on the simulated device.

    ``cudaStreamCreateWithPriority`` (through ``ctypes``) makes a simulated stream and
    returns its handle, which ``ExternalStream`` maps back; ``cudaHostRegister``
    page-locks a range of host memory in the simulation (a non-blocking copy from
    it is stream work); ``record_stream``, ``synchronize``, events and the current
    stream are the device's own.
    """

    device_type = "cpu"

    class cudaError:  # noqa: N801 - the runtime's spelling
        success = 0

    def __init__(self, sim: SimulatedCuda) -> None:
        self.sim = sim
        self._handles: dict[int, SimStream] = {}
        self.stream_flags: dict[SimStream, int] = {}
        """Per stream made by ``cudaStreamCreateWithPriority``, the flags it was made with."""
        self.registered: dict[int, int] = {}
        """Page-locked host ranges: start address -> bytes."""

    # -- torch.cuda --------------------------------------------------------------------
    def is_available(self) -> bool:
        return True

    def current_device(self) -> int:
        return 0

    def current_stream(self, device: torch.device | None) -> SimStream:
        return self.sim.current_stream(device)

    def stream(self, stream: SimStream) -> contextlib.AbstractContextManager[Any]:
        if not isinstance(stream, SimStream):
            raise TypeError(f"torch.cuda.stream() of {stream!r}: not a stream of this device")
        return self.sim.use_stream(stream)

    def device(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def Event(self, enable_timing: bool, blocking: bool) -> SimEvent:  # noqa: N802
        return SimEvent(self.sim, timing=enable_timing)

    def Stream(self, device: torch.device, priority: int) -> SimStream:  # noqa: N802
        return self.sim.new_stream(device, priority, name=f"pooled{len(self.sim.streams)}")

    def ExternalStream(self, stream_ptr: int, device: torch.device) -> SimStream:  # noqa: N802
        try:
            return self._handles[stream_ptr]
        except KeyError:
            raise RuntimeError(f"ExternalStream({stream_ptr:#x}): no stream has this "
                               "handle") from None

    def synchronize(self, device: torch.device | None) -> None:
        self.sim.synchronize(device)

    def is_current_stream_capturing(self) -> bool:
        return self.sim.capturing

    def sleep(self, cycles: int) -> None:
        from pipeoff._accel import _SLEEP_CYCLES_PER_S

        self.sim.sleep(self.sim.current_stream(), cycles / _SLEEP_CYCLES_PER_S)

    def range_push(self, name: str) -> None:
        pass

    def range_pop(self) -> None:
        pass

    # -- tensors ------------------------------------------------------------------------
    def label_stream(self, stream: SimStream, name: str) -> None:
        stream.name = name

    def record_stream(self, t: torch.Tensor, stream: SimStream) -> None:
        self.sim.record_stream(t, stream)

    def is_pinned(self, t: torch.Tensor) -> bool:
        return self.sim.memory.is_pinned(t)

    def on_device(self, t: torch.Tensor) -> bool:
        return self.sim.memory.on_device(t)

    def empty(self, shape: Any, dtype: torch.dtype, pin_memory: bool) -> torch.Tensor:
        return self.sim.host_empty(shape, dtype, pinned=pin_memory)

    def host_thread(self) -> contextlib.AbstractContextManager[Any]:
        return self.sim.host_thread()

    # -- the CUDA runtime -----------------------------------------------------------------
    def cudart(self) -> SimRuntime:
        return self

    def libcudart(self) -> SimRuntime:
        return self

    def cudaStreamCreateWithPriority(self, p_stream: Any, flags: Any,  # noqa: N802
                                     priority: Any) -> int:
        stream = self.sim.new_stream(self.sim.device, int(priority.value),
                                     name=f"stream{len(self.sim.streams)}")
        handle = 0x1000 + len(self._handles)
        self._handles[handle] = stream
        self.stream_flags[stream] = int(flags.value)
        p_stream._obj.value = handle
        return 0

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:  # noqa: N802
        self.sim.register_range(ptr, nbytes, pinned=True)
        self.registered[ptr] = nbytes
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        nbytes = self.registered.pop(ptr, None)
        if nbytes is None:
            return 1  # cudaErrorInvalidValue: "not registered"
        self.sim.host_freed(ptr, ptr + nbytes, True)
        return 0
