"""`launch wait`, `launch submit --wait --timeout` and `launch status --watch`: how they end
(0 succeeded, 1 failed or cancelled, 124 not within --timeout, 2 a bad option), that they follow
the run's latest submission, and what --watch prints on a terminal and when piped. The runs are
tiny local runs driven as a user does (the CLI in a subprocess); waits are on events."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest
from test_launch_local import ROOT, kill_leftovers, launch, status, wait_for
from test_resubmit import RUN_ID, job_file

from jobspec.errors import JaxjobError
from jobspec.exit_codes import EXIT_TIMED_OUT
from launch.watch import parse_duration, watch


@pytest.fixture
def state(tmp_path):
    s = tmp_path / "state"
    yield s
    kill_leftovers(s)  # a failed test must not leave a run training in the background


@pytest.mark.parametrize(
    "text, seconds",
    [("30s", 30), ("10m", 600), ("2h", 7200), ("1h30m", 5400), ("1d", 86400), ("90", 90),
     ("0.5s", 0.5)],
)  # fmt: skip
def test_durations(text, seconds):
    assert parse_duration(text, "--timeout") == seconds


@pytest.mark.parametrize("text", ["", "m", "10x", "1h30", "10ms", "-1s", "1m1h", "0s"])
def test_a_bad_duration_is_one_sentence_naming_the_option(text):
    with pytest.raises(JaxjobError, match=r"^--timeout '.*' (is not a duration|must be longer)"):
        parse_duration(text, "--timeout")


def polls(*snapshots: tuple[list[str], bool]):
    it = iter(snapshots)
    return lambda: next(it)


def test_watch_piped_prints_each_changed_line_once_with_its_time():
    out = io.StringIO()
    slept: list[float] = []
    watch(
        polls((["state       pending", "progress    step 0"], False),
              (["state       pending", "progress    step 0"], False),
              (["state       running", "progress    step 3"], False),
              (["state       succeeded", "progress    step 3"], True)),
        interval=2.0, out=out, tty=False, sleep=slept.append, clock=lambda: "12:00:00",
    )  # fmt: skip
    assert out.getvalue().splitlines() == [
        "12:00:00 state       pending",
        "12:00:00 progress    step 0",
        "12:00:00 state       running",
        "12:00:00 progress    step 3",
        "12:00:00 state       succeeded",
    ]
    assert slept == [2.0, 2.0, 2.0]  # no wait after the run has ended


def test_watch_on_a_terminal_redraws_the_same_lines():
    out = io.StringIO()
    watch(
        polls((["a", "b"], False), (["a", "b"], False), (["a", "c", "d"], False), (["e"], True)),
        interval=1.0, out=out, tty=True, sleep=lambda s: None,
    )  # fmt: skip
    # Drawn once, unchanged not redrawn, then back over the lines drawn and cleared below.
    assert out.getvalue() == "a\nb\n" + "\x1b[2F\x1b[Ja\nc\nd\n" + "\x1b[3F\x1b[Je\n"


@pytest.mark.parametrize(
    "args, sentence",
    [(["submit", "job.yaml", "--timeout", "1m"], "--timeout applies only with --wait"),
     (["submit", "job.yaml", "--wait", "--timeout", "soon"], "--timeout 'soon' is not a duration"),
     (["wait", "r", "--timeout", "1h30"], "--timeout '1h30' is not a duration"),
     (["status", "r", "--interval", "2s"], "--interval applies only with --watch"),
     (["status", "r", "--watch", "--interval", "0"], "--interval '0' must be longer than 0"),
     (["status", "r", "--watch", "--json"], "--watch shows the status as text")],
)  # fmt: skip
def test_bad_options_are_one_sentence_exit_2(args, sentence, state):
    r = launch(*args, state=state)
    assert r.returncode == 2 and r.stdout == "", r
    assert r.stderr.startswith(f"error: {sentence}") and len(r.stderr.splitlines()) == 1, r.stderr


@pytest.mark.parametrize(
    "cmd, options",
    [
        ("wait", ["--timeout D"]),
        ("status", ["--watch", "--interval D"]),
        ("submit", ["--timeout D"]),
    ],
)
def test_help_names_the_new_options(cmd, options, state):
    r = launch(cmd, "--help", state=state)
    assert r.returncode == 0 and all(o in r.stdout for o in options), r.stdout


def test_timed_out_is_124():
    assert EXIT_TIMED_OUT == 124


def closing(text: str) -> str:
    return next(ln for ln in reversed(text.splitlines()) if ln.startswith(f"run {RUN_ID} "))


@pytest.mark.slow
def test_wait_and_watch_follow_the_latest_submission(tmp_path, prepared, state):
    """A run that succeeded, then submitted again with more steps: waiting on it times out (124)
    instead of answering with the earlier submission's success; the run goes on, a watch sees it
    running and then cancelled, and `launch wait` then ends 1."""
    r = launch("submit", str(job_file(tmp_path, prepared, 2)), "--wait", "--timeout", "10m",
               state=state)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert closing(r.stderr).startswith(f"run {RUN_ID} succeeded")
    r = launch("wait", RUN_ID, "--timeout", "1m", state=state)
    assert r.returncode == 0 and closing(r.stdout).startswith(f"run {RUN_ID} succeeded"), r
    r = launch("status", RUN_ID, "--watch", state=state)  # ended: one snapshot
    assert r.returncode == 0, r.stderr
    assert any(ln.endswith("state       succeeded  all 1 hosts exited 0") for ln in
               r.stdout.splitlines()), r.stdout  # fmt: skip

    # Again, with far more steps: still starting when the tiny timeout passes.
    r = launch("submit", str(job_file(tmp_path, prepared, 2000)), "--wait", "--timeout", "1s",
               state=state)  # fmt: skip
    assert r.returncode == EXIT_TIMED_OUT, r.stderr[-3000:]
    assert r.stderr.splitlines()[-1].startswith(f"error: run {RUN_ID} has not ended within 1s")
    assert status(RUN_ID, state)["state"] in ("pending", "running")  # it goes on
    r = launch("wait", RUN_ID, "--timeout", "0.5s", state=state)
    assert r.returncode == EXIT_TIMED_OUT, r  # never the earlier submission's success
    assert f"launch cancel {RUN_ID} stops it" in r.stderr

    piped = tmp_path / "watch.out"
    env = {**os.environ, "XDG_STATE_HOME": str(state)}
    with piped.open("w") as f:
        watcher = subprocess.Popen(
            [sys.executable, "-m", "launch.cli", "status", RUN_ID, "--watch", "--interval", "0.5"],
            cwd=ROOT, env=env, stdout=f, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
    try:
        wait_for(lambda: "state       running" in piped.read_text(), 120, "the watch: running")
        r = launch("cancel", RUN_ID, "--wait", state=state, timeout=180)
        assert r.returncode == 0, r.stderr
        _, err = watcher.communicate(timeout=120)
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.wait()
    assert watcher.returncode == 1, err
    lines = piped.read_text().splitlines()
    assert all(ln[:9].count(":") == 2 and ln[8] == " " for ln in lines), lines  # HH:MM:SS line
    states = [ln[9:] for ln in lines if ln[9:].startswith("state ")]
    assert states[-1].startswith("state       cancelled"), lines
    assert states[0].startswith(("state       pending", "state       running")), lines
    assert len(states) == len(set(states)), lines  # each change once
    r = launch("wait", RUN_ID, state=state)
    assert r.returncode == 1 and closing(r.stdout).startswith(f"run {RUN_ID} cancelled"), r
