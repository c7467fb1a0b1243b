"""What both optimizers share: the :class:`~pipeoff._contract.OffloadedOptimizer` surface.

Readiness (``completion_for``, ``live_state``), the transfers reading the host
state (``add_reader``), health and the forward hooks (``attach``, ``detach``)
are written once here, over three questions each optimizer answers about
itself: which tasks of its step in flight write a parameter, which host
tensor holds a parameter's state, and which parameters it steps.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from pipeoff import _compat, _faults
from pipeoff._contract import Health
from pipeoff._errors import ConfigError
from pipeoff._lowlevel import StatsHooks, completions, install_train_hooks, step_stats
from pipeoff.optim._tensors import describe

if TYPE_CHECKING:
    from pipeoff.execution import Completion, Execution
    from pipeoff.optim._readers import Readers
    from pipeoff.optim._waits import ForwardWaits

__all__ = ["Offloaded", "check_in_model", "fires_load_state_dict_hooks",
           "fires_state_dict_hooks", "with_step_hooks"]


def fires_state_dict_hooks(method: Callable[[Any], dict[str, Any]]
                           ) -> Callable[[Any], dict[str, Any]]:
    """``state_dict`` that runs the optimizer's own ``register_state_dict_pre_hook`` /
    ``register_state_dict_post_hook`` hooks, as torch's ``Optimizer.state_dict``
    (which the override replaces) does; a post hook may return a new dict."""
    @functools.wraps(method)
    def state_dict(self: Any) -> dict[str, Any]:
        for pre in _compat.optimizer_hooks(self, "state_dict_pre"):
            pre(self)
        out = method(self)
        for post in _compat.optimizer_hooks(self, "state_dict_post"):
            changed = post(self, out)
            if changed is not None:
                out = changed
        return out
    return state_dict


def fires_load_state_dict_hooks(method: Callable[[Any, dict[str, Any]], None]
                                ) -> Callable[[Any, dict[str, Any]], None]:
    """``load_state_dict`` that runs the optimizer's own load hooks as torch's does: a
    pre hook may return the dict to load instead; post hooks run once it is loaded."""
    @functools.wraps(method)
    def load_state_dict(self: Any, state_dict: dict[str, Any]) -> None:
        for pre in _compat.optimizer_hooks(self, "load_state_dict_pre"):
            changed = pre(self, state_dict)
            if changed is not None:
                state_dict = changed
        method(self, state_dict)
        for post in _compat.optimizer_hooks(self, "load_state_dict_post"):
            post(self)
    return load_state_dict


def with_step_hooks(inner: torch.optim.Optimizer, closure: Callable[[], Any] | None,
                    step: Callable[[Callable[[], Any] | None], Any],
                    finish: Callable[[], None] | None = None) -> Any:
    """Run ``step(closure)`` between the step hooks registered on the wrapped optimizer
    instance ``inner`` (an EMA update in its post hook), as torch's wrapper of
    ``inner.step`` would: the chunks step through the class's step body, which that
    wrapper does not reach. A pre hook may return ``(args, kwargs)`` with another
    closure; post hooks run only after a step that returned, and after ``finish()``
    (the step's chunks done: ``inner.state``, which such a hook reads, does not wait)."""
    args: tuple[Any, ...] = (inner,) if closure is None else (inner, closure)
    kwargs: dict[str, Any] = {}
    for pre in _compat.optimizer_hooks(inner, "step_pre"):
        result = pre(inner, args, kwargs)
        if result is not None:
            if not (isinstance(result, tuple) and len(result) == 2):
                raise RuntimeError("a step pre hook must return None or a tuple of "
                                   f"(new_args, new_kwargs), got {result!r}")
            args, kwargs = result
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    out = step(closure)
    # (An LR scheduler built on ``inner`` wraps inner.step, which the chunks bypass: its
    # order check warned "lr_scheduler.step() before optimizer.step()": a tester's find.)
    _compat.note_step_called(inner)
    posts = _compat.optimizer_hooks(inner, "step_post")
    if posts and finish is not None and not _faults.disabled("inner_post_hook_wait"):
        # Hazard: a post hook on the wrapped optimizer reading its state (stale) or
        # writing it (the edit overwritten) while the step's chunks still write it.
        finish()
    for post in posts:
        post(inner, args, kwargs)
    return out


def in_param_order(state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` with its ``"state"`` in the groups' parameter order, as torch's
    optimizers create it (a device part stepped first created its entries first)."""
    state = state_dict["state"]
    order = [i for g in state_dict["param_groups"] for i in g["params"] if i in state]
    listed = set(order)
    state_dict["state"] = {**{i: state[i] for i in order},
                           **{k: v for k, v in state.items() if k not in listed}}
    return state_dict


def check_in_model(params: Sequence[torch.Tensor], model: torch.nn.Module) -> None:
    """Raise :class:`ConfigError` naming the first of ``params`` that ``model`` lacks."""
    owned = {id(p) for p in model.parameters()}
    for i, p in enumerate(params):
        if id(p) not in owned:
            raise ConfigError(
                f"{describe(i, p)} of the optimizer is not a parameter of the "
                f"{type(model).__name__} given to attach(), so its forward could not wait "
                "for it; attach the model whose parameters the optimizer updates, or "
                "detach() first")


class Offloaded:
    """Mixin of :class:`~pipeoff.optim.OffloadOptimizer` and
    :class:`~pipeoff.optim.FullOffloadOptimizer`.

    A subclass sets ``_health``, ``_readers``, ``_waits`` and ``_attach_handles``
    and answers :meth:`_writes_to`, :meth:`_host_tensor` and :meth:`_stepped_params`.
    """

    _health: Health
    _readers: Readers
    _waits: ForwardWaits
    _attach_handles: list[Any]
    _attached: torch.nn.Module | None
    _steps_called: int = 0
    """``step()`` calls so far: the step number of the training thread's spans."""

    _train_handles: list[Any] | None = None
    _stats_hooks: Any = None
    _stats_pending: tuple[int, int] | None = None
    """``(step, exposed_ns)`` of the last step, until its figures went to the hooks."""
    _stats_last: tuple[int, int] | None = None
    _stats_hook_ns = 0
    """Nanoseconds the stats hooks took, all calls (not the steps' exposed time)."""

    @property
    def steps_taken(self) -> int:
        """``step()`` calls so far (:class:`pipeoff._contract.StepCount`)."""
        return self._steps_called

    # -- per-step figures ----------------------------------------------------------------
    def register_step_stats_hook(self, hook: Any) -> Any:
        """Call ``hook(stats)`` with every step's :class:`pipeoff.trace.StepStats`, once
        that step has finished: a synchronous step at the end of its ``step()``, an
        asynchronous one (``overlap``) when it is waited for (``wait_for_step()``, or
        the next ``step()``).
        Returns a handle whose ``remove()`` unregisters it.

        Raises:
            ConfigError: ``hook`` is not callable.
        """
        if self._stats_hooks is None:
            self._stats_hooks = StatsHooks()
        return self._stats_hooks.add(hook)

    @property
    def last_step_stats(self) -> Any:
        """The :class:`pipeoff.trace.StepStats` of the latest step (``None`` before the
        first); reading it waits for that step to finish."""
        if self._stats_last is None:
            return None
        self.wait_for_step()
        trace = self.last_trace  # type: ignore[attr-defined]
        if trace is None:
            return None
        step, exposed = self._stats_last
        return step_stats(trace, step=step, what="step", exposed_ns=exposed,
                                   also=self._step_traces())

    def _step_traces(self) -> list[Any]:
        """The traces of the last step's executions besides ``last_trace`` (none here)."""
        return []

    def _step_finished(self) -> bool:
        raise NotImplementedError

    def _stats_after_step(self, step: int, exposed_ns: int) -> None:
        """Note the step's figures; hand them to the hooks if it has finished."""
        self._stats_last = (step, exposed_ns)
        self._stats_pending = (step, exposed_ns)
        if self._stats_hooks and self._step_finished():
            self._emit_stats()

    def _emit_stats(self) -> None:
        """Hand the last step's figures to the hooks (once, when it has finished)."""
        if self._stats_pending is None:
            return
        if not self._stats_hooks:  # (hooks get the steps that finish after they came)
            self._stats_pending = None
            return
        self._stats_pending = None
        stats = self.last_step_stats
        if stats is not None:
            start = time.perf_counter_ns()
            try:
                self._stats_hooks(stats)
            finally:
                self._stats_hook_ns += time.perf_counter_ns() - start

    def _exposed_since(self, start: int, hooks: int) -> int:
        """Nanoseconds since ``start`` (``perf_counter_ns``), less what the stats hooks
        took since :attr:`_stats_hook_ns` was ``hooks``: theirs, not the optimizer's."""
        return time.perf_counter_ns() - start - (self._stats_hook_ns - hooks)

    def _train_spans_on(self, model: torch.nn.Module) -> None:
        """Record ``model``'s forward and backward on the ``train`` row while a region is
        recorded (replacing the hooks of an earlier model)."""
        for h in self._train_handles or ():
            h.remove()
        self._train_handles = install_train_hooks(model, self)

    # -- what a subclass answers ---------------------------------------------------------
    def _writes_to(self, param: torch.Tensor) -> tuple[Execution | None, list[str]]:
        """The step in flight and the names of its tasks that write ``param``'s state
        (and weight); ``(None, [])`` if none does.

        Raises:
            ConfigError: ``param`` is not one of the optimizer's parameters.
        """
        raise NotImplementedError

    def _host_tensor(self, param: torch.Tensor, key: str) -> torch.Tensor:
        """The host tensor of ``param``'s state ``key`` (the one a step in flight writes).

        Raises:
            ConfigError: ``param`` is not a parameter, or has no such state.
        """
        raise NotImplementedError

    def _stepped_params(self) -> Sequence[torch.Tensor]:
        """The parameters the optimizer steps (those ``attach()`` hooks wait for)."""
        raise NotImplementedError

    def wait_for_step(self) -> None:
        raise NotImplementedError

    def _wait_synchronously(self) -> None:
        """The one host wait of a synchronous step, which is all or nothing for its
        caller: on Ctrl-C the step in flight finishes first, then the interrupt is passed
        on. (A second interrupt leaves it in flight; ``wait_for_step()`` ends it.)

        Raises:
            KeyboardInterrupt: with a note that the step completed.
        """
        try:
            self.wait_for_step()
        except KeyboardInterrupt as err:
            self.wait_for_step()
            err.__notes__ = ["pipeoff: the step completed before the interrupt was passed "
                             "on: it must not be repeated (do not step again for the same "
                             "gradients)."]
            raise

    # -- the contract --------------------------------------------------------------------
    @property
    def health(self) -> Health:
        """What a failed step left (torn state, lost gradients, stale weights)."""
        return self._health

    def add_reader(self, execution: Execution) -> None:
        """Make the next write of the host state (a step, a load) wait for ``execution``
        (a :class:`~pipeoff.transfer.StateTransfer` reading it)."""
        self._readers.add(execution)

    def completion_for(self, param: torch.Tensor) -> tuple[Completion, ...]:
        """The completions of the tasks of the step in flight that write ``param``'s
        state (and its weight), empty if none does: a readiness for
        :class:`~pipeoff.transfer.LiveTensor`, finer than :meth:`wait_for_step`.

        Raises:
            ConfigError: ``param`` is not one of this optimizer's parameters.
        """
        execution, tasks = self._writes_to(param)
        return () if execution is None else completions(execution, tasks)

    def live_state(self, param: torch.Tensor,
                   key: str) -> tuple[torch.Tensor, tuple[Completion, ...]]:
        """The host tensor of ``param``'s state ``key`` (the one a step in flight is
        writing, new state included) and its :meth:`completion_for`; used by
        :meth:`pipeoff.transfer.LiveTensor.from_optimizer`. Does not wait.

        Raises:
            ConfigError: ``param`` is not a parameter of this optimizer, or it has no
                state ``key``.
            StepFailedError: an earlier step failed after writing some state.
        """
        self._health.check("reading the optimizer state", stale=False)
        return self._host_tensor(param, key), self.completion_for(param)

    # -- forward hooks -------------------------------------------------------------------
    def attach(self, model: torch.nn.Module) -> None:
        """Make ``model``'s forward wait, per module, for the parts of a step in flight
        that write its parameters (see the optimizer's docs).

        Either the hooks are all installed, or (on any error) the old ones stay. A
        second call replaces the hooks.

        Raises:
            ConfigError: ``model`` is not a module, or some of the optimizer's
                parameters are not in it.
        """
        from pipeoff.optim._hooks import install

        if not isinstance(model, torch.nn.Module):
            raise ConfigError(f"attach() needs a torch.nn.Module, got {model!r}")
        params = self._stepped_params()
        check_in_model(params, model)
        self.wait_for_step()
        handles = install(self._waits, model, params)
        for h in self._attach_handles:
            h.remove()
        self._attach_handles = handles
        self._attached = model
        self._train_spans_on(model)

    def detach(self) -> None:
        """Remove the forward hooks :meth:`attach` installed (after the step in flight:
        compiled code reads the weights it writes with nothing else to wait)."""
        self.wait_for_step()
        for h in self._attach_handles:
            h.remove()
        self._attach_handles = []
        self._attached = None
        for h in self._train_handles or ():  # its train-row spans go with it
            h.remove()
        self._train_handles = None
        self._waits.set_modules(torch.nn.Module(), [])
        self._waits.attached = False
