"""The host side of a node, as the simulator charges a rank's host work against it.

A node's ranks share its DRAM bandwidth and its cores. Each rank's host tasks
(the full-offload step and fold, DiLoCo's outer step) move a known number of
bytes per element (the kernels' own counts, :data:`HOST_OP_BYTES`), and its
pinned copies read or write host memory at the link's rate. While several of
them run at once on a rank they share that rank's part of the node's memory
bandwidth: when what they would draw together exceeds it, each is slowed in
proportion (a fluid share). The flat model before this one charged every host
task the same elements per second and nothing shared it; it stays available for
comparison (``host=None`` in :class:`~pipeoff.sim.CostModel`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from types import MappingProxyType

from pipeoff._errors import ConfigError
from pipeoff._validate import check_int

__all__ = ["HOST_DESIGNS", "HOST_OP_BYTES", "ONE_PASS_DESIGNS", "HostCosts", "HostNode"]

GB = 1e9

HOST_OP_BYTES: Mapping[str, Mapping[str, float]] = MappingProxyType({
    # What pipeoff runs: the native kernels (docs/host_step.md, docs/diloco.md), the
    # final micro-step in one pass: its BF16 gradients held, folded inside the step.
    "native": MappingProxyType({
        "accumulate": 10.0,  # a non-final fold: BF16 gradient (2), FP32 sum r/w (8)
        "host_step": 32.0,   # fold + AdamW + cast: gradient (2), sum (4), master and two
                             # moments r/w (24), BF16 weight (2)
        "outer_step": 20.0,  # SGD + Nesterov: gradient (4), buffer r/w (8), parameter r/w (8)
    }),
    # The native kernels with the final fold apart (clipping, a read of the gradients
    # before step(), overlap="backward"): fold 10 at arrival, then step and cast 30
    # (40 B in all; the pricing before the one-pass step).
    "native-fold": MappingProxyType({
        "accumulate": 10.0,
        "host_step": 30.0,   # AdamW + cast: master, two moments r/w (24), sum (4), BF16 (2)
        "outer_step": 20.0,
    }),
    # torch's kernels for the same math: the fold in pieces (10), fused AdamW then a
    # cast pass (28 + 6), the for-loop SGD's five passes (44).
    "torch": MappingProxyType({
        "accumulate": 10.0,
        "host_step": 34.0,
        "outer_step": 44.0,
    }),
})
"""Logical host-memory bytes per element of each host lane's tasks, per design (the
counts ``benchmarks/bench_host_step.py`` and ``bench_outer_step.py`` time against)."""

ONE_PASS_DESIGNS = frozenset({"native"})
"""The designs whose full-offload final micro-step is one pass: its gradients are held
(their ``acc`` tasks fold nothing) and ``host_step`` is the fold, step and cast."""

HOST_DESIGNS = tuple(HOST_OP_BYTES)


@dataclass(frozen=True, kw_only=True, slots=True)
class HostNode:
    """One node's host: ``ranks`` ranks (one per GPU) sharing ``dram_gbps`` of memory
    bandwidth and ``cores`` cores over ``numa_nodes`` sockets.

    A rank's host bandwidth is its share of the node's, ``dram_gbps / ranks``, at
    most what its ``cores // ranks`` threads can draw (``core_gbps`` each). Without
    NUMA binding (``numa_bound=False``) a rank's memory is spread over the sockets
    and the remote part runs at ``remote_factor`` of the local rate.

    Raises:
        ConfigError: a count below 1, a bandwidth not a positive finite number, or a
            ``remote_factor`` outside (0, 1].
    """

    name: str = "custom"
    """A label for tables and traces."""
    ranks: int
    """Ranks (GPUs) on the node, each with its own host work."""
    cores: int
    """Physical cores of the node."""
    numa_nodes: int = 1
    """Sockets (NUMA nodes); the ranks are spread evenly over them."""
    dram_gbps: float
    """The node's sustained memory bandwidth, all sockets, GB/s (1e9 bytes/s)."""
    core_gbps: float
    """What one core's stream draws alone, GB/s."""
    remote_factor: float = 1.0
    """Share of the local rate a remote (other socket) access runs at."""
    numa_bound: bool = True
    """Each rank's threads and memory on one socket (``numactl``, or the launcher's
    binding)."""

    def __post_init__(self) -> None:
        for name in ("ranks", "cores", "numa_nodes"):
            check_int(f"HostNode.{name}", getattr(self, name), as_bound=True)
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in ("dram_gbps", "core_gbps", "remote_factor") and (
                    isinstance(v, bool) or not isinstance(v, (int, float))
                    or not math.isfinite(v) or v <= 0):
                raise ConfigError(f"HostNode.{f.name} must be a positive finite number, "
                                  f"got {v!r}")
        if self.remote_factor > 1:
            raise ConfigError(f"HostNode.remote_factor must be in (0, 1], got "
                              f"{self.remote_factor!r}")
        if not isinstance(self.numa_bound, bool):
            raise ConfigError(f"HostNode.numa_bound must be True or False, got "
                              f"{self.numa_bound!r}")

    @property
    def threads_per_rank(self) -> int:
        """The cores each rank's host work may use (at least one)."""
        return max(1, self.cores // self.ranks)

    @property
    def rank_gbps(self) -> float:
        """One rank's host memory bandwidth while every rank works at once, GB/s."""
        share = self.dram_gbps / self.ranks
        if not self.numa_bound and self.numa_nodes > 1:
            local = 1 / self.numa_nodes  # the part of its pages on its own socket
            share *= local + (1 - local) * self.remote_factor
        return min(share, self.threads_per_rank * self.core_gbps)

    @classmethod
    def h200_node(cls, *, numa_bound: bool = True) -> HostNode:
        """An 8-GPU H200 node (NVIDIA DGX H200 / HGX H200 8-GPU): public figures.

        - NVIDIA DGX H200 datasheet: 8 H200, two Intel Xeon Platinum 8480C
          (56 cores each, 112 in all), 2 TB of DDR5;
        - Intel's specification of the 8480C: 8 DDR5-4800 channels per socket,
          8 x 4800 MT/s x 8 B = 307.2 GB/s per socket, 614.4 GB/s per node peak;
        - sustained: 80 % of peak assumed (491.5 GB/s; STREAM-like kernels reach
          about that on DDR5 servers; ``benchmarks/gpu_suite.py`` measures it on the
          first node it runs on);
        - one core about 12 GB/s alone (assumed; a core's outstanding misses bound
          it, so 14 threads per rank are more than its 61 GB/s share needs);
        - a remote socket's memory at 0.6 of the local rate over UPI (assumed).
        """
        return cls(name="h200_node" if numa_bound else "h200_node_unbound", ranks=8,
                   cores=112, numa_nodes=2, dram_gbps=0.8 * 2 * 307.2, core_gbps=12.0,
                   remote_factor=0.6, numa_bound=numa_bound)


@dataclass(frozen=True, kw_only=True, slots=True)
class HostCosts:
    """What the simulator charges a rank's host work: ``node``'s per-rank bandwidth,
    and per host lane the bytes an element of its tasks moves (``design``'s
    :data:`HOST_OP_BYTES`). Host tasks on other lanes keep the flat rate.

    Raises:
        ConfigError: an unknown ``design``.
    """

    node: HostNode
    design: str = "native"

    def __post_init__(self) -> None:
        if not isinstance(self.node, HostNode):
            raise ConfigError(f"HostCosts.node must be a HostNode, got {self.node!r}")
        if self.design not in HOST_OP_BYTES:
            raise ConfigError(f"HostCosts.design must be one of {', '.join(HOST_DESIGNS)}, "
                              f"got {self.design!r}")

    @property
    def one_pass(self) -> bool:
        """Whether the full-offload final micro-step is one pass (:data:`ONE_PASS_DESIGNS`)."""
        return self.design in ONE_PASS_DESIGNS

    @property
    def bytes_per_elem(self) -> Mapping[str, float]:
        return HOST_OP_BYTES[self.design]

    @property
    def rank_bytes_per_s(self) -> float:
        return self.node.rank_gbps * GB

    def task_seconds(self, lane: str, elems: float) -> float | None:
        """Seconds a task of ``elems`` elements on ``lane`` takes with the rank's host
        bandwidth to itself, or ``None`` if ``lane`` is not one this model knows."""
        per = self.bytes_per_elem.get(lane)
        if per is None:
            return None
        return elems * per / self.rank_bytes_per_s
