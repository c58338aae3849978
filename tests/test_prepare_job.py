"""A prepare job (job.yaml with `prepare:` instead of `run:`) through `launch`, as a user runs it:
2 local hosts and 2 SLURM tasks make the dataset one host makes (same fingerprint); a part lost
afterwards is the only one a second job writes; the k8s JobSet validates and runs `runtime
worker` on the prepare config; a bad spec is one sentence."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from jobspec.prepare_job import PrepareJobConfig
from launch import cli as launch_cli
from launch.backends.k8s.render import CONFIG_DIR, CONFIG_FILE, render_manifests
from launch.registry import Registry

from runs import ROOT, write_text_corpus

PART = "6K"  # two corpus files per part: 6 parts, 3 on each host


def launch(state: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "XDG_STATE_HOME": str(state), "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "launch.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


def job_file(folder: Path, name: str, inputs: str = "corpus/*.txt", **extra) -> Path:
    """A 2-host prepare job whose relative paths are the job.yaml folder's."""
    prepare = {"inputs": [inputs], "out": f"data-{name}", "part_size": PART, "workers": 1,
               "val_fraction": 0.1}  # fmt: skip
    spec = {"name": name, "hosts": 2, "max_restarts": 0, "output_uri": str(folder / "runs"),
            "prepare": prepare, **extra}  # fmt: skip
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("prepare-job")
    write_text_corpus(d / "corpus", docs=12)
    return d


@pytest.fixture(scope="module")
def one_host(folder) -> str:
    """The fingerprint of the same inputs prepared by one process."""
    from jobspec.prepare_job import size_bytes
    from runtime.data.prepare.build import prepare_dataset

    m = prepare_dataset([str(folder / "corpus/*.txt")], "byte", str(folder / "one"),
                        val_fraction=0.1, part_bytes=size_bytes(PART), workers=1)  # fmt: skip
    return m.fingerprint


def fingerprint(out: Path) -> str:
    return json.loads((out / "manifest.json").read_text())["fingerprint"]


def shares(run_dir: Path) -> dict[int, tuple[list[int], list[int]]]:
    """Each host's (written, skipped) parts, from hosts/<i>/share.json."""
    got = {}
    for i in (0, 1):
        s = json.loads((run_dir / f"hosts/{i}/share.json").read_text())
        got[i] = (s["written"], s["skipped"])
    return got


@pytest.mark.slow
def test_local_job_matches_one_host_and_redoes_only_a_lost_part(folder, one_host, tmp_path):
    state = tmp_path / "state"
    job = job_file(folder, "prep-local")
    first = launch(state, "submit", str(job), "--wait")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    out = folder / "data-prep-local"
    assert fingerprint(out) == one_host
    (run_id,) = [r.run_id for r in Registry(state / "jaxjob").list()]
    assert shares(folder / "runs" / run_id) == {0: ([0, 2, 4], []), 1: ([1, 3, 5], [])}

    # Part 3 (host 1's) is lost: the next job writes it alone and the dataset is the same.
    shutil.rmtree(next(out.glob("shares-*/part-00003")))
    again = launch(state, "submit", str(job), "--wait", "--all-hosts")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "wrote 1 part(s) (3), skipped 2 already committed (1, 5); 6 parts in all" in again.stdout
    assert fingerprint(out) == one_host
    second = next(r.run_id for r in Registry(state / "jaxjob").list() if r.run_id != run_id)
    assert shares(folder / "runs" / second) == {0: ([], [0, 2, 4]), 1: ([3], [1, 5])}
    status = launch(state, "status", second)
    assert status.returncode == 0, status.stderr
    assert "6 parts: 1 written by this attempt, 5 already committed" in status.stdout
    record = json.loads((folder / "runs" / second / "manifest.json").read_text())
    assert record["kind"] == "prepare" and record["status"] == "completed"


@pytest.mark.slow
def test_a_failed_share_ends_every_host_with_its_code(folder, tmp_path):
    """Host 1's part 5 holds a broken JSONL file: host 0 stops too, both exit 2, nothing hangs."""
    bad = folder / "corpus-bad"
    shutil.copytree(folder / "corpus", bad)
    (bad / "doc-010b.jsonl").write_text('{"text": "ok"}\n' + "not json " * 300 + "\n")
    state = tmp_path / "state"
    r = launch(state, "submit", str(job_file(folder, "prep-bad", "corpus-bad/*")), "--wait")
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    (run_id,) = [rec.run_id for rec in Registry(state / "jaxjob").list()]
    hosts = json.loads((state / "jaxjob/runs" / run_id / "supervisor.json").read_text())["hosts"]
    assert [h["returncode"] for h in hosts] == [2, 2], hosts
    record = json.loads((folder / "runs" / run_id / "manifest.json").read_text())
    assert record["status"] == "failed" and record["error"].startswith("host 1: line 2 of ")
    log0 = (folder / "runs" / run_id / "logs/attempt-0/host-0.log").read_text()
    assert "error: stopping this host (exit 2): host 1: line 2 of " in log0


