"""The process's distributed context: its rank, and which memory a group's collectives take."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["all_reduce_host", "rank", "takes_host_tensors"]


def rank() -> int:
    """``torch.distributed.get_rank()`` if a default process group exists, else 0."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:  # noqa: BLE001 - a trace must never fail for its metadata
        pass
    return 0


def takes_host_tensors(group: Any) -> bool:
    """Whether collectives over ``group`` accept CPU tensors: a gloo group, or one made
    with torch's default ``"cpu:gloo,cuda:nccl"`` backends; not an NCCL-only group
    (``init_process_group("nccl")`` and the ``DeviceMesh`` groups made from it, FSDP2's
    usual set-up on GPUs), which refuses them ("No backend type associated with device
    type cpu")."""
    types = getattr(group, "_device_types", None)  # the backends' devices (torch >= 2.2)
    if types is not None:
        return any(torch.device(t).type == "cpu" for t in types)
    import torch.distributed as dist

    try:
        backend = str(dist.get_backend(group)).lower()
    except Exception:  # noqa: BLE001 - a group torch does not know: assume the host's
        return True
    return "nccl" not in backend or "cpu:" in backend


def all_reduce_host(t: torch.Tensor, group: Any, device: torch.device,
                    op: Any = None) -> torch.Tensor:
    """``t`` (a host tensor) summed over ``group`` (or reduced by ``op``, a
    ``dist.ReduceOp``), on the host.

    A group that takes host tensors reduces ``t`` in place; one that does not (NCCL)
    gets a copy in ``device`` memory (the caller's accelerator: an index must be given,
    since a worker thread's current device is not the rank's), and the sum comes back.
    """
    import torch.distributed as dist

    op = dist.ReduceOp.SUM if op is None else op
    if takes_host_tensors(group):
        dist.all_reduce(t, op=op, group=group)
        return t
    dev = t.to(device, copy=True)
    dist.all_reduce(dev, op=op, group=group)
    # A synchronous all_reduce makes the current stream wait for NCCL's; the copy back
    # runs on that stream and blocks the host, so the host never reads the sum early.
    return dev.cpu()
