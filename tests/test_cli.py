"""The ``pipeoff`` console script, run as a user would."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def pipeoff_cmd() -> list[str]:
    exe = shutil.which("pipeoff", path=str(Path(sys.executable).parent))
    assert exe, "the pipeoff console script is not installed in this environment"
    return [exe]


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*pipeoff_cmd(), *args], capture_output=True, text=True, cwd=cwd,
                          timeout=300)


# About 10 s (it runs `pipeoff demo`): every test that uses it is marked slow.
@pytest.fixture(scope="module")
def demo_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("demo")
    res = run("demo", "--quick", "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert "makespan" in res.stdout and "efficiency" in res.stdout
    return out / "trace.json"


@pytest.mark.slow  # runs a Python interpreter (subprocess)
def test_trace_summary(demo_trace: Path) -> None:
    res = run("trace", "summary", str(demo_trace))
    assert res.returncode == 0, res.stderr
    assert "critical path" in res.stdout and "lane busy" in res.stdout
    res = run("trace", "summary", str(demo_trace), "--json")
    data = json.loads(res.stdout)
    assert data["tasks"] > 0 and 0 < data["efficiency"] <= 1.0


@pytest.mark.slow  # runs a Python interpreter (subprocess)
@pytest.mark.parametrize(
    ("content", "message"),
    [(None, "does not exist"), ("{oops", "not valid JSON"),
     ('{"traceEvents": []}', "not one pipeoff wrote")],
)
def test_bad_trace_files_exit_2_without_traceback(tmp_path: Path, content: str | None,
                                                  message: str) -> None:
    path = tmp_path / "t.json"
    if content is not None:
        path.write_text(content)
    res = run("trace", "summary", str(path))
    assert res.returncode == 2
    assert message in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.slow  # runs a Python interpreter (subprocess)
def test_module_entry_point() -> None:
    res = subprocess.run([sys.executable, "-m", "pipeoff.cli", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0 and "demo" in res.stdout


@pytest.mark.slow  # runs a Python interpreter (subprocess)
def test_trace_diff(demo_trace: Path) -> None:
    res = run("trace", "diff", str(demo_trace), str(demo_trace))
    assert res.returncode == 0, res.stderr
    assert "makespan ms" in res.stdout and "1.00x" in res.stdout
    data = json.loads(run("trace", "diff", str(demo_trace), str(demo_trace), "--json").stdout)
    assert data["ratio_b_over_a"]["makespan ms"] == 1.0


@pytest.mark.slow  # runs a Python interpreter (subprocess)
def test_trace_plot(demo_trace: Path, tmp_path: Path) -> None:
    out = tmp_path / "gantt.png"
    res = run("trace", "plot", str(demo_trace), "-o", str(out), "--arrows", "--width", "10")
    assert res.returncode == 0, res.stderr
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width = int.from_bytes(data[16:20], "big")
    height = int.from_bytes(data[20:24], "big")
    assert width == 1000 and 200 < height < 1000  # 10 inches at 100 dpi


@pytest.mark.slow  # runs a Python interpreter (subprocess)
def test_trace_plot_bad_input(tmp_path: Path) -> None:
    res = run("trace", "plot", str(tmp_path / "nope.json"), "-o", str(tmp_path / "x.png"))
    assert res.returncode == 2 and "does not exist" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.slow  # runs a Python interpreter (subprocess)
def test_demo_without_torchft_says_how_to_install_it(tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['torchft'] = None\n"  # makes `import torchft` fail
        "from pipeoff.cli import main\n"
        f"sys.exit(main(['demo', '--quick', '--out', {str(tmp_path)!r}]))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 2
    assert "pip install 'pipeoff[ft]'" in res.stderr
    assert "Traceback" not in res.stderr


_TASK = {"ph": "X", "ts": 0, "dur": 1, "pid": 0, "tid": 0, "name": "t",
         "args": {"pipeoff.task": "t", "kind": "h2d", "lane": "h2d", "t_ns": [0, 0, 1000],
                  "bytes": 8, "deps": [], "buffers": [], "status": "ok"}}


def test_a_trace_nested_too_deep_is_not_valid_json(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A RecursionError came out as a traceback (a tester's find)."""
    from pipeoff.cli import main

    path = tmp_path / "t.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    assert main(["trace", "summary", str(path)]) == 2
    assert "not valid JSON" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"traceEvents": [1], "pipeoff": {}}, "not a well-formed pipeoff trace"),
        ({"traceEvents": [_TASK], "pipeoff": {"metadata": [1, 2]}}, "not a well-formed"),
        ({"traceEvents": [_TASK], "pipeoff": {"buffers": [
            {"name": "b", "nbytes": 8, "where": "moon"}]}}, "expected 'device' or 'host'"),
        ({"traceEvents": [_TASK], "pipeoff": {"device_budget_bytes": "lots"}},
         "device_budget_bytes must be a byte count"),
        ({"traceEvents": [{"ph": "X", "name": "pipeoff::h2d", "ts": 1, "dur": 1}]},
         "not a well-formed"),
        ({"traceEvents": [{"ph": "X", "name": "pipeoff::h2d::x", "ts": "abc", "dur": 1}]},
         "not a well-formed"),
        # (a tester's finds: negative figures in the summary, a traceback from the plot)
        ({"traceEvents": [{**_TASK, "args": {**_TASK["args"], "t_ns": [0, 9, 1]}}],
          "pipeoff": {}}, "ends before it starts"),
        ({"traceEvents": [{**_TASK, "args": {**_TASK["args"], "bytes": -100}}],
          "pipeoff": {}}, "fewer than 0 bytes"),
    ],
    ids=["event_not_object", "metadata_list", "buffer_where", "budget_text",
         "profiler_name", "profiler_ts", "end_before_start", "negative_bytes"],
)
def test_malformed_traces_exit_2_with_a_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], doc: object, message: str
) -> None:
    from pipeoff.cli import main

    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    for cmd in (["trace", "summary", str(path)], ["trace", "diff", str(path), str(path)],
                ["trace", "plot", str(path), "-o", str(tmp_path / "p.png")]):
        assert main(cmd) == 2
        err = capsys.readouterr().err
        assert message in err and "t.json" in err, err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["trace", "summary", "."], "is a directory"),
        (["simulate", "--schedules", ","], "no schedule given"),
        (["simulate", "--chunk-bytes", "1e400"], "--chunk-bytes is too large"),
        (["simulate", "--feature", "local-sgd", "--bucket-bytes", "1XB"],
         "--bucket-bytes: unknown unit"),
        (["simulate", "--lookahead", "0"], "prefetch must be an int >= 1"),
        (["simulate", "--prefetch", "0"], "prefetch must be an int >= 1"),
        (["simulate", "--feature", "local-sgd", "--bucket-bytes", "1"],
         "--bucket-bytes=1 cuts 8b into"),
        # (a transfer plans every rank's pieces of half its staging: it ran for minutes
        # into gigabytes, a tester's find)
        (["simulate", "--feature", "transfer", "--model", "0.6b", "--bucket-bytes", "32KiB"],
         "--bucket-bytes=32768 cuts 0.6b into"),
        (["simulate", "--feature", "transfer", "--model", "0.6b", "--device-budget", "32240"],
         "--device-budget=32240 cuts 0.6b into"),
        (["simulate", "--preset", "cpu_here", "--replicas", "8"], "--replicas applies"),
        (["simulate", "--feature", "full-offload", "--device-budget", "1GiB"],
         "--device-budget does not apply to full-offload"),
        # (an option the feature never reads was ignored: figures for another set-up)
        (["simulate", "--bucket-bytes", "64MiB"],
         "--bucket-bytes does not apply to --feature optimizer (it is read by: diloco, "
         "local-sgd, transfer)"),
        (["simulate", "--feature", "full-offload", "--chunk-bytes", "2GiB"],
         "--chunk-bytes does not apply to --feature full-offload"),
        (["simulate", "--feature", "local-sgd", "--fragment-sync-delay", "1"],
         "--fragment-sync-delay does not apply to --feature local-sgd (it is read by: "
         "diloco)"),
        (["simulate", "--feature", "transfer", "--seq-len", "1024"],
         "--seq-len does not apply to --feature transfer"),
        (["simulate", "--feature", "train-step", "--prefetch", "3"],
         "--prefetch does not apply to --feature train-step"),
        # (cpu_here models no training compute: the tokens around a DiLoCo sync unread)
        (["simulate", "--preset", "cpu_here", "--feature", "diloco", "--seq-len", "1024"],
         "--seq-len does not apply to --preset cpu_here"),
        (["simulate", "--preset", "cpu_here", "--feature", "diloco", "--micro-batch", "2"],
         "--micro-batch does not apply to --preset cpu_here"),
        (["simulate", "--schedules", "pipelined,pipelined"],
         "schedules names pipelined more than once"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    from pipeoff.cli import main

    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow  # reads demo_trace, made by running `pipeoff demo` (subprocess)
def test_plot_output_path(tmp_path: Path, demo_trace: Path,
                          capsys: pytest.CaptureFixture[str]) -> None:
    from pipeoff.cli import main

    assert main(["trace", "plot", str(demo_trace), "-o", str(tmp_path / "gantt")]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'gantt.png'}"
    assert (tmp_path / "gantt.png").stat().st_size > 0
    assert main(["trace", "plot", str(demo_trace), "-o", str(tmp_path / "g.txt")]) == 2
    assert "--output must end in" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["trace", "plot", str(demo_trace), "--width", "nan"])
    assert info.value.code == 2


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib import metadata

    from pipeoff.cli import main

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"pipeoff {metadata.version('pipeoff')}"


