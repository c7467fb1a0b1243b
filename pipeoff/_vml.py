"""A torch hazard pipeoff works around at import: the first call of MKL's vector math.

torch's CPU library links Intel MKL statically, and computes float32 ``sqrt``,
``exp``, ``log``, ``tanh`` and more through MKL's vector math (VML), once per
intra-op thread's chunk. VML picks its CPU kernel at its first call in the
process from a static it writes in two unsynchronised stores (the raw CPU code,
then the table index). A thread that reads it in between runs a low-precision
kernel (``x * rsqrt(x)``, about 12 bits) on its chunk: one intra-op thread's
share of the process's first such op comes out about 3e-4 relative off, silently.
In a first AdamW step that op is ``exp_avg_sq.sqrt()``: the step count and the
moments are right and the update is not (found in 5 of 30 fresh processes running
one plain torch AdamW step on 2 cores, and in pipeoff's lanes stepping beside the
training thread). Once set the static stays set, so one single-threaded call
first closes the window for the rest of the process.
"""

from __future__ import annotations

import torch

__all__ = ["warm_vector_math"]

WARMED = False
"""Whether :func:`warm_vector_math` ran in this process."""


def warm_vector_math() -> None:
    """Make the process's first MKL vector-math call, on this thread only (one element:
    no intra-op threads). Harmless where torch has no MKL. On the CPU in float32 whatever
    the defaults (a default CUDA device must not be initialised at import)."""
    global WARMED
    torch.sqrt(torch.ones(1, dtype=torch.float32, device="cpu"))
    WARMED = True
