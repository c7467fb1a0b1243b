"""torchft integrations: LocalSGD with RFC 0003 CPU staging, sequential or pipelined.

Importing :class:`LocalSGD` imports torchft (on first use of the name);
``import pipeoff`` and ``import pipeoff.ft`` do not, so the simulator can
build LocalSGD's graphs without torchft installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipeoff.ft._buckets import DEFAULT_BUCKET_BYTES

if TYPE_CHECKING:
    from pipeoff.ft._local_sgd import LocalSGD

__all__ = [
    # LocalSGD
    "DEFAULT_BUCKET_BYTES",
    "LocalSGD",
]


def __getattr__(name: str) -> Any:
    if name == "LocalSGD":
        from pipeoff.ft._local_sgd import LocalSGD

        return LocalSGD
    raise AttributeError(f"module 'pipeoff.ft' has no attribute {name!r}")