@pytest.mark.parametrize(("argv", "commands", "hint"), [
    ([], ("demo", "simulate", "trace"), "pipeoff COMMAND --help"),
    (["trace"], ("summary", "diff", "plot"), "pipeoff trace summary FILE"),
])
def test_a_command_group_alone_shows_its_commands_and_what_to_run(
        capsys: pytest.CaptureFixture[str], argv: list[str], commands: tuple[str, ...],
        hint: str) -> None:
    from pipeoff.cli import main

    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert all(c in out for c in commands), out
    assert "choose a command" in err and hint in err
    assert "required" not in err and "trace_command" not in out + err


def _sim_trace(tmp_path: Path, name: str = "a-very-long-trace-name-indeed.json") -> Path:
    import pipeoff
    from pipeoff import TaskGraph, TaskKind

    g = TaskGraph()
    g.add_task("c", TaskKind.H2D, nbytes=1 << 20)
    g.add_task("o", TaskKind.OPTIMIZER_CHUNK, deps=["c"], nbytes=1 << 20)
    return pipeoff.execute(g, backend="sim").trace.save(tmp_path / name)


def test_diff_columns_are_as_wide_as_their_content(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pipeoff.cli import main

    a = _sim_trace(tmp_path)
    b = _sim_trace(tmp_path, "another-quite-long-trace-name.json")
    assert main(["trace", "diff", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert f"A: {a.name} (predicted)" in out and f"B: {b.name} (predicted)" in out
    assert "PREDICTED by pipeoff's simulator" in out
    rows = [ln for ln in out.splitlines() if ln.startswith(("metric", "makespan ms"))]
    assert len({len(r) for r in rows}) == 1  # aligned under the widened headers


def test_plot_without_output_writes_nothing_into_the_current_folder(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib")
    from pipeoff.cli import main

    trace = _sim_trace(tmp_path)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    assert main(["trace", "plot", str(trace)]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("wrote ") and out.endswith("(no -o given: a temporary folder)")
    written = Path(out.removeprefix("wrote ").split(" (no -o")[0])
    assert written.stat().st_size > 0 and written.parent != cwd
    assert list(cwd.iterdir()) == []
    written.unlink()
    written.parent.rmdir()


def test_simulate_counts_the_host_state_and_says_what_peak_host_is(
        capsys: pytest.CaptureFixture[str]) -> None:
    from pipeoff.cli import main

    assert main(["simulate", "--model", "0.6b", "--feature", "optimizer"]) == 0
    out = capsys.readouterr().out
    assert "peak host*" in out and "* peak host: AdamW state (2 x FP32)" in out
    rows = [ln.split() for ln in out.splitlines() if ln.startswith("pipelined")]
    assert rows and rows[0][5] != "0"  # "<n> GiB/MiB", not "0 B"
    assert main(["simulate", "--model", "0.6b", "--feature", "optimizer", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert all(p["host_state_bytes"] > 0 and p["predicted"] for p in data)
    assert all(p["peak_host_bytes"] == p["host_state_bytes"] + p["peak_host_staging_bytes"]
               for p in data)


def test_a_too_small_budget_names_the_options_to_change(
        capsys: pytest.CaptureFixture[str]) -> None:
    from pipeoff.cli import main

    assert main(["simulate", "--model", "8b", "--device-budget", "1GB"]) == 2
    err = capsys.readouterr().err
    assert "--device-budget=1000000000 bytes" in err
    assert "raise --device-budget to at least 1GiB" in err and "lower --chunk-bytes" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(("argv", "message"), [
    (["simulate", "--fsdp", "0"], "argument --fsdp: must be at least 1, got 0"),
    (["simulate", "--schedules", ""], "no schedule given in --schedules ('')"),
    (["simulate", "--schedules", "pipelined", "--trace-dir", "/proc/no/such"],
     "--trace-dir: cannot write /proc/no/such/optimizer-pipelined.json"),
])
def test_simulates_bad_options_exit_2_naming_them(
        capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    """(A new user's finds: --fsdp 0 named no option, an empty --schedules ran them all,
    an unwritable --trace-dir printed only the OS's errno.)"""
    from pipeoff.cli import main

    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own refusals
        code = int(exit_.code or 0)
    assert code == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow  # runs a Python interpreter (subprocess)
def test_python_dash_m_pipeoff_is_the_command() -> None:
    res = subprocess.run([sys.executable, "-m", "pipeoff", "--help"], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "usage: pipeoff" in res.stdout and "simulate" in res.stdout


@pytest.mark.parametrize("option", [["--chunk-bytes", "1024MiB"], ["--bucket-bytes", "268435456"]])
def test_an_unread_size_option_at_its_default_in_other_units_is_accepted(
        option: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    # The check of options a feature never reads compared their strings: the default
    # spelled otherwise (1024MiB for 1GiB) was refused as a change.
    from pipeoff.cli import main

    assert main(["simulate", "--model", "0.6b", "--feature", "full-offload", *option]) == 0
    capsys.readouterr()


@pytest.mark.slow  # runs a Python interpreter (subprocess)
def test_a_reader_that_goes_away_stops_the_command_quietly() -> None:
    """``pipeoff simulate | head -0``: the pipe is closed before the command writes; it
    stops with code 1 and no traceback, as a Unix tool does (Python's recipe)."""
    proc = subprocess.Popen([*pipeoff_cmd(), "simulate"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # (the reader went away before the first write)
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 1, err
    assert err == ""