@pytest.mark.slow
def test_slurm_job_matches_one_host(folder, one_host, slurm_cluster, tmp_path):
    state = tmp_path / "state"
    slurm = {"hosts_per_node": 2, "time": "00:10:00"}  # the dev cluster is one node
    job = job_file(folder, "prep-slurm", slurm=slurm)
    try:
        r = launch(state, "submit", str(job), "--backend", "slurm", "--wait", "--all-hosts")
    finally:  # a timeout or failed assert must not leave the job holding the node
        for rec in Registry(state / "jaxjob").list():
            subprocess.run(["scancel", str(rec.handle["job_id"])], capture_output=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[host 1] host 1: share 1/2 of plan " in r.stdout
    assert fingerprint(folder / "data-prep-slurm") == one_host


def test_k8s_jobset_validates_and_runs_the_worker_on_the_prepare_config(tmp_path):
    from test_k8s_render import CRD, _as_job, _errors, _strict

    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    jsonschema = pytest.importorskip("jsonschema")
    if not CRD.is_file():
        pytest.skip(f"the JobSet CRD is not at {CRD}")
    spec = {"name": "prep-web", "image": "img:1", "hosts": 3, "output_uri": "gs://b/runs",
            "prepare": {"inputs": ["gs://corpus/web/*.parquet"], "out": "gs://b/data/web",
                        "tokenizer": "byte", "part_size": "128M", "workers": 8}}  # fmt: skip
    path = tmp_path / "prep.yaml"
    path.write_text(yaml.safe_dump(spec))
    sub = launch_cli.prepare_submission(str(path), "k8s", Registry(tmp_path / "state"))
    m = render_manifests(sub)

    crd = yaml.safe_load(CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha2"]
    validator = jsonschema.Draft7Validator(_strict(version["schema"]["openAPIV3Schema"]))
    assert _errors(validator, m.jobset) == []
    kubernetes_validate.validate(m.configmap, "1.37.0", strict=True)
    (rjob,) = m.jobset["spec"]["replicatedJobs"]
    kubernetes_validate.validate(_as_job(m.jobset, rjob), "1.37.0", strict=True)

    pod = rjob["template"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["args"] == ["runtime", "worker", f"{CONFIG_DIR}/{CONFIG_FILE}"]
    assert rjob["template"]["spec"]["parallelism"] == 3
    cfg = PrepareJobConfig.model_validate(tomllib.loads(m.configmap["data"][CONFIG_FILE]))
    assert cfg.run.id == sub.run_id and cfg.prepare.out == "gs://b/data/web"
    assert cfg.prepare.part_bytes == 128 << 20 and cfg.prepare.workers == 8


PREP = "prepare: {inputs: [corpus/*.txt], out: data}\n"
# id: (job.yaml, extra args, words the sentence must contain)
BAD = {
    "both": ("name: ok\nrun: run.toml\n" + PREP, (), ["run and prepare", "not both"]),
    "neither": ("name: ok\nhosts: 2\n", (), ["run: required key is missing", "prepare:"]),
    "part-size": (
        "name: ok\nprepare: {inputs: [a.txt], out: d, part_size: 12Q}\n", (),
        ["prepare.part_size: not a size", "128M", "'12Q'"],
    ),
    "k8s-local-out": ("name: ok\nimage: i:1\n" + PREP, ("--backend", "k8s"), ["prepare.out", "gs://"]),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD))
def test_bad_prepare_spec_is_one_sentence(case, tmp_path, monkeypatch, capsys):
    text, args, words = BAD[case]
    job = tmp_path / "job.yaml"
    job.write_text(text)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    with pytest.raises(SystemExit) as exit_:
        launch_cli.main(["submit", str(job), *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert all(w in err[0] for w in words), (words, err[0])
    assert not (tmp_path / "state").exists()  # nothing submitted


def test_plan_of_a_prepare_job_is_one_sentence(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text("name: ok\n" + PREP)
    with pytest.raises(SystemExit) as exit_:
        launch_cli.main(["plan", str(job)])
    out = capsys.readouterr().out.strip().splitlines()
    assert exit_.value.code == 0 and len(out) == 1 and "no train step to compile" in out[0]
