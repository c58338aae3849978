"""`launch --version`, `runtime --version`, `launch completion SHELL` and `launch logs --since
--timestamps --attempt` (issue 41), all through the CLI."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from test_launch_local import ROOT, launch

from launch.registry import Registry, RunRecord
from launch.state import utc_now


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


@pytest.fixture
def two_attempts(tmp_path):
    """A local run (record only, no processes) whose run folder has host logs of attempts 0
    and 1, as runtime/host/hostlog.py writes them."""
    state, out, run_id = tmp_path / "state", tmp_path / "out", "fake-run-1"
    for attempt, hosts in ((0, 2), (1, 2)):
        folder = out / run_id / "logs" / f"attempt-{attempt}"
        folder.mkdir(parents=True)
        for h in range(hosts):
            text = "".join(f"attempt {attempt} host {h} line {k}\n" for k in range(3))
            (folder / f"host-{h}.log").write_text(text)
    registry = Registry(state / "jaxjob")
    run_dir = registry.run_dir(run_id)
    run_dir.mkdir(parents=True)
    handle = {"pid": 1, "run_dir": str(run_dir), "log_dir": str(run_dir / "logs")}
    registry.record(RunRecord(run_id, "local", handle, str(out), utc_now(), "job.yaml"))
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
        (["--since", "1h30m"], "--since: run {run}'s host logs (local) do not record when each "
         "line was written (they are a plain copy of each host's output), so they cannot be "
         "shown by time; use --tail K or --attempt N instead"),
        (["--timestamps"], "--timestamps: run {run}'s host logs (local) do not record when each "
         "line was written (they are a plain copy of each host's output), so they cannot be "
         "shown by time; use --tail K or --attempt N instead"),
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
