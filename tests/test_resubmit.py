"""A fixed run_id submitted again on the local backend, as a user does it (the CLI in a
subprocess): `launch submit --wait` follows the submission it made, never the end an earlier one
recorded (a config its resume refuses, a resubmit after a cancel, a larger target), and a run
takes one submission at a time."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from test_launch_local import ONE_SCHEDULE, ROOT, kill_leftovers, launch

from jobspec.files.run_toml import merge
from launch.registry import Registry

from runs import tiny_config

pytestmark = pytest.mark.slow

RUN_ID = "rs-fixed"


@pytest.fixture
def state(tmp_path):
    s = tmp_path / "state"
    yield s
    kill_leftovers(s)  # a failed test must not leave a run training in the background


def job_file(tmp: Path, prepared: str, steps: int, **over) -> Path:
    """One host, run_id fixed: each submit of it is the same run."""
    # One decay horizon whatever the length: the runs here share their compiled train step.
    over = merge({"training": {"target_tokens": 16 * 8 * steps}, "optimizer": ONE_SCHEDULE}, over)
    run = tiny_config(prepared, str(tmp / "runs"), run_id="ignored", **over)
    job = {"name": "rs", "run_id": RUN_ID, "hosts": 1, "max_restarts": 0, "run": run}
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def last_line(r: subprocess.CompletedProcess) -> str:
    """The line `--wait` ends with: `run RUN <state>: <detail>, step S of N, ...; RUN_DIR`."""
    return next(ln for ln in reversed(r.stderr.splitlines()) if ln.startswith(f"run {RUN_ID} "))


def submit_wait(job: Path, state: Path) -> subprocess.CompletedProcess:
    try:
        return launch("submit", str(job), "--wait", state=state)
    finally:  # a --wait that raises (a timeout) must not leave the run training
        kill_leftovers(state)


def finished(tmp: Path, prepared: str, state: Path, steps: int) -> None:
    r = submit_wait(job_file(tmp, prepared, steps), state)
    assert r.returncode == 0, r.stderr[-3000:]
    line = last_line(r)
    assert line.startswith(f"run {RUN_ID} succeeded: all 1 hosts exited 0, step {steps} of {steps}")


@pytest.fixture(scope="module")
def finished_4(tmp_path_factory, prepared) -> tuple[Path, Path]:
    """RUN_ID trained to step 4 once for the module: its folder (job, runs, state) and a copy."""
    root = tmp_path_factory.mktemp("resubmit")
    folder, copy = root / "run", root / "finished-4"
    folder.mkdir()
    finished(folder, prepared, folder / "state", steps=4)
    shutil.copytree(folder, copy, symlinks=True)
    return folder, copy


@pytest.fixture
def after_4(finished_4) -> Iterator[Path]:
    """The folder of RUN_ID just after it finished at step 4 (the earlier submission), restored
    from the copy at the same path, since the registry and the run's files name their paths:
    each test resubmits that run without training it again."""
    folder, copy = finished_4
    shutil.rmtree(folder)
    shutil.copytree(copy, folder, symlinks=True)
    yield folder
    kill_leftovers(folder / "state")  # a failed test must not leave a run training


def test_a_config_refused_on_resume_fails_the_resubmit(after_4, prepared):
    """model.num_layers 2 -> 3 after the run finished (the issue's case: nothing more to train,
    yet the config is one resume refuses): the new attempt exits 2; --wait says so instead of
    the earlier `succeeded`."""
    state = after_4 / "state"
    changed = job_file(after_4, prepared, 4, model={"num_layers": 3})
    r = submit_wait(changed, state)
    assert r.returncode == 1, r.stderr[-3000:]
    line = last_line(r)
    assert line.startswith(f"run {RUN_ID} failed: host 0 exit 2 (not restartable)"), line
    assert "compatibility.model.num_layers changed" in r.stdout
    st = json.loads(launch("status", RUN_ID, "--json", state=state).stdout)
    assert st["state"] == "failed", st
    assert st["backend_status"]["attempt"] == 1  # the attempt this submission started


def test_a_resubmit_after_a_cancel_trains_to_its_end(tmp_path, prepared, state):
    """The earlier submission ended `cancelled`: the resubmit's --wait follows its own run to
    the end rather than report that cancel at once."""
    job = job_file(tmp_path, prepared, steps=6)
    r = launch("submit", str(job), state=state)
    assert r.returncode == 0, r.stderr
    cancel = launch("cancel", RUN_ID, "--wait", state=state, timeout=240)
    assert cancel.returncode == 0 and f"{RUN_ID} cancelled" in cancel.stdout, cancel.stdout
    r = submit_wait(job, state)
    assert r.returncode == 0, r.stderr[-3000:]
    line = last_line(r)
    assert line.startswith(f"run {RUN_ID} succeeded: all 1 hosts exited 0, step 6 of 6,"), line


def test_a_resubmit_with_a_larger_target_trains_the_new_steps(after_4, prepared):
    """target_tokens raised after the run finished: the run resumes and trains on; --wait ends
    with the new final step, not the earlier submission's."""
    state = after_4 / "state"
    r = submit_wait(job_file(after_4, prepared, steps=8), state)
    assert r.returncode == 0, r.stderr[-3000:]
    line = last_line(r)
    assert line.startswith(f"run {RUN_ID} succeeded: all 1 hosts exited 0, step 8 of 8,"), line
    assert f"resumed {RUN_ID} from checkpoint 4" in r.stdout
    # It streams its own attempt's lines: the earlier submission's steps are not shown again.
    assert "step: 5 |" in r.stdout and "step: 4 |" not in r.stdout, r.stdout


