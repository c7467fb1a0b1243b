"""pipeoff's native kernels: one C file, compiled at first use, called through ``ctypes``.

Why this shape (docs/host_step.md): the file needs no torch headers, so it
survives torch upgrades and builds with any C compiler (once per machine: about 15 s on
2 cores for every vector width); ``ctypes``
calls release the GIL, so a lane's kernel runs beside the training thread. A
machine without a compiler (or with ``PIPEOFF_NATIVE=0``) runs torch's kernels
instead, and :func:`library` says why.

The shared object is cached under ``$PIPEOFF_CACHE_DIR`` (default
``$XDG_CACHE_HOME/pipeoff``, or ``~/.cache/pipeoff``), named by a hash of the
source, the flags, the compiler and the machine, and written by an atomic
rename, so ranks building at once do not trip on each other.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from pipeoff._native._signatures import SIGNATURES

__all__ = ["CFLAGS", "SOURCE", "library", "turned_off", "unavailable_reason"]

SOURCE = Path(__file__).with_name("hoststep.c")
"""The kernels' C source (shipped with the package)."""

CFLAGS = ("-O3", "-std=gnu99", "-shared", "-fPIC", "-pthread",
          # The kernels' fused multiply-adds are explicit fmaf() calls; the
          # compiler must not add any (the bits would stop matching torch's).
          "-ffp-contract=off",
          # sqrtf without errno, so that it vectorizes (still IEEE, correctly rounded).
          "-fno-math-errno")
"""Compiler flags. No -ffast-math: the kernels are IEEE to the bit."""

ABI_VERSION = 5

_log = logging.getLogger("pipeoff")
_lock = threading.Lock()
_loaded: ctypes.CDLL | None = None
_reason: str | None = None
_tried = False


def _cache_dir() -> Path:
    env = os.environ.get("PIPEOFF_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pipeoff"


def turned_off() -> bool:
    """Whether ``PIPEOFF_NATIVE`` turns the native kernels off (0, false, off, no)."""
    return os.environ.get("PIPEOFF_NATIVE", "1").strip().lower() in ("0", "false", "off", "no")


def _compiler() -> list[str] | None:
    """The compiler's command line: ``$CC`` (split as a shell would: ``CC="gcc -m64"``),
    else ``cc``, ``gcc`` or ``clang`` on the ``PATH``."""
    cc = os.environ.get("CC")
    if cc and cc.strip():
        return shlex.split(cc)
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return [path]
    return None


def _libc() -> tuple[str, str]:
    try:
        return platform.libc_ver()
    except OSError:  # an interpreter binary it cannot read (frozen, embedded)
        return ("", "")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _build(cc: list[str]) -> Path:
    """The cached shared object, compiled if missing (or damaged). Raises ``OSError`` /
    ``subprocess.SubprocessError`` with the compiler's words when it cannot."""
    src = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([src, " ".join(CFLAGS).encode(), " ".join(cc).encode(),
                                     platform.machine().encode(), sys.platform.encode(),
                                     # a $HOME shared with an older C library
                                     " ".join(_libc()).encode(),
                                     ])).hexdigest()[:16]
    out_dir = _cache_dir()
    target = out_dir / f"hoststep-{key}.so"
    stamp = target.with_suffix(".sha256")
    # A cached object is used only if it is the one its build wrote (a truncated or
    # overwritten file would crash the process when loaded, or never load).
    try:
        if target.exists() and stamp.read_text().strip() == _digest(target):
            return target
    except OSError:
        pass
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".hoststep-", suffix=".so", dir=out_dir)
    os.close(fd)
    # Once per machine, but long enough (up to a minute) to look like a hang unannounced.
    _log.warning("pipeoff: compiling the native host kernels for this machine (once; "
                 "up to a minute; cached in %s; PIPEOFF_NATIVE=0 skips them)", out_dir)
    try:
        proc = subprocess.run([*cc, *CFLAGS, "-o", tmp, str(SOURCE), "-lm"],
                              capture_output=True, text=True, timeout=120, check=False)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise OSError(f"{' '.join(cc)} exited with {proc.returncode}: {' / '.join(tail)}")
        digest = _digest(Path(tmp))
        # Readable by every user (a cache warmed by another user, a container image
        # built as root), as a compiler's output would be outside mkstemp.
        os.chmod(tmp, 0o755)
        # Atomic renames, the object first: another rank's build of the same key is
        # identical, and a reader checks the stamp against the object it finds.
        os.replace(tmp, target)
        fd, tmp_stamp = tempfile.mkstemp(prefix=".hoststep-", suffix=".sha256", dir=out_dir)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(digest)
            os.chmod(tmp_stamp, 0o644)
            os.replace(tmp_stamp, stamp)
        finally:
            if os.path.exists(tmp_stamp):
                os.unlink(tmp_stamp)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _load() -> ctypes.CDLL:
    if turned_off():
        raise OSError(f"PIPEOFF_NATIVE={os.environ.get('PIPEOFF_NATIVE')} turns the native "
                      "kernels off")
    cc = _compiler()
    if cc is None:
        raise OSError("no C compiler found (set CC, or install cc, gcc or clang)")
    lib = ctypes.CDLL(str(_build(cc)))
    # The one table of signatures, which tests/test_native_signatures.py checks
    # against hoststep.c's definitions (ctypes itself checks nothing).
    for name, (restype, args) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, [t for _, t in args]
    if lib.pipeoff_abi_version() != ABI_VERSION:
        raise OSError(f"the cached library's ABI is {lib.pipeoff_abi_version()}, "
                      f"not {ABI_VERSION}")
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded kernels (built on first call), or ``None`` if they cannot be had
    here (:func:`unavailable_reason` says why). Thread-safe; tried once per process."""
    global _loaded, _reason, _tried
    if _tried:
        return _loaded
    with _lock:
        if not _tried:
            try:
                _loaded = _load()
            except (OSError, subprocess.SubprocessError, AttributeError) as err:
                _reason = str(err) or type(err).__name__
            _tried = True
    return _loaded


def unavailable_reason() -> str | None:
    """Why :func:`library` is ``None`` (``None`` if it is available or not tried yet)."""
    return _reason


def _reset_for_tests() -> None:
    """Forget the outcome, so that the next :func:`library` call tries again."""
    global _loaded, _reason, _tried
    with _lock:
        _loaded, _reason, _tried = None, None, False
