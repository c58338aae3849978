"""Issue 11, point 10 (launch side): each bad input is one sentence and exit 2, never a traceback.

Names with a trailing newline, YAML alias bombs, a broken registry record.json among good ones;
a malformed checkpoint index entry reads as the committed folders, with one warning line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from jobspec.errors import ConfigError
from jobspec.files.job_yaml import MAX_ALIAS_NODES, load_job
from jobspec.run_config import check_dns_label
from launch.registry import Registry, RunRecord
from launch.runid import is_run_id

from runs import ROOT, run_cli, stderr_lines

SPEC = ROOT / "configs" / "smoke.yaml"


def launch(state: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "XDG_STATE_HOME": str(state), "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "launch.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


def one_sentence(res: subprocess.CompletedProcess, rc: int = 2) -> str:
    err = stderr_lines(res.stderr)
    assert res.returncode == rc and len(err) == 1 and "Traceback" not in res.stderr, res.stderr
    return err[0]


def spec_file(tmp_path: Path, **over: object) -> Path:
    data = yaml.safe_load(SPEC.read_text())
    data["run"] = str(SPEC.parent / data["run"])
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({**data, **over}))
    return path


# ---- names: `$` with re.match lets "name\n" through -----------------------------------------


@pytest.mark.parametrize(
    "over, field",
    [
        ({"name": "smoke\n"}, "name:"),
        ({"run_id": "smoke-abc123\n"}, "run_id:"),
        ({"env": {"MODE\n": "x"}}, "env:"),
        ({"accelerator": "tpu-v5e-16\n"}, "accelerator:"),
        ({"k8s": {"namespace": "ml\n"}}, "k8s: namespace"),
        ({"k8s": {"queue": "team-a\n"}}, "k8s: queue"),
        ({"k8s": {"labels": {"team": "a\n"}}}, "k8s: labels.team value"),
        ({"k8s": {"labels": {"team\n": "a"}}}, "k8s: labels key"),
        ({"k8s": {"node_selector": {"pool": "tpu\n"}}}, "k8s: node_selector.pool value"),
        ({"k8s": {"service_account": "runner\n"}}, "k8s: service_account"),
        ({"k8s": {"priority_class": "high\n"}}, "k8s: priority_class"),
    ],
)
def test_a_trailing_newline_is_not_a_name(tmp_path, over, field):
    with pytest.raises(ConfigError) as e:
        load_job(spec_file(tmp_path, **over))
    assert f"job.yaml: {field}" in str(e.value) and "\\n" in str(e.value)


def test_run_ids_refuse_a_trailing_newline(tmp_path):
    assert is_run_id("smoke-abc123") and not is_run_id("smoke-abc123\n")
    with pytest.raises(ValueError, match="is not a DNS-1123 label"):
        check_dns_label("smoke-abc123\n", "JAXJOB_RUN_ID: ")  # the runtime's env check
    res = launch(tmp_path / "state", "render", str(spec_file(tmp_path, name="smoke\n")))
    assert "is not a DNS-1123 label" in one_sentence(res)
    res = launch(tmp_path / "state", "status", "smoke\n")
    assert "unknown run id 'smoke\\n'" in one_sentence(res)
    # --namespace replaces k8s.namespace: checked the same way.
    res = launch(tmp_path / "state", "render", str(spec_file(tmp_path)), "--backend", "k8s",
                 "--namespace", "ml\n", "-o", str(tmp_path / "out"))  # fmt: skip
    assert "--namespace 'ml\\n' is not a DNS-1123 label" in one_sentence(res)


# ---- YAML: aliases are counted, nesting and size are bounded ---------------------------------


def billion_laughs(levels: int = 9) -> str:
    """9^levels tolerations from a few hundred bytes of YAML."""
    lines = ["  tolerations:", "  - &l0 {key: a, operator: Exists}"]
    for i in range(1, levels + 1):
        lines.append(f"  - &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]")
    return "name: bomb\nrun: {}\nk8s:\n" + "\n".join(lines) + "\n"


def test_an_alias_bomb_is_refused_at_once(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(billion_laughs())
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as e:
        load_job(path)
    # A few ms here; expanding the 9^9 values would take minutes and gigabytes. The bound
    # leaves room for a loaded machine that schedules this process late.
    assert time.monotonic() - t0 < 5
    assert str(e.value).startswith(f"{path}: line ")
    assert f"more than {MAX_ALIAS_NODES:,} values (an alias bomb?)" in str(e.value)
    res = launch(tmp_path / "state", "render", str(path), "--backend", "k8s", timeout=30)
    assert "an alias bomb?" in one_sentence(res)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("name: r\nrun: {}\nk8s:\n  tolerations: &t [*t]\n", "line 4: the alias *t refers to its own anchor"),
        ("name: r\nrun: " + "[" * 500 + "]" * 500 + "\n", "line 2: the document nests more than 100 levels"),
        ("name: r\nrun: {}\n" + "# padding\n" * 120_000, "more than the 1,048,576 a job spec may have"),
        ("name: r\nrun: [\n", "YAML syntax error at line 3"),
    ],
)  # fmt: skip
def test_hostile_yaml_is_one_sentence(tmp_path, text, expected):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_job(path)
    assert expected in str(e.value), str(e.value)


def test_a_few_aliases_still_work(tmp_path):
    data = yaml.safe_load(SPEC.read_text())
    text = (
        f"name: aliased\nrun: {SPEC.parent / data['run']}\nhosts: 2\n"
        "env: &env {MODE: fast}\nk8s:\n  labels: *env\n"
        "  tolerations: [&t {key: a, operator: Exists}, *t]\n"
    )
    path = tmp_path / "job.yaml"
    path.write_text(text)
    spec = load_job(path).spec
    assert spec.k8s.labels == {"MODE": "fast"} and len(spec.k8s.tolerations) == 2


# ---- the run registry: one broken record is one line, the others still list -----------------


def good_record(reg: Registry, run_id: str, submitted: str) -> None:
    reg.record(RunRecord(run_id=run_id, backend="local", submitted=submitted, output_uri="/out",
                         handle={"run_dir": str(reg.run_dir(run_id)), "pid": 1},
                         job_path="/jobs/job.yaml"))  # fmt: skip


BROKEN = [
    ("{not json", "it cannot be read as JSON"),
    ("[1, 2]", "a record is a JSON object, not list"),
    ('{"run_id": "bad-aaaaaa"}', "it lacks backend, handle, output_uri, submitted, job_path"),
    (json.dumps({"run_id": "bad-aaaaaa", "backend": "local", "handle": "x", "output_uri": "/o",
                 "submitted": "2026", "job_path": "/j"}), "handle is 'x', not a mapping"),
    (json.dumps({"run_id": "bad-aaaaaa", "backend": "local", "handle": {}, "output_uri": "/o",
                 "submitted": "2026", "job_path": "/j"}), "its local handle lacks run_dir"),
    (json.dumps({"run_id": "other-aaaaaa", "backend": "nope", "handle": {}, "output_uri": "/o",
                 "submitted": "2026", "job_path": "/j"}), "it names run 'other-aaaaaa' but lies in"),
]  # fmt: skip


@pytest.mark.parametrize("content, why", BROKEN)
def test_a_broken_record_is_one_line_and_the_others_list(tmp_path, content, why):
    state = tmp_path / "state"
    reg = Registry(state / "jaxjob")
    good_record(reg, "good-aaaaaa", "2026-01-02T00:00:00.000000+00:00")
    good_record(reg, "good-bbbbbb", "2026-01-01T00:00:00.000000+00:00")
    bad = reg.run_dir("bad-aaaaaa") / "record.json"
    bad.parent.mkdir(parents=True)
    bad.write_text(content)
    assert [r.run_id for r in reg.list()] == ["good-aaaaaa", "good-bbbbbb"]
    (broken,) = reg.scan()[1]
    assert broken.path == bad and broken.why.startswith(why)
    if content not in (BROKEN[0][0], BROKEN[-2][0]):
        return  # the CLI's handling is the same for every kind: two are enough to run

    res = launch(state, "list")
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    out = res.stdout.splitlines()
    assert out[0].split()[:3] == ["RUN", "BACKEND", "STATE"]
    assert [ln.split()[0] for ln in out[1:3]] == ["good-aaaaaa", "good-bbbbbb"]
    assert len(out) == 4 and out[3].startswith(f"broken record: {bad}: {why}"), out
    as_json = launch(state, "list", "--json")
    assert [r["run_id"] for r in json.loads(as_json.stdout)] == ["good-aaaaaa", "good-bbbbbb"]
    assert stderr_lines(as_json.stderr)[-1].startswith(f"broken record: {bad}: {why}")

    msg = one_sentence(launch(state, "status", "bad-aaaaaa"))
    assert msg.startswith(f"error: broken record: {bad}: {why}") and "remove" in msg


# ---- a malformed checkpoint index entry --------------------------------------------------------


@pytest.mark.parametrize(
    "index, why",
    [
        ({"checkpoints": [{"step": 4}, {"loss": 1.0}], "latest": 4}, "checkpoints[1] is {'loss': 1.0}"),
        ({"checkpoints": [{"step": "4"}], "latest": 4}, "checkpoints[0] is {'step': '4'}"),
        ({"checkpoints": [7], "latest": 7}, "checkpoints[0] is 7, not an entry"),
        ({"checkpoints": [{"step": 4}], "latest": "4"}, "latest is '4', not a step or null"),
    ],
)  # fmt: skip
def test_a_malformed_index_reads_as_the_committed_folders(tmp_path, capsys, index, why):
    """A malformed index is damage, as one cut short is (tests/faults/test_damaged_index.py):
    readers get the committed folders instead, with one warning line that says why."""
    from runfolder.store import ArtifactStore
    from runtime.run.checkpoint.index import load_index, reconciled_entries

    run = tmp_path / "run"
    entry = {"step": 4, "metrics": {}}  # what the checkpoint's own `entry` item records
    (run / "checkpoints" / "4" / "entry").mkdir(parents=True)
    (run / "checkpoints" / "4" / "entry" / "metadata").write_text(json.dumps(entry))
    (run / "manifest.json").write_text(json.dumps({"run_id": "run", "status": "completed"}))
    (run / "checkpoints" / "index.json").write_text(json.dumps(index))
    store = ArtifactStore(str(run), process_index=0)
    assert load_index(store) == {"checkpoints": [entry], "latest": 4, "best": 4}
    err = stderr_lines(capsys.readouterr().err)
    assert len(err) == 1, err
    assert err[0].startswith(f"warning: {run}/checkpoints/index.json is damaged ({why}"), err
    assert list(reconciled_entries(store)) == [4] and not capsys.readouterr().err
    if why.startswith("checkpoints[1]"):  # `runtime inspect` reads it the same way: run once
        res = run_cli("inspect", str(run), timeout=120)
        assert res.returncode == 0 and len(stderr_lines(res.stderr)) == 1, res.stderr
        assert "checkpoints  [4]  latest 4" in res.stdout, res.stdout
