"""The device a CUDA test runs on: the simulated CUDA device, or a real GPU."""

from __future__ import annotations

from typing import Any

import torch


class Gpu:
    """What a CUDA test needs, on a real GPU or on the simulated device."""

    def __init__(self, sim: Any = None) -> None:
        from pipeoff import _accel

        self.sim = sim
        self.accel = _accel.current()
        self.device = sim.device if sim is not None else torch.device(
            "cuda", torch.cuda.current_device())

    @property
    def simulated(self) -> bool:
        return self.sim is not None

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` in device memory."""
        return t.clone() if self.simulated else t.to(self.device)

    def zeros(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.zeros(*shape, dtype=dtype, device=self.device)

    def host(self, *shape: int, dtype: torch.dtype = torch.float32,
             pinned: bool = True) -> torch.Tensor:
        return self.accel.host_empty(shape, dtype, pinned=pinned)

    def module(self, m: torch.nn.Module) -> torch.nn.Module:
        return m if self.simulated else m.to(self.device)

    def current_stream(self) -> Any:
        return self.accel.current_stream(self.device)

    def synchronize(self) -> None:
        self.accel.synchronize(self.device)

    def read(self, t: torch.Tensor) -> torch.Tensor:
        """``t``'s values on the host, after the device is done with everything."""
        self.synchronize()
        return t.detach().clone() if self.simulated else t.detach().cpu()
