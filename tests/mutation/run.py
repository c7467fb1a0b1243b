"""Run the mutants of ``tests/mutation/mutants.py``: each edit in a copy of the tree, its
tests there, and a table of which were caught.

Usage (from the repository root; see ``tests/mutation/README.md``)::

    python -m tests.mutation.run --list
    python -m tests.mutation.run -k switch:base_wait -k r05 --baseline
    python tests/mutation/run.py --jobs 2 --repeat 3

Each mutant gets a fresh copy of the working tree (the files git tracks or does
not ignore), with its one edit applied. Its tests run there with this Python
(``sys.executable``) and ``PYTHONPATH`` set to the copy, so the copy's
``pipeoff`` is imported, not the editable install of the repository (checked
before the tests run). Results:

* ``caught``: a test failed, or the test process died of a signal (gloo aborting it)
  (``caught k/N``: caught in k of N runs, a flaky catch);
* ``timeout``: the tests ran past ``--timeout`` (a hang; counts as caught);
* ``missed``: the tests passed with the edit;
* ``stale``: ``old`` is not in the file (or occurs more than once), or a test
  file is gone; nothing ran;
* ``broken baseline`` (``--baseline``): the tests fail without the edit too;
* ``error``: the mutant does not compile or import, or pytest could not run the
  tests (a node id not found, a collection error).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

if not __package__:  # run as a script: python tests/mutation/run.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.mutation.mutants import MUTANTS, Mutant  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CAUGHT, MISSED, TIMEOUT, STALE, BROKEN, ERROR = (
    "caught", "missed", "timeout", "stale", "broken baseline", "error")
_FAILED_LINE = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.MULTILINE)
_NODE = re.compile(r"^(tests/\S+::\S+)", re.MULTILINE)


@dataclass(frozen=True, kw_only=True, slots=True)
class Outcome:
    """What happened to one mutant."""

    result: str
    """One of the results above; ``caught`` may carry ``k/N`` under ``--repeat``."""
    seconds: float
    """Wall time of the mutant's test runs (not the copy, not the baseline)."""
    detail: str = ""
    """The first failing test, or why the mutant is stale or in error."""
    log: str = ""
    """The tail of pytest's output of the last run."""

    @property
    def caught(self) -> bool:
        return self.result.startswith(CAUGHT) or self.result == TIMEOUT


# -- checks --------------------------------------------------------------------------------
def stale_reason(mutant: Mutant, root: Path = ROOT) -> str | None:
    """Why ``mutant`` cannot be applied to the tree at ``root`` (None: it can)."""
    path = root / mutant.file
    if not path.is_file():
        return f"{mutant.file} does not exist"
    count = path.read_text().count(mutant.old)
    if count != 1:
        return f"old text occurs {count} times in {mutant.file} (must be once)"
    for test in mutant.tests:
        missing = missing_test(test, root)
        if missing:
            return missing
    return None


def missing_test(node: str, root: Path = ROOT) -> str | None:
    """Why the test file or function of node id ``node`` is not there (None: it is)."""
    file, *names = node.split("::")
    path = root / file
    if not path.exists():
        return f"test {file} does not exist"
    if names:
        text = path.read_text()
        for name in names:
            bare = name.split("[", 1)[0]
            if not re.search(rf"^\s*(?:async\s+def|def|class)\s+{re.escape(bare)}\b", text,
                             re.MULTILINE):
                return f"test {bare} is not defined in {file}"
    return None


def mutated(mutant: Mutant, root: Path = ROOT) -> str:
    """The text of ``mutant.file`` with the edit applied."""
    return (root / mutant.file).read_text().replace(mutant.old, mutant.new, 1)


