"""torchft integrations: LocalSGD with RFC 0003 CPU staging, sequential or pipelined.

Importing this package imports torchft; ``import pipeoff`` does not.
"""

from __future__ import annotations

from pipeoff.ft._local_sgd import DEFAULT_BUCKET_BYTES, LocalSGD

__all__ = [
    # LocalSGD
    "DEFAULT_BUCKET_BYTES",
    "LocalSGD",
]
