"""The staging options that pipeoff's torchft classes share: ``schedule``,
``bucket_bytes`` and ``device_budget_bytes``, checked and resolved to their defaults."""

from __future__ import annotations

import math
import numbers
import warnings
from dataclasses import dataclass
from typing import Any

from pipeoff._errors import ConfigError
from pipeoff._validate import parse_bytes
from pipeoff.ft._buckets import DEFAULT_BUCKET_BYTES

__all__ = ["PER_PARAMETER", "SCHEDULES", "StagingOptions", "check_flag", "check_sync_schedule",
           "offload_flag"]

SCHEDULES = ("pipelined", "synchronous")
PER_PARAMETER = "per_parameter"


def check_flag(name: str, value: Any) -> bool:
    """``value`` if it is a bool; otherwise a :class:`ConfigError` naming ``name``."""
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False, got {value!r}")
    return value


def _int(name: str, value: Any, low: int) -> int:
    # Any integer type torchft's arithmetic takes (numpy's too), not a bool.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ConfigError(f"{name} must be an int of at least {low}, got {value!r}")
    return int(value)


def check_sync_schedule(sync_every: Any, fragments: int | None = None, *,
                        fragment_sync_delay: Any = 0, fragment_update_alpha: Any = 0.0,
                        outer_optimizers: int | None = None) -> tuple[int, int, float]:
    """torchft's own checks of LocalSGD's (``fragments=None``) or DiLoCo's schedule, as
    :class:`ConfigError` naming the argument (torchft's are bare asserts or messages
    that do not name it). Any integer or real type torchft takes (a numpy scalar, from
    a config) is accepted.

    Returns:
        ``(sync_every, fragment_sync_delay, fragment_update_alpha)`` as Python ``int``,
        ``int`` and ``float``.

    Raises:
        ConfigError: ``sync_every`` not an int of at least 1 (for DiLoCo: at least,
            and a multiple of, the number of fragments); ``fragment_sync_delay`` not
            an int in ``[0, sync_every // fragments)``; ``fragment_update_alpha`` not a
            number in ``[0, 1]``; a list of outer optimizers of another length than
            the fragments.
    """
    every = _int("sync_every", sync_every, 1)
    if fragments is None:
        return every, 0, 0.0
    if fragments < 1:
        raise ConfigError("model_fragments must hold at least one module (the whole model "
                          "as one fragment: [model]); got an empty list")
    if outer_optimizers is not None and outer_optimizers != fragments:
        raise ConfigError(f"outer_optimizer is a list of {outer_optimizers}; give one per model "
                          f"fragment ({fragments}), or one optimizer for all")
    if every % fragments:
        raise ConfigError(f"sync_every must be a multiple of the number of model fragments "
                          f"({fragments}): each fragment syncs once every sync_every steps, "
                          f"one every sync_every/{fragments}; got {every}")
    delay = _int("fragment_sync_delay", fragment_sync_delay, 0)
    if delay >= every // fragments:
        raise ConfigError(f"fragment_sync_delay must be less than sync_every / fragments "
                          f"({every // fragments}): a fragment's sync completes before the "
                          f"next fragment's begins; got {delay}")
    alpha = fragment_update_alpha
    if (isinstance(alpha, bool) or not isinstance(alpha, numbers.Real)
            or math.isnan(float(alpha)) or not 0.0 <= float(alpha) <= 1.0):
        raise ConfigError(f"fragment_update_alpha must be a number in [0, 1], got {alpha!r}")
    return every, delay, float(alpha)


def offload_flag(offload_to_cpu: Any, old: Any, old_name: str = (
        "offload_averaged_parameters_to_cpu")) -> bool:
    """``offload_to_cpu``, or its old name ``old`` (accepted with a ``FutureWarning``);
    ``False`` when neither is given.

    Raises:
        ConfigError: both given, or not a bool.
    """
    if old is not None:
        if offload_to_cpu is not None:
            raise ConfigError(f"give offload_to_cpu (the new name of {old_name}), not both")
        warnings.warn(f"LocalSGD({old_name}=...) is now offload_to_cpu=... (DiLoCo's "
                      f"name); {old_name} will be removed", FutureWarning, stacklevel=3)
        return check_flag(old_name, old)
    return check_flag("offload_to_cpu", False if offload_to_cpu is None else offload_to_cpu)


