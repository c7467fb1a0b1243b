"""The device's training compute, as the simulator charges it: FLOPs at an MFU.

A feature's graph says what pipeoff moves and computes; whether that hides
under training depends on how long the training step's own compute takes. The
simulator prices it the way scaling studies do: a forward pass costs
``2 N`` FLOPs per token for the ``N`` parameters a token passes through (for a
mixture of experts, the active ones) plus ``2 L s d`` for attention over a
context of ``s`` tokens (``L`` layers of width ``d``; Kaplan et al. 2020, the
formula PaLM's MFU uses), the backward twice the forward, at a model FLOPs
utilization (MFU) of the device's dense peak.

Tasks that stand for this compute run on the lanes :data:`TRAIN_LANES`; a task
there carries its FLOPs in ``nbytes`` (the field the simulator charges; such
tasks exist in simulated graphs only, they have no work).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipeoff._errors import ConfigError

__all__ = ["DeviceCompute", "FORWARD_LANE", "BACKWARD_LANE", "H200_MEMORY_BYTES", "MFU_DENSE",
           "MFU_MOE", "TRAIN_LANES", "forward_flops"]

MFU_DENSE = 0.40
"""MFU of a dense decoder's training step: Llama 3's pre-training reached 38-43 % BF16
MFU on H100s (Dubey et al. 2024, "The Llama 3 Herd of Models", Table 4)."""
MFU_MOE = 0.166
"""MFU of a mixture of experts' training step: prime-rl's own benchmark table
(PrimeIntellect-ai/prime-rl ``benchmarks/results/BENCHMARKS.md``, Qwen3-30B-A3B, SFT full,
16K, FSDP over 8xH200, FA3, activations recomputed: 16.6 %), with its FLOPs counted as
here (6 x active parameters + attention per token)."""
H200_MEMORY_BYTES = 141 * 10**9
"""An H200's memory: 141 GB of HBM3e (NVIDIA's H200 datasheet)."""

FORWARD_LANE = "forward"
BACKWARD_LANE = "backward"
TRAIN_LANES = (FORWARD_LANE, BACKWARD_LANE)


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceCompute:
    """One device's training compute: ``peak_flops`` dense FLOP/s at ``mfu``.

    Raises:
        ConfigError: ``peak_flops`` not a positive finite number, or ``mfu`` outside
            (0, 1].
    """

    name: str = "custom"
    peak_flops: float
    """Dense BF16 FLOP/s of one device."""
    mfu: float
    """Model FLOPs utilization: the share of the peak the training step's compute gets."""
    memory_bytes: int | None = None
    """The device's memory in bytes (``None``: not known)."""

    def __post_init__(self) -> None:
        p = self.peak_flops
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not math.isfinite(p) \
                or p <= 0:
            raise ConfigError(f"DeviceCompute.peak_flops must be a positive finite number, "
                              f"got {p!r}")
        m = self.mfu
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 < m <= 1:
            raise ConfigError(f"DeviceCompute.mfu must be in (0, 1], got {m!r}")

    @property
    def flops_per_s(self) -> float:
        """FLOP/s the training compute runs at."""
        return self.peak_flops * self.mfu

    def seconds(self, flops: float) -> float:
        """How long ``flops`` of training compute take."""
        return flops / self.flops_per_s

    @classmethod
    def h200(cls, *, mfu: float = MFU_DENSE) -> DeviceCompute:
        """An H200 (SXM): 989 TFLOP/s dense BF16 (NVIDIA's H200 datasheet: 1,979 with
        2:4 sparsity), at an MFU of 40 %: Llama 3's pre-training reached 38-43 % BF16
        MFU on H100s (Dubey et al. 2024, "The Llama 3 Herd of Models", Table 4), and an
        H200 is an H100's compute with more and faster memory."""
        return cls(name=f"h200 @ {mfu:.1%} MFU", peak_flops=989e12, mfu=mfu,
                   memory_bytes=H200_MEMORY_BYTES)


def forward_flops(active_params: int, tokens: int, *, layers: int = 0, hidden: int = 0,
                  seq_len: int = 0) -> float:
    """FLOPs of one forward pass over ``tokens`` tokens: ``2 N`` per token for the
    ``active_params`` ``N`` each passes through, plus ``2 L s d`` for attention over a
    context of ``seq_len`` (``layers`` ``L``, ``hidden`` ``d``; 0 leaves it out)."""
    return float(tokens) * (2.0 * active_params + 2.0 * layers * seq_len * hidden)
