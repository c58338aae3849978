"""Bad job specs: `launch submit` says what is wrong in one sentence naming the field, exits
non-zero without a traceback, and submits nothing (the registry stays empty)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from runs import stderr_lines, tiny_config, write_config

ROOT = Path(__file__).resolve().parents[1]
GOOD = "name: ok\nhosts: 2\nrun: run.toml\n"

# id: (job.yaml, extra args, words the message must contain)
CASES = {
    "yaml-syntax": ("name: ok\nrun: [run.toml\n", (), ["YAML syntax error", "line"]),
    "unknown-key": ("nmae: ok\nrun: run.toml\n", (), ["nmae: unknown key", "did you mean 'name'"]),
    "bad-name": ("name: My_Job\nrun: run.toml\n", (), ["name:", "DNS-1123"]),
    "bad-run-id": ("name: ok\nrun_id: UPPER\nrun: run.toml\n", (), ["run_id:"]),
    "unknown-accelerator": (
        "name: ok\naccelerator: tpu-v9-8\nrun: run.toml\n", (), ["accelerator:", "tpu-v9-8"],
    ),
    "hosts-vs-topology": (
        "name: ok\naccelerator: tpu-v5p-32\nhosts: 2\nrun: run.toml\n", ("--backend", "k8s"),
        ["hosts:", "must be 4"],
    ),
    "mesh-does-not-fit": ("name: ok\nhosts: 2\nrun: run4.toml\n", (), ["run.mesh", "make the mesh product 2"]),
    "missing-run-config": ("name: ok\nrun: nope.toml\n", (), ["run:", "not found"]),
    "run-missing": ("name: ok\nhosts: 2\n", (), ["run: required key is missing"]),
    "bad-run-config": (
        "name: ok\nrun:\n  run: {id: x}\n  trainingg: {}\n", (), ["run", "trainingg: unknown key"],
    ),
    "inline-secret": (
        GOOD + "env: {HF_TOKEN: abc}\n", (), ["env:", "HF_TOKEN", "reference it instead"],
    ),
    "reserved-env": (GOOD + "env: {JAXJOB_RUN_ID: x}\n", (), ["env:", "JAXJOB_RUN_ID"]),
    "slices-on-gpu": (
        "name: ok\naccelerator: h100-80gb\nhosts: 2\nslices: 2\nrun: run.toml\n", ("--backend", "slurm"),
        ["slices:", "need a TPU"],
    ),
    "secret-not-in-shell": (
        GOOD + "env:\n  HF_TOKEN: {secret: hf, key: token}\n", (), ["env.HF_TOKEN", "export HF_TOKEN"],
    ),
    "context-off-k8s": (GOOD, ("--context", "gke"), ["--context", "k8s"]),
    "no-such-file": (None, (), ["no such job spec file"]),
}  # fmt: skip


@pytest.fixture(scope="module")
def run_files(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("bad-specs")
    for name, data in (("run.toml", 2), ("run4.toml", 4)):
        cfg = tiny_config("unused/manifest.json", str(d / "runs"), run_id="x", mesh={"data": data})
        write_config(d / name, cfg)
    return d


@pytest.mark.parametrize("case", list(CASES))
def test_bad_spec_is_one_sentence_and_submits_nothing(case, run_files, tmp_path):
    text, args, words = CASES[case]
    job = run_files / f"{case}.yaml"
    if text is not None:
        job.write_text(text)
    state = tmp_path / "state"
    env = {**os.environ, "XDG_STATE_HOME": str(state)}
    env.pop("HF_TOKEN", None)
    r = subprocess.run(
        [sys.executable, "-m", "launch.cli", "submit", str(job), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and r.stdout == ""
    lines = stderr_lines(r.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert not list(state.glob("jaxjob/runs/*")), "nothing may be recorded for a bad spec"


def test_good_spec_renders(run_files, tmp_path):
    # The table's baseline is valid: each failure above comes from its one change.
    job = run_files / "good.yaml"
    job.write_text(GOOD)
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state")}
    r = subprocess.run(
        [sys.executable, "-m", "launch.cli", "render", str(job)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr


def test_run_config_needs_no_run_id_of_its_own(run_files, tmp_path):
    # The run id comes from the job spec (run_id, or a fresh one): no placeholder in the TOML.
    cfg = tiny_config("unused/manifest.json", str(run_files / "runs"), run_id="x", mesh={"data": 2})
    del cfg["run"]["id"]
    write_config(tmp_path / "noid.toml", cfg)
    job = tmp_path / "job.yaml"
    job.write_text("name: ok\nrun_id: ok-given\nhosts: 2\nrun: noid.toml\n")
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state")}
    r = subprocess.run(
        [sys.executable, "-m", "launch.cli", "render", str(job)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert 'id = "ok-given"' in r.stdout