def test_status_right_after_a_resubmit_is_the_new_submission(after_4, prepared):
    """`launch status` between the submit and the supervisor's first write: the new
    submission, pending, at the attempt it starts; no progress from the earlier one's files."""
    state = after_4 / "state"
    r = launch("submit", str(job_file(after_4, prepared, steps=8)), state=state)
    assert r.returncode == 0, r.stderr
    st = json.loads(launch("status", RUN_ID, "--json", state=state).stdout)
    assert st["state"] in ("pending", "running"), st
    assert st["backend_status"]["attempt"] == 1, st
    assert st["progress"]["status"] in (None, "running"), st["progress"]
    cancel = launch("cancel", RUN_ID, "--wait", state=state, timeout=240)
    assert cancel.returncode == 0, cancel.stderr


def test_two_submits_at_once_start_one_run(tmp_path, prepared, state):
    """Two `launch submit` of one run_id at the same moment: one starts the run; the other is
    refused before it starts or writes anything (exit 2, one sentence)."""
    job = job_file(tmp_path, prepared, steps=2000, training={"log_every": 50})
    env = {**os.environ, "XDG_STATE_HOME": str(state)}
    cmd = [sys.executable, "-m", "launch.cli", "submit", str(job), "--json"]
    procs = [
        subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
        for _ in range(2)
    ]  # fmt: skip
    outs = [(p.wait(timeout=120), *p.communicate()) for p in procs]
    try:
        assert sorted(rc for rc, _, _ in outs) == [0, 2], outs
        _, won, _ = next(o for o in outs if o[0] == 0)
        _, _, refused = next(o for o in outs if o[0] == 2)
        assert re.fullmatch(
            rf"error: run {RUN_ID} is already (pending|running) \(attempt 0, started "
            rf"\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d UTC\); launch cancel {RUN_ID} first or use "
            r"another run_id\n",
            refused,
        ), refused
        # What a user sees is the started submission's: its record, its state.
        rec = Registry(state / "jaxjob").lookup(RUN_ID)
        assert rec.handle == json.loads(won)["handle"]
        sup = json.loads((state / "jaxjob/runs" / RUN_ID / "supervisor.json").read_text())
        assert sup["submission_id"] == rec.handle["submission_id"]
        st = json.loads(launch("status", RUN_ID, "--json", state=state).stdout)
        assert st["state"] in ("pending", "running"), st
    finally:
        cancel = launch("cancel", RUN_ID, "--wait", state=state, timeout=240)
    assert cancel.returncode == 0 and f"{RUN_ID} cancelled" in cancel.stdout, cancel.stdout