@dataclass(frozen=True, kw_only=True, slots=True)
class StagingOptions:
    """The resolved staging options of one offloaded sync."""

    schedule: str
    """``"pipelined"`` or ``"synchronous"``."""
    bucket_bytes: int | None
    """The bucket limit, or ``None`` for one bucket per parameter."""
    device_budget_bytes: int | None
    """The cap on live device staging, or ``None`` (the largest bucket)."""
    per_parameter: bool
    """One bucket per parameter (``bucket_bytes="per_parameter"``)."""
    bucket_name: str
    """How the user named the bucket limit, for error messages."""

    @classmethod
    def resolve(cls, *, flag: str, offload: bool, schedule: Any, bucket_bytes: Any,
                device_budget_bytes: Any) -> StagingOptions:
        """Check the options and fill in their defaults.

        ``bucket_bytes`` defaults to :data:`DEFAULT_BUCKET_BYTES`, or to half of
        ``device_budget_bytes`` (at most that) when only the budget is given;
        ``device_budget_bytes`` to two buckets, so that one all-reduce overlaps
        one copy.

        Raises:
            ConfigError: an option is given without ``flag``, or is out of range.
        """
        given = {"schedule": schedule, "bucket_bytes": bucket_bytes,
                 "device_budget_bytes": device_budget_bytes}
        if not offload:
            extra = [k for k, v in given.items() if v is not None]
            if extra:
                shown = ", ".join(f"{k}={given[k]!r}" for k in extra)
                verb = "applies" if len(extra) == 1 else "apply"
                raise ConfigError(f"{', '.join(extra)} {verb} only with {flag}=True; "
                                  f"got {flag}=False and {shown}")
        sched = "pipelined" if schedule is None else schedule
        if sched == "sync":
            warnings.warn("schedule='sync' is now schedule='synchronous' (the name of "
                          "pipeoff.Schedule.synchronous; 'sync' read like LocalSGD.sync()); "
                          "'sync' will be removed", FutureWarning, stacklevel=4)
            sched = "synchronous"
        if sched not in SCHEDULES:
            raise ConfigError(f"schedule must be 'pipelined' or 'synchronous', got {schedule!r}")
        budget = None if device_budget_bytes is None else parse_bytes(
            device_budget_bytes, name="device_budget_bytes")
        bucket: int | None
        if bucket_bytes is None:
            # With only a budget given, buckets of half of it: two fit, so one
            # all-reduce overlaps one copy (a budget under two elements fails
            # the bucket plan, which names the parameter).
            bucket = DEFAULT_BUCKET_BYTES if budget is None else min(
                DEFAULT_BUCKET_BYTES, max(budget // 2, 1))
        elif bucket_bytes == PER_PARAMETER:
            bucket = None
        else:
            try:
                bucket = parse_bytes(bucket_bytes, name="bucket_bytes")
            except ConfigError:
                raise ConfigError(
                    "bucket_bytes must be a positive int (bytes), a size string such as "
                    f"'256MiB' or '1GB', or {PER_PARAMETER!r}, got {bucket_bytes!r}") from None
        bucket_name = "bucket_bytes" if bucket_bytes is not None or budget is None else (
            "bucket_bytes (device_budget_bytes // 2)")
        if budget is None and bucket is not None:
            budget = 2 * bucket
        if budget is not None and bucket is not None and budget < bucket:
            raise ConfigError(
                f"device_budget_bytes={budget} is smaller than one bucket "
                f"(bucket_bytes={bucket}); use device_budget_bytes >= bucket_bytes "
                f"(2 * bucket_bytes overlaps one all-reduce with one copy)"
            )
        return cls(schedule=sched, bucket_bytes=bucket, device_budget_bytes=budget,
                   per_parameter=bucket_bytes == PER_PARAMETER, bucket_name=bucket_name)
