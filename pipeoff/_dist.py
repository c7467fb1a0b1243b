"""The process's rank, for trace records (0 without torch.distributed)."""

from __future__ import annotations

__all__ = ["rank"]


def rank() -> int:
    """``torch.distributed.get_rank()`` if a default process group exists, else 0."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:  # noqa: BLE001 - a trace must never fail for its metadata
        pass
    return 0
