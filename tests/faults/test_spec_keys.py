"""A job spec or run config that gives a key twice, and a local job with more host processes than
one machine runs: each is refused with one sentence naming the key or field
(and the line), exit 2, before anything is written or submitted."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jobspec.backends.local import MAX_LOCAL_PROCESSES
from jobspec.errors import ConfigError

from runs import ROOT, stderr_lines, tiny_config, write_config


def _launch(*args: str, state: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "XDG_STATE_HOME": str(state)}
    return subprocess.run(
        [sys.executable, "-m", "launch.cli", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def _one_sentence(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 2, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert "Traceback" not in r.stderr and r.stdout == ""
    lines = stderr_lines(r.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    return lines[0]


@pytest.fixture
def folder(tmp_path) -> Path:
    cfg = tiny_config("unused/manifest.json", str(tmp_path / "runs"), run_id="x", mesh={"data": 2})
    write_config(tmp_path / "run.toml", cfg)
    return tmp_path


# (job.yaml, the words the sentence must hold): the second occurrence's line, and the first's.
DUPLICATES = {
    "top-level": (
        "name: ok\nhosts: 2\nmax_restarts: 3\nrun: run.toml\nmax_restarts: 0\n",
        ["line 5", "'max_restarts'", "line 3"],
    ),
    "env-twice": (
        "name: ok\nhosts: 2\nenv: {A: '1'}\nrun: run.toml\nenv: {B: '2'}\n",
        ["line 5", "'env'", "line 3"],
    ),
    "inside-env": (
        "name: ok\nhosts: 2\nrun: run.toml\nenv:\n  WANDB_MODE: offline\n  WANDB_MODE: online\n",
        ["line 6", "'WANDB_MODE'", "line 5"],
    ),
    "inline-run": (
        "name: ok\nhosts: 2\nrun:\n  run: {id: x}\n  training: {seq_len: 16}\n"
        "  training: {seq_len: 32}\n",
        ["line 6", "'training'", "line 5"],
    ),
    "quoted-and-plain": ("name: ok\nhosts: 2\n'hosts': 4\nrun: run.toml\n", ["line 3", "'hosts'"]),
}


def _submit_check(job: Path, state: Path) -> str:
    """What `launch submit` checks before it submits anything (in this process: a spec that
    passed would be submitted for real by the command), as the sentence it would print."""
    from launch.cli import prepare_submission
    from launch.registry import Registry

    with pytest.raises(ConfigError) as e:
        prepare_submission(str(job), "local", Registry(state / "jaxjob"))
    assert e.value.exit_code == 2
    return f"error: {e.value}"


@pytest.mark.parametrize("case", list(DUPLICATES))
@pytest.mark.parametrize("command", ["submit", "render"])
def test_a_key_given_twice_is_refused(case, command, folder):
    text, words = DUPLICATES[case]
    job = folder / "job.yaml"
    job.write_text(text)
    state = folder / "state"
    if command == "submit":
        line = _submit_check(job, state)
    else:
        line = _one_sentence(_launch(command, str(job), state=state))
    assert line.startswith(f"error: {job}: "), line
    for w in words:
        assert w in line, (w, line)
    assert "twice" in line, line
    assert not list(state.glob("jaxjob/runs/*")), "nothing may be recorded for a refused spec"


def test_plan_refuses_a_key_given_twice(folder):
    # `launch plan` refuses it while loading the spec, before `runtime plan` compiles anything.
    job = folder / "job.yaml"
    job.write_text("name: ok\nhosts: 2\nrun: run.toml\nhosts: 4\n")
    line = _one_sentence(_launch("plan", str(job), state=folder / "state"))
    assert "'hosts'" in line and "line 4" in line and "line 2" in line, line


def test_merge_keys_still_override(folder):
    # A key that overrides what `<<: *anchor` merged in is YAML's own override, not a duplicate.
    job = folder / "job.yaml"
    job.write_text(
        "name: ok\nhosts: 2\nimage: ghcr.io/me/jaxjob:1\nrun: run.toml\n"
        "k8s:\n  labels: &base {team: a, tier: x}\n  annotations: {<<: *base, team: b}\n"
    )
    r = _launch("render", str(job), "--backend", "k8s", state=folder / "state")
    assert r.returncode == 0, r.stderr
    assert "team: b" in r.stdout


def test_a_run_config_key_given_twice_names_the_key(folder):
    # tomllib refuses it but says only "Cannot overwrite a value": the sentence names the key.
    (folder / "dup.toml").write_text(
        (folder / "run.toml").read_text() + "\n[optimizer]\nlr = 1e-3\n"
    )  # a second [optimizer] table: TOML's own message names it
    (folder / "dup2.toml").write_text('[run]\nid = "x"\nseed = 1\nseed = 2\n')
    job = folder / "job.yaml"
    job.write_text("name: ok\nhosts: 2\nrun: dup2.toml\n")
    line = _one_sentence(_launch("render", str(job), state=folder / "state"))
    assert "dup2.toml" in line and "line 4" in line and "run.seed" in line, line
    r = subprocess.run(
        [sys.executable, "-m", "runtime", "config", "check", str(folder / "dup2.toml")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert "run.seed" in _one_sentence(r)
    job.write_text("name: ok\nhosts: 2\nrun: dup.toml\n")
    line = _submit_check(job, folder / "state")
    assert "optimizer" in line and "line" in line, line


@pytest.mark.parametrize(
    "text, field",
    [
        ("name: ok\nhosts: 20000\nrun: big.toml\n", "hosts"),
        ("name: ok\nhosts: 2\nlocal: {processes: 20000}\nrun: big.toml\n", "local.processes"),
    ],
)
@pytest.mark.parametrize("command", ["submit", "render"])
def test_local_hosts_are_bounded(text, field, command, folder):
    # A mesh that matches, so the process count is the only thing wrong (20,000 processes made a
    # 16 MB hosts.json before anything checked it).
    big = tiny_config("unused/manifest.json", str(folder / "runs"), run_id="x",
                      mesh={"data": 20000},
                      training={"global_batch_size": 20000, "target_tokens": 20000 * 16})  # fmt: skip
    write_config(folder / "big.toml", big)
    job = folder / "job.yaml"
    job.write_text(text)
    state = folder / "state"
    if command == "submit":
        line = _submit_check(job, state)
    else:
        line = _one_sentence(_launch(command, str(job), state=state))
    assert f"{field}: " in line and "20000" in line and str(MAX_LOCAL_PROCESSES) in line, line
    assert not list(state.glob("jaxjob/runs/*"))


def test_the_bound_itself_is_allowed(folder):
    n = MAX_LOCAL_PROCESSES
    cfg = tiny_config("unused/manifest.json", str(folder / "runs"), run_id="x", mesh={"data": n},
                      training={"global_batch_size": n})  # fmt: skip
    write_config(folder / "edge.toml", cfg)
    job = folder / "job.yaml"
    job.write_text(f"name: ok\nhosts: {n}\nrun: edge.toml\n")
    r = _launch("render", str(job), state=folder / "state")
    assert r.returncode == 0, r.stderr
    assert f'"index": {n - 1},' in r.stdout
