"""`launch submit/render/plan --set KEY=VALUE --env NAME=VALUE` (one setting changed at submit
time), through the CLI as a user runs it: the rendered cfg.toml and host env of each backend,
the record `launch status` shows, refusals of bad syntax and of a resubmit resume would refuse."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
import yaml
from test_launch_local import ROOT, kill_leftovers, launch

from jobspec.errors import ConfigError
from jobspec.files.overrides import parse_envs, parse_sets
from launch.registry import Registry, RunRecord

from runs import tiny_config

SMOKE_RUN = str(ROOT / "configs/smoke_multihost.toml")


def job_file(tmp: Path, **extra) -> Path:
    job = {"name": "ov", "hosts": 2, "run": SMOKE_RUN, "image": "jaxjob:test", **extra}
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def render(job: Path, backend: str, out: Path, state: Path, *args: str) -> dict[str, str]:
    r = launch("render", str(job), "--backend", backend, "-o", str(out), *args, state=state)
    assert r.returncode == 0, r.stderr
    return {p.name: p.read_text() for p in out.iterdir()}


SETS = ("--set", "training.target_tokens=4096", "--set", "optimizer.lr=1e-3")
ENVS = ("--env", "FOO=bar", "--env", "XLA_PYTHON_CLIENT_MEM_FRACTION=0.5")


def test_local_render_has_the_sets_in_cfg_and_the_envs_in_each_host(tmp_path):
    files = render(job_file(tmp_path), "local", tmp_path / "out", tmp_path / "s", *SETS, *ENVS)
    cfg = tomllib.loads(files["cfg.toml"])
    assert cfg["training"]["target_tokens"] == 4096 and cfg["optimizer"]["lr"] == 1e-3
    # The cfg.toml the hosts read says what was overridden.
    assert files["cfg.toml"].startswith(
        "# overridden at submit (launch --set):\n"
        "#   training.target_tokens = 4096\n#   optimizer.lr = 0.001\n"
    )
    for host in json.loads(files["hosts.json"])["hosts"]:
        assert host["env"]["FOO"] == "bar"
        assert host["env"]["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.5"
    assert yaml.safe_load(files["job.yaml"])["env"]["FOO"] == "bar"


def test_slurm_and_k8s_render_the_overrides(tmp_path):
    job = job_file(tmp_path, env={"KEEP": "1", "FOO": "old"}, output_uri="/shared/runs")
    sbatch = render(job, "slurm", tmp_path / "slurm", tmp_path / "s", *SETS, *ENVS)
    assert "export FOO=bar" in sbatch["job.sbatch"] and "export KEEP=1" in sbatch["job.sbatch"]
    assert tomllib.loads(sbatch["cfg.toml"])["training"]["target_tokens"] == 4096
    k8s = render(job, "k8s", tmp_path / "k8s", tmp_path / "s", *SETS, *ENVS)
    docs = [d for text in k8s.values() for d in yaml.safe_load_all(text) if isinstance(d, dict)]
    envs = [
        c["env"]
        for d in docs
        for rj in d.get("spec", {}).get("replicatedJobs", [])
        for c in rj["template"]["spec"]["template"]["spec"]["containers"]
    ]
    assert envs, k8s.keys()
    for env in envs:
        values = {e["name"]: e.get("value") for e in env}
        assert values["FOO"] == "bar" and values["KEEP"] == "1"
    cfgs = [d["data"]["cfg.toml"] for d in docs if d.get("kind") == "ConfigMap"]
    assert cfgs and all("target_tokens = 4096" in c for c in cfgs)


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("--set", "training"), "--set 'training': use --set section.key=value"),
        (("--set", "=3"), "--set '=3': use --set section.key=value"),
        (("--set", "a..b=1"), "--set 'a..b=1': use --set section.key=value"),
        (("--set", "a=1", "--set", "a.b=2"), "--set 'a.b=2': another --set gives a a value"),
        (("--env", "FOO"), "--env 'FOO': use --env NAME=value"),
        (("--env", "1X=2"), "--env '1X=2': '1X' is not an environment variable name"),
        (("--env", "JAXJOB_RUN_ID=x"), "--env 'JAXJOB_RUN_ID=x': JAXJOB_RUN_ID is set by jaxjob"),
        (("--set", "run.id=x"), "--set run.id: the run id comes from the job spec"),
    ],
)
def test_bad_syntax_is_one_sentence_naming_the_option(tmp_path, args, said):
    for cmd in ("render", "submit"):
        r = launch(cmd, str(job_file(tmp_path)), *args, state=tmp_path / "s")
        assert r.returncode == 2, r.stderr
        assert r.stderr.startswith(f"error: {said}") and r.stderr.count("\n") == 1, r.stderr
        assert "Traceback" not in r.stderr
    assert not (tmp_path / "s" / "jaxjob" / "runs").exists()  # nothing was submitted


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("--set", "training.seq_len=banana"), "with --set: training.seq_len: Input should be"),
        (("--set", "training.nope=1"), "with --set: training.nope: unknown key"),
        (("--env", "HF_TOKEN=abc"), "with --env: env: HF_TOKEN looks like a secret"),
    ],
)
def test_an_override_that_fails_validation_names_the_field(tmp_path, args, said):
    r = launch("render", str(job_file(tmp_path)), *args, state=tmp_path / "s")
    assert r.returncode == 2 and said in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_the_parser_is_shared_with_runtime_set():
    from runtime.commands.common import overrides

    pairs = ("training.target_tokens=2e6", "data.order=sequential", "model.num_layers=4")
    assert (
        overrides(pairs)
        == parse_sets(pairs)
        == {
            "training": {"target_tokens": 2e6},
            "data": {"order": "sequential"},
            "model": {"num_layers": 4},
        }
    )
    assert parse_envs(("A=1", "B=x=y", "A=2")) == {"A": "2", "B": "x=y"}
    with pytest.raises(ConfigError, match="--set 'x': use --set section.key=value"):
        overrides(("x",))


def fake_previous(state: Path, run_id: str, cfg_toml: str) -> None:
    """A finished earlier submission of `run_id` in the registry, as submit leaves it."""
    registry = Registry(state / "jaxjob")
    run_dir = registry.run_dir(run_id)
    run_dir.mkdir(parents=True)
    (run_dir / "cfg.toml").write_text(cfg_toml)
    (run_dir / "supervisor.json").write_text(
        json.dumps({"state": "succeeded", "detail": "all 2 hosts exited 0", "pid": 0,
                    "attempt": 0, "restarts": 0, "max_restarts": 1, "hosts": []})
    )  # fmt: skip
    registry.record(
        RunRecord(run_id=run_id, backend="local", handle={"run_dir": str(run_dir)},
                  output_uri=str(state / "runs"), submitted="2026-01-01T00:00:00+00:00",
                  job_path="job.yaml",
                  overrides={"set": {"training.seq_len": "64"}, "env": {"FOO": "bar"}})
    )  # fmt: skip


def test_status_shows_the_overrides(tmp_path):
    state = tmp_path / "s"
    fake_previous(state, "ov-fixed", "")
    st = json.loads(launch("status", "ov-fixed", "--json", state=state).stdout)
    assert st["overrides"] == {"set": {"training.seq_len": "64"}, "env": {"FOO": "bar"}}
    text = launch("status", "ov-fixed", state=state).stdout
    assert "overrides   --set training.seq_len=64 --env FOO=bar\n" in text, text


def test_a_resubmit_whose_set_resume_refuses_is_refused_before_it_starts(tmp_path):
    state = tmp_path / "s"
    job = job_file(tmp_path, run_id="ov-fixed")
    cfg = launch("render", str(job), "--backend", "local", state=state).stdout
    cfg = cfg.split("# ==> cfg.toml <==\n")[1].split("# ==> ")[0]
    fake_previous(state, "ov-fixed", cfg)
    before = (state / "jaxjob/runs/ov-fixed/record.json").read_text()
    r = launch("submit", str(job), "--set", "model.num_layers=3", state=state)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "model.num_layers = 4" in r.stderr, r.stderr
    assert "use a new run.id" in r.stderr, r.stderr
    # Nothing was started or recorded.
    assert (state / "jaxjob/runs/ov-fixed/record.json").read_text() == before
    assert not (state / "jaxjob/runs/ov-fixed/logs").exists()


def test_the_resubmit_check_allows_what_resume_allows(tmp_path, monkeypatch):
    """In-process: a --set of a key resume may change (target_tokens) passes the check; a
    fresh run id (no run_id in the job) is never checked."""
    from launch.cli import prepare_submission
    from launch.overrides import refuse_incompatible_resubmit

    state = tmp_path / "s"
    monkeypatch.setenv("XDG_STATE_HOME", str(state))
    job = job_file(tmp_path, run_id="ov-fixed")
    registry = Registry(state / "jaxjob")
    fake_previous(state, "ov-fixed", prepare_submission(str(job), "local", registry).run_toml)
    for sets in (("training.target_tokens=9999",), ("training.log_every=7",)):
        sub = prepare_submission(str(job), "local", registry, sets)
        refuse_incompatible_resubmit(registry, sub, sets)
    sets = ("optimizer.lr=1e-2",)
    sub = prepare_submission(str(job), "local", registry, sets)
    with pytest.raises(ConfigError, match="optimizer.lr = 0.003.*use a new run.id"):
        refuse_incompatible_resubmit(registry, sub, sets)


@pytest.mark.slow
def test_submit_with_overrides_trains_them_and_status_says_so(tmp_path, prepared):
    """End to end on the local backend: the run trains with the --set (2 steps instead of 40),
    its hosts get the --env, and status shows both."""
    state = tmp_path / "state"
    run = tiny_config(prepared, str(tmp_path / "runs"), run_id="ignored")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"name": "ovr", "hosts": 1, "max_restarts": 0, "run": run}))
    try:
        r = launch("submit", str(job), "--wait", "--set", "training.target_tokens=256",
                   "--env", "JAXJOB_TEST_IGNORED_X=1", state=state)  # fmt: skip
    finally:
        kill_leftovers(state)
    assert r.returncode == 2  # a reserved name: nothing submitted
    try:
        r = launch("submit", str(job), "--wait", "--set", "training.target_tokens=256",
                   "--env", "OV_MARK=on", state=state)  # fmt: skip
    finally:
        kill_leftovers(state)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "step 2 of 2" in r.stderr, r.stderr[-2000:]
    run_id = Registry(state / "jaxjob").list()[0].run_id
    st = json.loads(launch("status", run_id, "--json", state=state).stdout)
    assert st["overrides"] == {"set": {"training.target_tokens": "256"}, "env": {"OV_MARK": "on"}}
    assert (
        "overrides   --set training.target_tokens=256 --env OV_MARK=on"
        in launch("status", run_id, state=state).stdout
    )
    # What the hosts read (and the run folder recorded) says what it really ran.
    cfg = (state / "jaxjob/runs" / run_id / "cfg.toml").read_text()
    assert cfg.startswith(
        "# overridden at submit (launch --set):\n#   training.target_tokens = 256"
    )