# -- the copy -------------------------------------------------------------------------------
def tree_files(root: Path = ROOT) -> list[str]:
    """The working tree's files: tracked, or untracked and not ignored (work in progress)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=root, check=True, capture_output=True).stdout.decode()
    except (OSError, subprocess.CalledProcessError):
        return _walk(root)
    return sorted({f for f in out.split("\0") if f and (root / f).is_file()})


def _walk(root: Path) -> list[str]:
    """Without git: everything but the virtual environment, caches and builds."""
    skip = {".git", ".venv", "__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache",
            ".hypothesis", "build", "dist"}
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip and not d.endswith(".egg-info")]
        out += [os.path.relpath(os.path.join(dirpath, f), root) for f in filenames]
    return sorted(out)


def snapshot(rev: str, dest: Path, root: Path = ROOT) -> list[str]:
    """Extract commit ``rev``'s tree into ``dest`` (``git archive``); returns its files."""
    archive = subprocess.run(["git", "archive", "--format=tar", rev], cwd=root, check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return _walk(dest)


def copy_tree(files: Sequence[str], dest: Path, root: Path = ROOT) -> None:
    for rel in files:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, target, follow_symlinks=False)


def copy_env(copy: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(copy), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.pop("PYTEST_ADDOPTS", None)
    return env


def imported_from(copy: Path) -> str:
    """Where ``import pipeoff`` in ``copy`` finds the package (raises if it fails)."""
    proc = subprocess.run([sys.executable, "-c", "import pipeoff; print(pipeoff.__file__)"],
                          cwd=copy, env=copy_env(copy), capture_output=True, text=True,
                          timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"import pipeoff failed: {proc.stderr.strip().splitlines()[-1:]}")
    return proc.stdout.strip()


# -- pytest ---------------------------------------------------------------------------------
_procs: set[subprocess.Popen[bytes]] = set()
_procs_lock = threading.Lock()


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """End the pytest run and whatever it started (its own process group)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_tests(copy: Path, tests: Sequence[str], timeout: float) -> tuple[str, float, str, str]:
    """Run ``tests`` in ``copy``; returns (caught, missed, timeout or error), seconds, the
    first failing test (or why it is an error), and the output's tail."""
    cmd = [sys.executable, "-m", "pytest", "-x", "-v", "-rfE", "--no-header",
           "-p", "no:cacheprovider", *tests]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=copy, env=copy_env(copy), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    with _procs_lock:
        _procs.add(proc)
    try:
        out, _ = proc.communicate(timeout=timeout)
        hung = False
    except subprocess.TimeoutExpired:
        _kill(proc)
        out, _ = proc.communicate()
        hung = True
    finally:
        with _procs_lock:
            _procs.discard(proc)
    seconds = time.monotonic() - t0
    text = out.decode(errors="replace")
    tail = text[-4000:]
    if hung:
        started = _NODE.findall(text)
        return TIMEOUT, seconds, f"(hung in) {started[-1]}" if started else "", tail
    if proc.returncode == 0:
        return MISSED, seconds, "", tail
    failed = _FAILED_LINE.findall(text)
    if proc.returncode == 1:
        return CAUGHT, seconds, failed[0] if failed else "", tail
    if proc.returncode < 0:  # the test process died of a signal (gloo's abort): caught
        started = _NODE.findall(text)
        return CAUGHT, seconds, f"(crashed, signal {-proc.returncode}) " + (
            started[-1] if started else ""), tail
    last = text.strip().splitlines()[-1] if text.strip() else ""
    return ERROR, seconds, f"pytest exit {proc.returncode}: {last}"[:200], tail


class Baselines:
    """Each distinct tuple of tests runs once on the unmodified tree; later mutants with
    the same tests reuse the result."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._keys: dict[tuple[str, ...], threading.Lock] = {}
        self._results: dict[tuple[str, ...], tuple[str, str]] = {}

    def check(self, copy: Path, tests: tuple[str, ...], timeout: float) -> tuple[str, str]:
        """(result, first failing test) of ``tests`` in the unmodified ``copy``."""
        with self._lock:
            key_lock = self._keys.setdefault(tests, threading.Lock())
        with key_lock:
            if tests not in self._results:
                result, _, detail, _ = run_tests(copy, tests, timeout)
                self._results[tests] = (result, detail)
            return self._results[tests]


# -- one mutant -----------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class Options:
    """The run's options (see ``main``)."""

    timeout: float
    repeat: int
    baseline: bool
    keep: bool
    workdir: Path | None


def run_mutant(mutant: Mutant, source: Path, files: Sequence[str], opts: Options,
               baselines: Baselines) -> Outcome:
    """Copy ``files`` of the tree at ``source``, apply ``mutant``, run its tests."""
    why = stale_reason(mutant, source)
    if why:
        return Outcome(result=STALE, seconds=0.0, detail=why)
    text = mutated(mutant, source)
    if mutant.file.endswith(".py"):
        try:
            compile(text, mutant.file, "exec")
        except SyntaxError as err:
            return Outcome(result=ERROR, seconds=0.0, detail=f"mutant does not compile: {err}")
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", mutant.name)
    copy = Path(tempfile.mkdtemp(prefix=f"pipeoff-mutant-{safe}-", dir=opts.workdir))
    try:
        copy_tree(files, copy, source)
        if opts.baseline:
            result, detail = baselines.check(copy, mutant.tests, opts.timeout)
            if result != MISSED:  # the tests do not pass on the unmodified tree
                how = {CAUGHT: "fails", TIMEOUT: "hangs"}.get(result, result)
                return Outcome(result=BROKEN, seconds=0.0,
                               detail=f"{how} without the edit: {detail}")
        (copy / mutant.file).write_text(text)
        try:
            origin = Path(imported_from(copy)).resolve()
        except (RuntimeError, subprocess.TimeoutExpired) as err:
            return Outcome(result=ERROR, seconds=0.0, detail=f"mutant does not import: {err}")
        if copy.resolve() not in origin.parents:
            return Outcome(result=ERROR, seconds=0.0,
                           detail=f"the copy imports pipeoff from {origin}, not from {copy}")
        result, seconds, detail, tail = run_tests(copy, mutant.tests, opts.timeout)
        if result == MISSED and opts.repeat > 1:
            catches, first = 0, ""
            for _ in range(opts.repeat - 1):
                again, more, found, tail = run_tests(copy, mutant.tests, opts.timeout)
                seconds += more
                if again in (CAUGHT, TIMEOUT):
                    catches += 1
                    first = first or found
                elif again == ERROR:
                    return Outcome(result=ERROR, seconds=seconds, detail=found, log=tail)
            result = f"{CAUGHT} {catches}/{opts.repeat}" if catches else (
                f"{MISSED} 0/{opts.repeat}")
            detail = first
        return Outcome(result=result, seconds=seconds, detail=detail, log=tail)
    finally:
        if opts.keep:
            print(f"kept {mutant.name}: {copy}", file=sys.stderr)
        else:
            shutil.rmtree(copy, ignore_errors=True)


# -- the table ------------------------------------------------------------------------------
def table(rows: Sequence[Sequence[str]]) -> str:
    header = ("name", "file", "result", "seconds", "first failing test")
    widths = [max(len(r[c]) for r in (header, *rows)) for c in range(len(header) - 1)]
    lines = []
    for r in (header, *rows):
        cells = [r[c].ljust(widths[c]) for c in range(len(header) - 1)] + [r[-1]]
        lines.append(" | ".join(cells).rstrip())
        if r is header:
            lines.append("-+-".join("-" * w for w in widths) + "-+-" + "-" * 18)
    return "\n".join(lines)


def select(mutants: Sequence[Mutant], patterns: Sequence[str]) -> list[Mutant]:
    """The mutants whose name contains one of ``patterns`` (an exact name selects only
    itself); all of them without patterns."""
    if not patterns:
        return list(mutants)
    chosen = []
    for m in mutants:
        for p in patterns:
            exact = any(n.name == p for n in mutants)
            if (m.name == p) if exact else (p in m.name):
                chosen.append(m)
                break
    return chosen


def list_mutants(mutants: Sequence[Mutant]) -> None:
    for m in mutants:
        why = stale_reason(m)
        print(f"{m.name}  [{m.file}]{'  STALE: ' + why if why else ''}")
        print(f"    hazard: {m.hazard}")
        for t in m.tests:
            print(f"    test:   {t}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.mutation.run",
        description="Apply each mutant to a copy of the tree and run its tests there.")
    parser.add_argument("-k", dest="patterns", action="append", default=[],
                        metavar="SUBSTRING",
                        help="run the mutants whose name contains SUBSTRING (repeatable)")
    parser.add_argument("--jobs", type=int, default=1, help="mutants run at once (default 1)")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="run a missed mutant's tests N times in all (flaky catches)")
    parser.add_argument("--baseline", action="store_true",
                        help="first check that each mutant's tests pass on the unmodified tree")
    parser.add_argument("--timeout", type=float, default=900.0, metavar="SECONDS",
                        help="per mutant and run; past it the mutant counts as caught "
                             "(timeout). Default 900")
    parser.add_argument("--rev", default=None, metavar="REV",
                        help="copy the tree of commit REV (git archive) instead of the "
                             "working tree, e.g. HEAD while others edit the checkout")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--keep", action="store_true", help="keep the copies (for debugging)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where the copies go (default: the system's temp dir)")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="print pytest's output of mutants that were not caught")
    args = parser.parse_args(argv)
    if args.jobs < 1 or args.repeat < 1:
        parser.error("--jobs and --repeat must be >= 1")
    mutants = select(MUTANTS, args.patterns)
    if not mutants:
        parser.error(f"no mutant matches {args.patterns}")
    if args.list:
        list_mutants(mutants)
        return 0
    opts = Options(timeout=args.timeout, repeat=args.repeat, baseline=args.baseline,
                   keep=args.keep, workdir=args.workdir)
    baselines = Baselines()
    if args.rev is None:
        source, files = ROOT, tree_files()
    else:
        source = Path(tempfile.mkdtemp(prefix="pipeoff-mutant-rev-", dir=args.workdir))
        try:
            files = snapshot(args.rev, source)
        except subprocess.CalledProcessError as err:
            shutil.rmtree(source, ignore_errors=True)
            parser.error(f"--rev {args.rev}: {err.stderr.decode().strip()}")
    done = [0]
    lock = threading.Lock()

    def one(m: Mutant) -> Outcome:
        out = run_mutant(m, source, files, opts, baselines)
        with lock:
            done[0] += 1
            print(f"[{done[0]}/{len(mutants)}] {m.name}: {out.result} ({out.seconds:.1f} s)",
                  file=sys.stderr, flush=True)
        return out

    pool = ThreadPoolExecutor(max_workers=args.jobs)
    try:
        outcomes = list(pool.map(one, mutants))
    except KeyboardInterrupt:
        pool.shutdown(wait=False, cancel_futures=True)
        with _procs_lock:  # the pytest runs are in sessions of their own: no SIGINT
            for proc in list(_procs):
                _kill(proc)
        raise
    finally:
        pool.shutdown()
        if source != ROOT:
            shutil.rmtree(source, ignore_errors=True)
    rows = [(m.name, m.file, o.result, f"{o.seconds:.1f}", o.detail)
            for m, o in zip(mutants, outcomes)]
    print(table(rows))
    if args.verbose:
        for m, o in zip(mutants, outcomes):
            if not o.caught and o.log:
                print(f"\n--- {m.name}: {o.result} ---\n{o.log}")
    caught = sum(o.caught for o in outcomes)
    counts = {r: sum(o.result.startswith(r) for o in outcomes)
              for r in (TIMEOUT, MISSED, STALE, BROKEN, ERROR)}
    extra = ", ".join(f"{n} {r}" for r, n in counts.items() if n)
    print(f"caught {caught} of {len(outcomes)}" + (f" ({extra})" if extra else ""))
    return 0 if caught == len(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
