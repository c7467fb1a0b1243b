"""The cost model the simulator charges tasks against."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from pipeoff._errors import ConfigError
from pipeoff._validate import check_int
from pipeoff.sim._compute import DeviceCompute
from pipeoff.sim._hostnode import HostCosts

__all__ = ["CostModel"]

GB = 1e9


@dataclass(frozen=True, kw_only=True, slots=True)
class CostModel:
    """Throughputs and latencies of one machine, as the simulator sees it.

    A copy costs ``bytes / bandwidth``; while copies run in both directions at
    once, each direction runs at its ``*_bidir_factor`` of its own bandwidth
    (copy engines and the host link share work). A ring all-reduce of ``b``
    bytes over ``n`` participants costs ``2 (n-1)/n * b / interconnect`` plus
    ``2 (n-1)`` hops of latency. Every task pays ``launch_overhead_s``.

    With ``host`` (a :class:`~pipeoff.sim.HostCosts`), a host task on a lane it knows
    costs its elements times the bytes each moves over the rank's share of the
    node's memory bandwidth, and the rank's host tasks and pinned copies running at
    once share that bandwidth; without it (the flat model) every host task runs at
    ``cpu_optimizer_elems_per_s`` and nothing shares.
    """

    name: str = "custom"
    """A label for tables and traces."""
    h2d_gbps: float
    """Host-to-device copy bandwidth alone, GB/s (1e9 bytes per second)."""
    d2h_gbps: float
    """Device-to-host copy bandwidth alone, GB/s."""
    h2d_bidir_factor: float = 1.0
    """Share of ``h2d_gbps`` left while a D2H copy runs at the same time."""
    d2h_bidir_factor: float = 1.0
    """Share of ``d2h_gbps`` left while an H2D copy runs at the same time."""
    copy_compute_factor: float = 1.0
    """Share of full speed that copies and optimizer chunks keep while both run
    (1.0 on a GPU, where copy engines and SMs are separate; less on a CPU,
    where both stream through the same memory)."""
    hbm_gbps: float
    """Device memory bandwidth, GB/s (device-to-device copies read and write)."""
    interconnect_gbps: float
    """Per-participant bus bandwidth of collectives, GB/s."""
    interconnect_latency_s: float = 10e-6
    """Latency of one ring hop."""
    participants: int = 2
    """Ranks in the all-reduce (replicas for LocalSGD)."""
    optimizer_elems_per_s: float
    """Element-wise optimizer throughput on the device (elements per second)."""
    cpu_optimizer_elems_per_s: float
    """Optimizer throughput of a host (CPU) optimizer task."""
    launch_overhead_s: float = 5e-6
    """Host cost of issuing one task."""
    optimizer_bytes_per_elem: int = 4
    """How many of an optimizer chunk's ``nbytes`` are one element (fp32: 4)."""
    host: HostCosts | None = None
    """The rank's host node (:class:`~pipeoff.sim.HostCosts`), or ``None``: the flat
    host rate above."""
    compute: DeviceCompute | None = None
    """The device's training compute (:class:`~pipeoff.sim.DeviceCompute`), for the
    forward and backward tasks a simulated training step has; ``None``: none."""

    def __post_init__(self) -> None:
        if self.host is not None and not isinstance(self.host, HostCosts):
            raise ConfigError(f"CostModel.host must be a pipeoff.sim.HostCosts or None, "
                              f"got {self.host!r}")
        if self.compute is not None and not isinstance(self.compute, DeviceCompute):
            raise ConfigError(f"CostModel.compute must be a pipeoff.sim.DeviceCompute or "
                              f"None, got {self.compute!r}")
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in ("name", "host", "compute"):
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ConfigError(f"CostModel.{f.name} must be a finite number, got {v!r}")
            positive = f.name not in ("interconnect_latency_s", "launch_overhead_s")
            if (positive and v <= 0) or v < 0:
                raise ConfigError(
                    f"CostModel.{f.name} must be {'> 0' if positive else '>= 0'}, got {v!r}"
                )
        for factor in ("h2d_bidir_factor", "d2h_bidir_factor", "copy_compute_factor"):
            if getattr(self, factor) > 1:
                raise ConfigError(
                    f"CostModel.{factor} must be in (0, 1], got {getattr(self, factor)!r}")
        check_int("CostModel.participants", self.participants, as_bound=True)

    def allreduce_s(self, nbytes: int) -> float:
        n = self.participants
        if n == 1:
            return 0.0
        return (2 * (n - 1) / n) * nbytes / (self.interconnect_gbps * GB) + (
            2 * (n - 1) * self.interconnect_latency_s
        )

    def copy_rate(self, kind: str, other_direction_active: bool) -> float:
        """Bytes per second of a copy of ``kind`` (``"h2d"`` or ``"d2h"``)."""
        if kind == "h2d":
            f = self.h2d_bidir_factor if other_direction_active else 1.0
            return self.h2d_gbps * GB * f
        f = self.d2h_bidir_factor if other_direction_active else 1.0
        return self.d2h_gbps * GB * f

    def optimizer_s(self, nbytes: int, *, on_host: bool = False) -> float:
        elems = nbytes / self.optimizer_bytes_per_elem
        return elems / (self.cpu_optimizer_elems_per_s if on_host else self.optimizer_elems_per_s)

    @classmethod
    def cpu_here(cls) -> CostModel:
        """This machine, measured at run time (once per process, about a second)."""
        from pipeoff.sim._calibrate import cpu_here

        return cls(**cpu_here())  # type: ignore[arg-type]

    @classmethod
    def preset(cls, name: str, *, participants: int = 2) -> CostModel:
        """``"h200_pcie5"`` or ``"cpu_here"``.

        Raises:
            ConfigError: an unknown preset name.
        """
        if name == "h200_pcie5":
            return cls.h200_pcie5(participants=participants)
        if name == "cpu_here":
            return cls.cpu_here()
        raise ConfigError(f"unknown cost model preset {name!r}; known: 'h200_pcie5', 'cpu_here'")

    @classmethod
    def h200_pcie5(cls, *, participants: int = 2) -> CostModel:
        """An H200 on PCIe 5 with pinned host memory (public figures, REFERENCE.md).

        - copies: about 55 GB/s per direction alone; with both directions
          busy, one H800 measured 52.8 H2D against 34.4 D2H (factors 0.96, 0.63);
        - HBM 4.8 TB/s; NVLink about 450 GB/s per direction, 10 us a hop;
        - fused AdamW is memory-bound at about 28 bytes per element
          (read p, g, m, v; write p, m, v in fp32): 4.8e12 / 28 = 1.7e11 elem/s;
        - CPU Adam at about 1.4e9 params/s (DeepSpeed's figure);
        - training compute: :meth:`DeviceCompute.h200` (989 TFLOP/s BF16 at 40 % MFU).
        """
        return cls(
            name="h200_pcie5",
            h2d_gbps=55.0,
            d2h_gbps=55.0,
            h2d_bidir_factor=52.8 / 55.0,
            d2h_bidir_factor=34.4 / 55.0,
            hbm_gbps=4800.0,
            interconnect_gbps=450.0,
            interconnect_latency_s=10e-6,
            participants=participants,
            optimizer_elems_per_s=4.8e12 / 28,
            cpu_optimizer_elems_per_s=1.4e9,
            launch_overhead_s=5e-6,
            compute=DeviceCompute.h200(),
        )
