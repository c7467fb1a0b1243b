"""The end of an offload-optimizer step: the join of its two parts, and what a failure left.

A step has a host part (the chunks, on pipeoff's lanes) and, with an
``offload_fraction`` below 1, a device part (torch's own kernel on the caller's
stream); see ``[Note: the two parts of a step]`` in
:mod:`~pipeoff.optim._offload._device_part`. These functions run on the caller's
thread once the host part has finished or failed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from pipeoff import _accel, _compat, _faults
from pipeoff._contract import StepWrites
from pipeoff._lowlevel import settle
from pipeoff.optim._hooks import set_post_optim_event
from pipeoff.optim._offload._device_part import DEVICE_PART_TASK

if TYPE_CHECKING:
    from pipeoff._contract import Health
    from pipeoff.optim._offload._graph import Step
    from pipeoff.optim._waits import ForwardWaits

__all__ = ["begin_waits", "device_failed", "finish", "note_interrupted_step", "ranges",
           "report"]


def begin_waits(waits: ForwardWaits, st: Step, layout: Any, attached: torch.nn.Module | None,
                device: torch.device) -> list[Any]:
    """Begin the next forward's waits for an overlapped step ``st`` in flight (``grad_of``:
    not ``restore``, which shrinks as chunks are issued); returns their records."""
    records = waits.begin(StepWrites(
        execution=st.execution, write_tasks=st.opt_tasks, params=layout.params,
        chunks_of=layout.chunks_of, device=layout.device, written=st.updated,
        grad_of=st.grad_of))
    if _accel.current().is_device(layout.device):
        root = None if attached is None else _compat.compiled_original(attached)
        if hasattr(root, "set_post_optim_event"):
            # After the device part's kernels: FSDP2's all-gathers read its shards too
            # (see [Note: the two parts of a step]).
            set_post_optim_event(root, device)
    return records


def finish(st: Step, waits: ForwardWaits) -> None:
    """The step is over (waited for, or failed): drop its gradients, end its forward waits."""
    st.grads.clear()
    st.restore.clear()
    waits.end()


def interrupted(err: BaseException) -> None:
    """Note on ``err`` (a Ctrl-C) that it interrupted a wait for the step in flight,
    not the step, which goes on."""
    err.add_note("pipeoff: interrupted while waiting for the optimizer step in flight, "
                 "which goes on: it has not failed and must not be repeated. Call "
                 "wait_for_step() to wait for it.")


def not_begun(err: BaseException) -> None:
    """Note on ``err`` (a Ctrl-C in a ``step()``'s wait for the step before it) that this
    ``step()`` had not begun its own step."""
    err.add_note("pipeoff: the step() interrupted had not begun its own step (nothing of "
                 "it was launched or written): call step() again to take it.")


def note_interrupted_step(err: BaseException, launched: bool) -> None:
    """A Ctrl-C out of ``step()`` that no pipeoff note explains yet (it came outside the
    holds and waits that note it): say whether this ``step()`` had launched its step."""
    if any(n.startswith("pipeoff:") for n in getattr(err, "__notes__", ())):
        return
    if launched:
        err.add_note("pipeoff: this Ctrl-C came after this step() had launched its step, "
                     "which goes on: it has not failed and must not be repeated. Call "
                     "wait_for_step() to wait for it.")
    else:
        not_begun(err)


def report(health: Health, err: BaseException, st: Step, failed: str | None) -> None:
    """After ``err`` failed the step in task ``failed``: give back the gradients of the
    parameters it did not update (call it before :func:`finish`), and note on ``err``
    what it left. If any chunk, or the device part, had written parameters the step is
    torn: ``health`` refuses later steps until a checkpoint is loaded (undoing them
    would need a copy of every parameter; training on silently would compound a
    half-applied step)."""
    for p, g in st.restore.values():
        if p.grad is None:
            p.grad = g
    written = sorted(st.written)
    parts = [f"chunk(s) {ranges(written)} of {len(st.opt_tasks)}"] if written else []
    if st.device_written:
        parts.append("the device part (stepped on the caller's stream)")
    if parts:
        health.torn_cause = err
        health.torn = f"a step failed in {failed!r} after {' and '.join(parts)} had (or may " \
                      "have) written their parameters"
        err.add_note(f"pipeoff: {health.torn}; the parameters and optimizer state are partly "
                     "stepped. Load a checkpoint (model and optimizer load_state_dict) "
                     "before stepping again.")
    else:
        err.add_note(f"pipeoff: the step failed in {failed!r} before any chunk wrote "
                     "a parameter; no parameter was written and the step can be retried.")


def device_failed(health: Health, st: Step, waits: ForwardWaits, err: BaseException) -> None:
    """The device part raised ``err`` while the host part ``st`` was in flight: wait for
    the host part, end the step and :func:`report` what both parts left (a failure of
    the host part too is noted on ``err``).

    Raises:
        KeyboardInterrupt: Ctrl-C during the wait; the host part goes on (the caller
            keeps it in flight) and ``health`` marks the step torn, as it may be.
    """
    if not _faults.disabled("host_part_join"):
        try:
            # Hazard: reporting the step (retry it, or load a checkpoint) while the
            # host part's chunks still write their parameters: a retry would step
            # them twice, a load would be overwritten.
            host_err = settle(st.execution)
        except BaseException:
            health.torn_cause = err
            health.torn = (f"a step failed in {DEVICE_PART_TASK!r}, and the wait for its "
                           "host part was interrupted")
            raise
        if host_err is not None:
            err.add_note(f"pipeoff: the step's host part failed too, in "
                         f"{st.execution.failed_task!r}: {host_err!r}")
    report(health, err, st, DEVICE_PART_TASK)
    finish(st, waits)


def ranges(ks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    out: list[str] = []
    for k in ks:
        if out and k == int(out[-1].rsplit("-", 1)[-1]) + 1:
            out[-1] = f"{out[-1].split('-')[0]}-{k}"
        else:
            out.append(str(k))
    return ", ".join(out)
