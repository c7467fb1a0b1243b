"""pipeoff's import makes the process's first MKL vector-math call on one thread
(``pipeoff/_vml.py``): VML's CPU dispatch is set before any parallel op can race it.

The dispatch static is read at its address in this exact torch build (found by
disassembly, ``/tmp/race2`` of the 2026-12-06 investigation); elsewhere the test skips.
The race itself (a few % of fresh processes under load) is not reproduced here.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

_PROBE = r"""
import ctypes, os, sys, torch
lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
base = ctypes.cast(lib.vmsSqrt, ctypes.c_void_p).value - 0x8c208a0
cpu_type = ctypes.c_int.from_address(base + 0x148ebf20)
before = cpu_type.value
import pipeoff
print(before, cpu_type.value)
"""


@pytest.mark.skipif(torch.__version__ != "2.13.0+cpu",
                    reason="the dispatch static's address is this build's")
def test_importing_pipeoff_sets_mkl_vector_maths_dispatch() -> None:
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    before, after = int(out[0]), int(out[1])
    if before != -1:
        pytest.skip(f"the static read {before} before any call: not this build's layout")
    assert after != -1, after  # (set: the table index of this CPU, 5 with AVX-512)
