"""torchft integrations: LocalSGD with RFC 0003 CPU staging, sequential or pipelined, and
DiLoCo with its outer state and pseudo-gradients in host memory.

Importing :class:`LocalSGD` or :class:`DiLoCo` imports torchft (on first use of the name);
``import pipeoff`` and ``import pipeoff.ft`` do not, so the simulator can
build LocalSGD's graphs without torchft installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipeoff.ft._buckets import DEFAULT_BUCKET_BYTES

if TYPE_CHECKING:
    from pipeoff.ft._diloco import DiLoCo
    from pipeoff.ft._local_sgd import LocalSGD

__all__ = [
    # LocalSGD
    "DEFAULT_BUCKET_BYTES",
    "DiLoCo",
    "LocalSGD",
]


def __getattr__(name: str) -> Any:
    if name == "LocalSGD":
        from pipeoff.ft._local_sgd import LocalSGD

        return LocalSGD
    if name == "DiLoCo":
        from pipeoff.ft._diloco import DiLoCo

        return DiLoCo
    raise AttributeError(f"module 'pipeoff.ft' has no attribute {name!r}")


def __dir__() -> list[str]:
    # Tab completion (and dir()) lists the names imported on first use too.
    return sorted(set(globals()) | set(__all__))
