"""The private APIs of torch that pipeoff relies on, in one place.

Each helper names the private API it uses, so that a torch release that moves
one fails here, loudly, instead of deep inside a feature.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch

__all__ = ["allreduce_discarded", "dynamo_disable", "eager_math", "force_eager",
           "is_compiling", "recompile_with_hooks", "restore_stance"]

F = TypeVar("F", bound=Callable[..., Any])


def dynamo_disable(fn: F) -> F:
    """``fn`` made opaque to Dynamo (``torch.compiler.disable``): under ``torch.compile``
    it runs eagerly at every call, where the compiled code would call it.

    Imported lazily: ``torch.compiler.disable`` loads Dynamo (and with it
    torch.distributed), which ``import pipeoff`` must not.
    """
    return torch.compiler.disable(fn)  # type: ignore[no-any-return]


def is_compiling() -> bool:
    """Whether Dynamo is tracing the calling code (``torch.compiler.is_compiling``)."""
    return torch.compiler.is_compiling()


def force_eager() -> Any:
    """Make every ``torch.compile``d function run eagerly until :func:`restore_stance`.

    Returns the prior stance, or ``None`` if the stance cannot be set here
    (inside a compiled region). Uses ``torch._dynamo.eval_frame._set_stance``
    (the function behind ``torch.compiler.set_stance``, which returns the prior
    stance only through this private path).
    """
    from torch._dynamo import eval_frame

    try:
        return eval_frame._set_stance(eval_frame.DynamoStance(stance="force_eager"))
    except RuntimeError:  # "attempted to set_stance in a torch.compile region"
        return None


def restore_stance(prior: Any) -> bool:
    """Put back a stance :func:`force_eager` returned; whether it could be done here."""
    if prior is None:
        return True
    from torch._dynamo import eval_frame

    try:
        eval_frame._set_stance(prior)
    except RuntimeError:
        return False
    return True


def recompile_with_hooks(modules: Iterable[torch.nn.Module]) -> None:
    """Make ``torch.compile`` see forward hooks added to ``modules`` now.

    Dynamo skips guarding on module hook dicts by default
    (``torch._dynamo.config.skip_nnmodule_hook_guards``): code compiled before a
    hook was added keeps running without it, silently. This turns the guard on
    (process-wide; a small guard cost per compiled frame) and drops the code
    already compiled for these modules' ``forward`` and for ``nn.Module``'s call
    path (``torch._C._dynamo.eval_frame.reset_code``), so the next call
    recompiles with the hooks in.
    """
    import torch._dynamo
    from torch._C._dynamo.eval_frame import reset_code

    torch._dynamo.config.skip_nnmodule_hook_guards = False
    codes = {torch.nn.Module._call_impl.__code__, torch.nn.Module._wrapped_call_impl.__code__}
    for m in modules:
        code = getattr(getattr(type(m), "forward", None), "__code__", None)
        if code is not None:
            codes.add(code)
    for code in codes:
        reset_code(code)


_eager_math_lock = threading.RLock()
_session_patched = False
_patch_lock = threading.Lock()


def eager_math() -> contextlib.AbstractContextManager[Any]:
    """Hold off ``torch.compile`` sessions while torch's optimizer kernels run on this thread.

    ``torch.compiler.is_compiling()`` reads one process-wide flag that Dynamo
    sets for the whole of a compile session, on whichever thread compiles
    (``torch.compiler._compile_session_context``). torch's optimizers branch on
    it (``torch.optim.optimizer._get_value`` keeps ``step`` a tensor while
    compiling), so an optimizer stepping on a lane thread while the training
    thread compiles its next forward takes the compiled code path and gives
    different bits. pipeoff wraps the session context so that a compile session
    and a chunk's math never overlap: the session waits for the chunk's math
    (milliseconds), the chunk waits for the session. ``torch.export`` sets the
    flag without that context and is not covered.
    """
    global _session_patched
    if not _session_patched:
        with _patch_lock:
            if not _session_patched:
                original = torch.compiler._compile_session_context

                @contextlib.contextmanager
                def session() -> Iterator[None]:
                    with _eager_math_lock, original():
                        yield

                session.__wrapped__ = original  # type: ignore[attr-defined]
                torch.compiler._compile_session_context = session
                _session_patched = True
    return _eager_math_lock


def allreduce_discarded(manager: Any, tensor: torch.Tensor) -> bool:
    """Join an all-reduce of ``tensor`` on torchft ``manager``'s process group, bypassing
    the manager (whose ``allreduce`` is a no-op once an error was reported), and wait.

    For a replica that has failed a sync but must not leave its peers waiting
    for collectives it would skip: it contributes ``tensor`` (summed, as
    torchft's averaging does before dividing) and the result is discarded.
    Uses ``Manager._pg`` (torchft 0.2). Returns whether the collective
    completed; failures are swallowed (the sync has failed already).
    """
    from torch.distributed import AllreduceOptions, ReduceOp

    pg = getattr(manager, "_pg", None)
    if pg is None:
        raise RuntimeError("pipeoff: torchft's Manager no longer keeps its process group in "
                           "`_pg`; pipeoff.ft needs an update for this torchft version")
    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp.SUM  # type: ignore[assignment]
    try:
        pg.allreduce([tensor], opts).wait()
    except Exception:  # noqa: BLE001 - this replica's sync has already failed
        return False
    return True
