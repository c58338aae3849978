"""`launch --version`, `runtime --version`, `launch completion SHELL` and `launch logs --since
--timestamps --attempt` (issue 41), all through the CLI. The line times' sidecar and its readers
are tested in test_logs_times.py."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import pytest
from test_launch_local import ROOT, launch

from launch.logs_options import stamp
from launch.registry import Registry, RunRecord
from launch.state import utc_now
from runfolder.layout import line_times_record

STAMPED = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z \[host \d\] ")
OLD_LOGS = (
    "{option}: run {run}'s attempt 0 host logs were written before jaxjob recorded when each "
    "line was written (host-0.log has no host-0.log.times beside it), so they cannot be shown "
    "by time; leave out {option} to see them (--tail K for the last lines), or pick a later "
    "attempt with --attempt N"
)


@pytest.mark.parametrize("module", ["launch.cli", "runtime"])
def test_version_is_one_line_with_jaxjob_git_and_jax(module):
    r = subprocess.run(
        [sys.executable, "-m", module, "--version"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 1, r.stdout
    prog = module.split(".")[0]
    assert lines[0].startswith(f"{prog} {metadata.version('jaxjob')}")
    assert lines[0].endswith(f", jax {metadata.version('jax')}")
    if (ROOT / ".git").exists():
        head = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        assert f"(git {head})" in lines[0]


def test_version_never_imports_jax():
    code = (
        "import sys; from launch.cli import main\n"
        "try:\n    main(['--version'])\nexcept SystemExit as e:\n    assert e.code == 0, e.code\n"
        "assert 'jax' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


def test_version_outside_a_checkout_has_no_commit(tmp_path):
    from jobspec.version import git_commit

    assert git_commit(tmp_path) is None


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_completion_prints_the_script(shell, tmp_path):
    r = launch("completion", shell, state=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "_LAUNCH_COMPLETE" in r.stdout and "launch" in r.stdout
    if shell == "bash":
        assert "complete -o nosort -F _launch_completion launch" in r.stdout


def test_completion_of_an_unknown_shell_is_one_sentence(tmp_path):
    r = launch("completion", "tcsh", state=tmp_path)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines() == [
        "error: completion: unknown shell 'tcsh'; use one of bash, zsh, fish"
    ]


def test_new_options_have_help(tmp_path):
    logs = launch("logs", "--help", state=tmp_path).stdout
    for option in ("--since DURATION", "--timestamps", "--attempt"):
        assert option in logs
    assert "--version" in launch("--help", state=tmp_path).stdout
    assert "completion" in launch("--help", state=tmp_path).stdout


def _record(state, out, run_id):
    registry = Registry(state / "jaxjob")
    run_dir = registry.run_dir(run_id)
    run_dir.mkdir(parents=True)
    handle = {"pid": 1, "run_dir": str(run_dir), "log_dir": str(run_dir / "logs")}
    registry.record(RunRecord(run_id, "local", handle, str(out), utc_now(), "job.yaml"))


@pytest.fixture
def two_attempts(tmp_path):
    """A local run (record only, no processes) whose run folder has host logs of attempts 0
    and 1, as runtime/host/hostlog.py wrote them before it recorded line times."""
    state, out, run_id = tmp_path / "state", tmp_path / "out", "fake-run-1"
    for attempt, hosts in ((0, 2), (1, 2)):
        folder = out / run_id / "logs" / f"attempt-{attempt}"
        folder.mkdir(parents=True)
        for h in range(hosts):
            text = "".join(f"attempt {attempt} host {h} line {k}\n" for k in range(3))
            (folder / f"host-{h}.log").write_text(text)
    _record(state, out, run_id)
    return state, run_id


def test_logs_attempt_shows_that_attempts_host_logs(two_attempts):
    state, run_id = two_attempts
    r = launch("logs", run_id, "--attempt", "0", "--all-hosts", state=state)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        f"[host {h}] attempt 0 host {h} line {k}" for h in range(2) for k in range(3)
    ]
    one = launch("logs", run_id, "--attempt", "1", "--host", "1", "--tail", "1", state=state)
    assert one.stdout.splitlines() == ["[host 1] attempt 1 host 1 line 2"]


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--attempt", "7"], "--attempt 7: run {run} has no such attempt; it has attempts 0, 1"),
        (["--attempt", "-1"], None),  # click's IntRange: its own message, exit 2
        (["--attempt", "0", "-f"], "--attempt and --follow exclude each other; follow the "
         "latest attempt"),
        (["--since", "5x"], "--since '5x' is not a duration; use e.g. 30s, 10m, 2h or 1h30m (plain "
         "numbers are seconds)"),
        (["--since", "0s"], "--since '0s' must be longer than 0 seconds"),
        (["--since", "1h30m"], OLD_LOGS.replace("{option}", "--since")),
        (["--timestamps", "--attempt", "0"], OLD_LOGS.replace("{option}", "--timestamps")),
        (["--since", "1m", "--timestamps"], OLD_LOGS.replace("{option}", "--since/--timestamps")),
        (["--since", "1m", "-f"], OLD_LOGS.replace("{option}", "--since")),
        (["--since", "10", "--attempt", "2"], "--attempt 2: run {run} has no such attempt; it has "
         "attempts 0, 1"),
    ],
)  # fmt: skip
def test_logs_bad_values_are_one_sentence_naming_the_option(two_attempts, args, said):
    state, run_id = two_attempts
    r = launch("logs", run_id, *args, state=state)
    assert r.returncode == 2 and r.stdout == "", r.stdout
    if said is None:
        assert args[0] in r.stderr
    else:
        assert r.stderr.splitlines() == ["error: " + said.format(run=run_id)]


def _texts(attempt: int, host: int) -> list[str]:
    return [f"attempt {attempt} host {host} line {k}" for k in range(2)] + ["WARNING: disk slow"]


@pytest.fixture
def timed_run(tmp_path):
    """A local run (record only, no processes: it reads as ended) whose run folder's host logs
    have their line times: attempt 0 two hours ago, attempt 1 from two hours to 20 s ago; host 1
    writes each line a second after host 0."""
    state, out, run_id = tmp_path / "state", tmp_path / "out", "timed-run-1"
    now = time.time()
    times = {0: [now - 7300, now - 7290, now - 7280], 1: [now - 7200, now - 300, now - 20]}
    for attempt, ts in times.items():
        folder = out / run_id / "logs" / f"attempt-{attempt}"
        folder.mkdir(parents=True)
        for h in range(2):
            (folder / f"host-{h}.log").write_text("".join(f"{t}\n" for t in _texts(attempt, h)))
            records = [line_times_record(k + 1, t + h) for k, t in enumerate(ts)]
            (folder / f"host-{h}.log.times").write_bytes(
                line_times_record(0, ts[0]) + b"".join(records)
            )
    _record(state, out, run_id)
    return state, run_id, times


def test_logs_timestamps_put_each_lines_time_first(timed_run):
    state, run_id, times = timed_run
    r = launch("logs", run_id, "--timestamps", "--all-hosts", state=state)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        f"{stamp(times[a][k] + h)} [host {h}] {text}"
        for a in (0, 1) for h in (0, 1) for k, text in enumerate(_texts(a, h))
    ]  # fmt: skip
    assert all(STAMPED.match(ln) for ln in r.stdout.splitlines())
    # The quiet view: host 0's lines; the warning both hosts said, once, at the earlier time.
    quiet = launch("logs", run_id, "--timestamps", state=state)
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stdout.splitlines() == [
        line
        for a in (0, 1)
        for line in (
            *(f"{stamp(times[a][k])} [host 0] attempt {a} host 0 line {k}" for k in range(2)),
            f"{stamp(times[a][2])} [2 hosts: 0,1] WARNING: disk slow",
        )
    ]
    assert "quiet view: 4 ordinary line(s) of host 1 not shown" in quiet.stderr


def test_logs_since_keeps_the_lines_of_the_last_d(timed_run):
    state, run_id, times = timed_run
    recent = [f"[host {h}] {t}" for h in (0, 1) for t in _texts(1, h)[1:]]
    r = launch("logs", run_id, "--since", "1h", "--all-hosts", state=state)
    assert r.returncode == 0 and r.stdout.splitlines() == recent, r.stderr
    # A finished run followed: the same lines, then the end (the run folder, read as it grows).
    f = launch("logs", run_id, "--since", "1h", "--all-hosts", "--follow", state=state, timeout=60)
    assert f.returncode == 0 and f.stdout.splitlines() == recent, f.stderr
    # --tail after --since; --attempt with --since.
    last = launch("logs", run_id, "--since", "1h", "--tail", "1", "--host", "1", "--timestamps",
                  state=state)  # fmt: skip
    assert last.stdout.splitlines() == [f"{stamp(times[1][2] + 1)} [host 1] WARNING: disk slow"]
    old = launch("logs", run_id, "--attempt", "0", "--since", "1h", state=state)
    assert old.returncode == 0 and old.stdout == "" and old.stderr == ""
    one = launch("logs", run_id, "--attempt", "1", "--since", "1m", "--host", "0", state=state)
    assert one.stdout.splitlines() == ["[host 0] WARNING: disk slow"]


def test_logs_of_a_run_folder_this_machine_cannot_read_is_one_sentence(tmp_path):
    """A gs:// run folder without the gcs extra (gcsfs hidden from the CLI's Python here)."""
    state, run_id = tmp_path / "state", "gs-run-1"
    _record(state, "gs://some-bucket/runs", run_id)
    blocker = tmp_path / "no-gcsfs"
    (blocker / "gcsfs").mkdir(parents=True)
    (blocker / "gcsfs" / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    env = {"PYTHONPATH": f"{blocker}:{ROOT}"}
    r = launch("logs", run_id, "--timestamps", state=state, extra_env=env)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines() == [
        f"error: gs://some-bucket/runs/{run_id}/logs is a gs:// URI but gcsfs is not installed; "
        "install jaxjob with the 'gcs' extra (pip install 'jaxjob[gcs]')"
    ]


def test_docs_list_the_new_options():
    text = (Path(ROOT) / "docs" / "commands.md").read_text()
    for needle in ("launch --version", "runtime --version", "launch completion bash|zsh|fish",
                   "--since D", "--timestamps", "--attempt N"):  # fmt: skip
        assert needle in text, needle


def test_the_completion_script_s_callback_completes(tmp_path):
    """What the printed script runs on <TAB>: `_LAUNCH_COMPLETE=bash_complete launch`."""
    env = {"COMP_WORDS": "launch logs x --at", "COMP_CWORD": "3"}
    r = launch(state=tmp_path, extra_env={**env, "_LAUNCH_COMPLETE": "bash_complete"})
    assert r.returncode == 0 and r.stdout.splitlines() == ["plain,--attempt"], r
