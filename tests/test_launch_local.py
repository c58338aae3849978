"""`launch` on the local backend: 2 host processes on this machine, run, restarted and cancelled
exactly as a user does it (the CLI in a subprocess, the registry in a temporary XDG_STATE_HOME)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from jobspec.files.job_yaml import load_job
from jobspec.files.run_toml import merge
from jobspec.job_spec import check_mesh_fits
from launch import cli as launch_cli
from launch.backend import Handle
from launch.backends.local import LocalBackend
from launch.registry import Registry

from runs import read_jsonl, tiny_config, write_text_corpus

ROOT = Path(__file__).resolve().parents[1]


def launch(*args: str, state: Path, timeout: float = 300, extra_env: dict | None = None):
    env = {**os.environ, "XDG_STATE_HOME": str(state), **(extra_env or {})}
    return subprocess.run(
        [sys.executable, "-m", "launch.cli", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def write_job(tmp: Path, prepared: str, name: str, steps: int, **over) -> Path:
    base = {"mesh": {"data": 2}, "training": {"target_tokens": 16 * 8 * steps}}
    run = tiny_config(prepared, str(tmp / "runs"), run_id="ignored", **merge(base, over))
    job = {"name": name, "hosts": 2, "max_restarts": 2, "run": run}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def submit(job: Path, state: Path, *args: str) -> str:
    r = launch("submit", str(job), "--json", *args, state=state)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["run_id"]


def status(run_id: str, state: Path) -> dict:
    r = launch("status", run_id, "--json", state=state)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def supervisor_state(state: Path, run_id: str) -> dict | None:
    path = state / "jaxjob" / "runs" / run_id / "supervisor.json"
    return json.loads(path.read_text()) if path.exists() else None


def wait_for(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def events(run_uri: str) -> list[dict]:
    path = Path(run_uri) / "events.jsonl"
    return read_jsonl(path) if path.exists() else []


def kill_leftovers(state: Path) -> None:
    """A failed test must not leave a supervisor and its hosts training in the background."""
    for path in (state / "jaxjob" / "runs").glob("*/supervisor.json"):
        st = json.loads(path.read_text())
        if st["state"] not in ("succeeded", "failed", "cancelled"):
            try:
                os.killpg(st["pid"], signal.SIGKILL)  # the supervisor leads its hosts' group
            except ProcessLookupError:
                pass


@pytest.fixture
def state(tmp_path):
    s = tmp_path / "state"
    yield s
    kill_leftovers(s)


# The finished run's mixture: the session's corpus and a smaller one cut into fewer documents.
SOURCES = ("stdlib", "small")
# One decay horizon for the runs here, whatever their length: the schedule's constants are part
# of the compiled train step, so the runs then share its program (compiled once, then cached).
ONE_SCHEDULE = {"schedule": {"decay_steps": 100}}


@pytest.fixture(scope="module")
def finished(tmp_path_factory, prepared):
    """One 2-process run submitted with --wait, shared by the read-only tests below; it profiles
    steps 7..8, writes TensorBoard files, and trains on a mixture of two sources with an eval
    every 6 steps."""
    from runtime.data.prepare.build import prepare_dataset

    tmp = tmp_path_factory.mktemp("launch")
    state = tmp / "state"
    small = str(write_text_corpus(tmp / "small-corpus", docs=6) / "*.txt")
    prepare_dataset([small], "byte", str(tmp / "small"), val_fraction=0.3)
    sources = [
        {"manifest": prepared, "name": SOURCES[0], "weight": 0.6},
        {"manifest": str(tmp / "small/manifest.json"), "name": SOURCES[1], "weight": 0.4},
    ]
    job = write_job(tmp, prepared, "tiny", steps=12, training={"log_every": 3, "eval_every": 6},
                    profile={"start_step": 7, "steps": 2}, metrics={"tensorboard": True},
                    data={"sources": sources}, evals=[{"name": "val", "batches": 2}],
                    optimizer=ONE_SCHEDULE)  # fmt: skip
    spec = yaml.safe_load(job.read_text())
    del spec["run"]["data"]["manifest"]  # the sources instead
    job.write_text(yaml.safe_dump(spec))
    t0 = time.monotonic()
    try:
        r = launch("submit", str(job), "--wait", state=state)
    finally:  # a --wait that raises (a timeout) must not leave the run training either
        kill_leftovers(state)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run_id = Registry(state / "jaxjob").list()[0].run_id
    return {"state": state, "run_id": run_id, "out": r, "seconds": time.monotonic() - t0}


@pytest.mark.slow
def test_submit_wait_streams_the_quiet_view(finished):
    """Both hosts print every step; --wait shows host 0's lines (and others' warnings) once."""
    out = finished["out"]
    lines = out.stdout.splitlines()
    steps = [ln for ln in lines if "step: " in ln]
    assert steps and all(ln.startswith("[host 0] step: ") for ln in steps)
    assert sum(ln.startswith("[host 0] step: 12 ") for ln in lines) == 1
    assert "quiet view:" in out.stderr and "ordinary line(s) of host 1 " in out.stderr
    assert f"run {finished['run_id']} succeeded" in out.stderr


@pytest.mark.slow
def test_status_reports_succeeded_with_steps(finished):
    st = status(finished["run_id"], finished["state"])
    assert st["state"] == "succeeded"
    assert st["progress"]["step"] == 12 == st["progress"]["total_steps"]
    assert st["progress"]["last_event"]["event"] == "finish"
    assert st["backend_status"]["restarts"] == 0
    human = launch("status", finished["run_id"], state=finished["state"]).stdout
    assert "succeeded" in human and "step 12 / 12" in human


@pytest.mark.slow
def test_status_shows_latest_and_best_eval_with_each_source(finished):
    """`launch status` reads the evals from the run's artifacts; the 2-host mixture evals count
    both hosts' rows of each source."""
    from runtime.data.loader import eval_loader
    from runtime.data.manifest import load_manifest
    from runtime.data.mixture import Mixture

    st = status(finished["run_id"], finished["state"])
    rows = read_jsonl(Path(st["run_uri"]) / "metrics/eval.jsonl")
    assert [r["step"] for r in rows] == [6, 12]

    def brief(r: dict) -> dict:
        return {"step": r["step"], "name": "val", "loss": r["loss"],
                "loss_per_source": r["loss_per_source"]}  # fmt: skip

    assert st["progress"]["latest_eval"] == brief(rows[-1])
    assert st["progress"]["best_eval"] == brief(min(rows, key=lambda r: r["loss"]))

    cfg = json.loads((Path(st["run_uri"]) / "config/resolved.json").read_text())
    manifests = [load_manifest(s["manifest"]) for s in cfg["data"]["sources"]]
    mix = Mixture(list(SOURCES), manifests, [0.6, 0.4])
    loader = eval_loader(mix, "validation", 16, 8)
    drawn = [n for b in range(2) for n in loader.provenance(b)["sources"]]
    for r in rows:
        tokens, per = r["token_count_per_source"], r["loss_per_source"]
        assert tokens == {n: 16.0 * drawn.count(n) for n in SOURCES}  # every host's rows
        assert sum(tokens.values()) == r["token_count"] == 2 * 8 * 16
        mean = sum(per[n] * tokens[n] for n in SOURCES) / r["token_count"]
        assert mean == pytest.approx(r["loss"], rel=1e-6)

    human = launch("status", finished["run_id"], state=finished["state"]).stdout
    last, low = rows[-1], min(rows, key=lambda r: r["loss"])
    each = ", ".join(f"{n} {last['loss_per_source'][n]:.4f}" for n in SOURCES)
    assert f"latest eval val {last['loss']:.4f} at step 12 ({each})" in human
    assert f"best eval   val {low['loss']:.4f} at step {low['step']} (" in human


def test_status_eval_is_the_newest_row_and_the_lowest(tmp_path):
    """Latest is the newest eval row, best the lowest loss (the earliest of equal ones); a run
    with no eval rows has neither. Read from the files alone, as `launch status` does."""
    from runfolder.view import read_progress

    (tmp_path / "metrics").mkdir(parents=True)
    (tmp_path / "manifest.json").write_text(json.dumps({"status": "running", "total_steps": 9}))
    assert read_progress(str(tmp_path))["latest_eval"] is None
    assert read_progress(str(tmp_path))["best_eval"] is None
    rows = [{"step": 3, "name": "val", "loss": 3.0}, {"step": 6, "name": "val", "loss": 2.0},
            {"step": 6, "name": "code", "loss": 2.0}, {"step": 9, "name": "val", "loss": 2.5}]  # fmt: skip
    (tmp_path / "metrics/eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    p = read_progress(str(tmp_path))
    assert p["latest_eval"] == {"step": 9, "name": "val", "loss": 2.5}
    assert p["best_eval"] == {"step": 6, "name": "val", "loss": 2.0}


@pytest.mark.slow
def test_logs_prefix_every_line_with_its_host(finished):
    run_id, state = finished["run_id"], finished["state"]
    lines = launch("logs", run_id, "--all-hosts", state=state).stdout.splitlines()
    assert {ln.split("] ")[0] + "]" for ln in lines} == {"[host 0]", "[host 1]"}
    only1 = launch("logs", run_id, "--host", "1", state=state).stdout.splitlines()
    assert only1 and all(ln.startswith("[host 1] ") for ln in only1)
    tail = launch("logs", run_id, "--tail", "2", "--all-hosts", state=state).stdout.splitlines()
    assert sorted(ln[:8] for ln in tail) == ["[host 0]"] * 2 + ["[host 1]"] * 2
    # Each host's last two lines: the last step, then the final eval.
    assert tail[-2].startswith("[host 1] step: 12 ")
    assert tail[-1].startswith("[host 1] eval val @ step 12 | loss: ")
    # --follow of a finished run prints everything and returns.
    follow = launch("logs", run_id, "--follow", "--all-hosts", state=state, timeout=30)
    assert follow.stdout.splitlines() == lines
    # A host the run does not have: one sentence, not an empty answer.
    none = launch("logs", run_id, "--host", "5", state=state)
    assert none.returncode == 2 and none.stdout == ""
    assert none.stderr.splitlines() == [f"error: --host 5: run {run_id} has hosts 0-1"]


def test_logs_attempt_reads_the_run_folders_host_logs(finished):
    """--attempt 0 of the one-attempt run: both hosts' lines from the run folder; an attempt
    the run never had is one sentence; --since/--timestamps show the same lines with the times
    the hosts' tees recorded, and --follow of the ended run the same."""
    run_id, state = finished["run_id"], finished["state"]
    r = launch("logs", run_id, "--attempt", "0", "--tail", "2", "--all-hosts", state=state)
    assert r.returncode == 0, r.stderr
    tail = r.stdout.splitlines()
    assert sorted(ln[:8] for ln in tail) == ["[host 0]"] * 2 + ["[host 1]"] * 2
    assert tail[-1].startswith("[host 1] eval val @ step 12 | loss: ")
    none = launch("logs", run_id, "--attempt", "3", state=state)
    assert none.returncode == 2 and none.stderr.splitlines() == [
        f"error: --attempt 3: run {run_id} has no such attempt; it has attempts 0"
    ]
    timed = ("--tail", "2", "--all-hosts", "--since", "1h", "--timestamps")
    since = launch("logs", run_id, "--attempt", "0", *timed, state=state)
    assert since.returncode == 0, since.stderr
    assert [ln.split(" ", 1)[1] for ln in since.stdout.splitlines()] == tail
    assert all(ln[:4].isdigit() and ln[23:25] == "Z " for ln in since.stdout.splitlines())
    followed = launch("logs", run_id, "--follow", *timed, state=state, timeout=60)
    assert followed.returncode == 0 and followed.stdout == since.stdout, followed.stderr


GLOG_0 = "W1206 01:02:03.123456    1234 preemption_notifier.cc:90] SIGTERM caught"
GLOG_1 = "W1206 01:02:03.987654    4321 preemption_notifier.cc:90] SIGTERM caught"


@pytest.mark.slow
def test_logs_quiet_view_shows_host0_once_and_host1_warnings(finished):
    """Host 1 warns alone, and both hosts print the same glog warning (their own time and
    thread): the default view shows host 0's lines once, host 1's warning, and the shared one
    once with its host count. The lines are appended to the real host logs, then taken out."""
    from launch.backends.local.status import _attempt_dirs, _host_files

    run_id, state = finished["run_id"], finished["state"]
    rec = Registry(state / "jaxjob").lookup(run_id)
    _, attempt = _attempt_dirs(Path(rec.handle["run_dir"]) / "logs")[-1]
    files = dict(_host_files(attempt, None))
    before = {i: f.read_bytes() for i, f in files.items()}
    everything = launch("logs", run_id, "--all-hosts", state=state).stdout.splitlines()
    host0_steps = [ln for ln in everything if ln.startswith("[host 0] step: ")]
    try:
        with open(files[0], "a") as f:
            f.write(f"{GLOG_0}\n")
        with open(files[1], "a") as f:
            f.write(f"WARNING: host 1 only\n{GLOG_1}\n")
        for args in ((), ("--follow",)):
            res = launch("logs", run_id, *args, state=state, timeout=60)
            assert res.returncode == 0, res.stderr
            quiet = res.stdout.splitlines()
            assert [ln for ln in quiet if "step: " in ln] == host0_steps, args  # once, in order
            assert quiet.count("[host 1] WARNING: host 1 only") == 1, args
            assert [ln for ln in quiet if "SIGTERM caught" in ln] == [f"[2 hosts: 0,1] {GLOG_0}"]
            assert "ordinary line(s) of host 1 " in res.stderr
    finally:
        for i, data in before.items():
            files[i].write_bytes(data)


@pytest.mark.slow
def test_every_host_profiles_and_only_the_writer_has_sinks(finished):
    run_uri = status(finished["run_id"], finished["state"])["run_uri"]
    for host in (0, 1):
        assert list(Path(run_uri).glob(f"profile/host-{host}/plugins/profile/*/*.xplane.pb"))
    assert len(list(Path(run_uri).glob("tensorboard/events.out.tfevents.*"))) == 1
    rows = read_jsonl(Path(run_uri) / "metrics/train.jsonl")
    assert all("tokens_per_s" not in r for r in rows if r["step"] in (7, 8))


@pytest.mark.slow
def test_list_json_lists_the_run(finished):
    rows = json.loads(launch("list", "--json", state=finished["state"]).stdout)
    assert [(r["run_id"], r["backend"], r["state"]) for r in rows] == [
        (finished["run_id"], "local", "succeeded")
    ]


def ended(state: Path, run_id: str) -> bool:
    """The supervisor has recorded the run's end (a file read: polling `launch status`, a
    process each time, would cost more CPU than the run)."""
    st = supervisor_state(state, run_id)
    return st is not None and st["state"] in ("succeeded", "failed", "cancelled")


@pytest.mark.slow
def test_killed_host_restarts_group_and_resumes(tmp_path, prepared, state):
    # The first commit is at step 20; the kill comes a poll after it, with 60 steps (seconds on
    # a loaded machine) still to go before the run could end without it.
    every = 20
    job = write_job(
        tmp_path, prepared, "kill", steps=80,
        training={"log_every": 10}, checkpoint={"every": every, "keep": 2},
        runtime={"host_loss_timeout_s": 5}, optimizer=ONE_SCHEDULE,
    )  # fmt: skip
    run_id = submit(job, state)
    run_uri = status(run_id, state)["run_uri"]
    # The `checkpoint` event is written when an async save starts; the index lists commits.
    index = Path(run_uri) / "checkpoints" / "index.json"
    wait_for(
        lambda: index.exists() and json.loads(index.read_text()).get("latest"), 120, "a commit"
    )
    st = supervisor_state(state, run_id)
    assert st["attempt"] == 0 and st["state"] == "running", st
    os.kill(st["hosts"][1]["pid"], signal.SIGKILL)

    wait_for(lambda: ended(state, run_id), 240, "the restarted run to end")
    final = status(run_id, state)
    assert final["state"] == "succeeded", final
    assert final["backend_status"]["restarts"] == 1
    assert final["progress"]["step"] == 80
    kinds = [e["event"] for e in events(run_uri)]
    assert kinds.count("resume") == 1 and kinds[-1] == "finish", kinds
    resumed = next(e for e in events(run_uri) if e["event"] == "resume")
    assert resumed["step"] >= every  # from the checkpoint, not from scratch
    logs = state / "jaxjob" / "runs" / run_id / "logs"
    second = (logs / "attempt-1" / "host-0.log").read_text()
    assert "JAXJOB_ATTEMPT=1" in second and "attempt 1," in second  # ours, then the runtime's
    sup = supervisor_state(state, run_id)
    assert sup["attempts"][0]["returncodes"][1] == -signal.SIGKILL
    # Goodput over both attempts: the crash's unrecorded end and the restart are lost time.
    g = json.loads((Path(run_uri) / "summaries/final.json").read_text())["goodput"]
    assert len(g["attempts"]) == 2 and g["seconds"]["lost"] > 0
    assert sum(g["seconds"].values()) == pytest.approx(g["wall_s"])
    assert g["attempts"][1]["first_step"] == resumed["step"] + 1


@pytest.mark.slow
def test_cancel_checkpoints_and_ends_cancelled(tmp_path, prepared, state):
    job = write_job(
        tmp_path, prepared, "stop", steps=2000, training={"log_every": 50}, optimizer=ONE_SCHEDULE
    )
    run_id = submit(job, state)
    run_uri = status(run_id, state)["run_uri"]
    wait_for(lambda: any(e["event"] == "first_step" for e in events(run_uri)), 120, "step 1")
    r = launch("cancel", run_id, "--wait", state=state, timeout=180)
    assert r.returncode == 0, r.stderr
    st = status(run_id, state)
    assert st["state"] == "cancelled", st
    assert [h["returncode"] for h in st["backend_status"]["hosts"]] == [42, 42]
    assert events(run_uri)[-1]["event"] == "interrupted"
    assert st["progress"]["status"] == "interrupted"
    again = launch("cancel", run_id, state=state)
    assert again.returncode == 0 and "already ended (cancelled)" in again.stdout


# ---- the supervisor's restart policy, with stand-in hosts (no jax: fast) -----------------------


def fake_run(tmp: Path, script: str, hosts: int = 2, max_restarts: int = 2) -> Path:
    """A run dir whose plan starts `python -c script` as each host."""
    run_dir = tmp / "run"
    run_dir.mkdir()
    cmd = [sys.executable, "-c", textwrap.dedent(script)]
    plan = {
        "run_id": "fake", "cwd": str(tmp), "max_restarts": max_restarts,
        "grace_s": {"cancel": 5, "failure": 2},
        "hosts": [{"index": i, "command": cmd, "env": {"JAXJOB_PROCESS_ID": str(i)},
                   "env_from_shell": []} for i in range(hosts)],
    }  # fmt: skip
    (run_dir / "plan.json").write_text(json.dumps(plan))
    return run_dir


def supervise(run_dir: Path) -> tuple[int, dict]:
    rc = subprocess.run(
        [sys.executable, "-m", "launch.backends.local", "supervise", str(run_dir)],
        cwd=ROOT,
        timeout=60,
    ).returncode
    return rc, json.loads((run_dir / "supervisor.json").read_text())


FLAKY = """
    import os, sys, time
    attempt, me = int(os.environ["JAXJOB_ATTEMPT"]), int(os.environ["JAXJOB_PROCESS_ID"])
    print("attempt", attempt, "host", me, flush=True)
    if attempt == 0 and me == 1:
        sys.exit(43)
    time.sleep(0.3)
"""


def test_supervisor_restarts_on_restartable_exit(tmp_path):
    rc, st = supervise(fake_run(tmp_path, FLAKY))
    assert rc == 0 and st["state"] == "succeeded" and st["restarts"] == 1
    assert [a["outcome"] for a in st["attempts"]] == ["restart", "succeeded"]
    assert st["attempts"][0]["returncodes"][1] == 43
    log = (tmp_path / "run/logs/attempt-1/host-1.log").read_text()
    assert "JAXJOB_ATTEMPT=1" in log and "attempt 1 host 1" in log


def test_supervisor_fails_on_user_error_without_restart(tmp_path):
    rc, st = supervise(fake_run(tmp_path, "import sys, time; time.sleep(0.2); sys.exit(2)"))
    assert rc == 1 and st["state"] == "failed" and st["restarts"] == 0
    assert "exit 2 (not restartable)" in st["detail"]


def test_supervisor_gives_up_after_max_restarts(tmp_path):
    rc, st = supervise(fake_run(tmp_path, "import sys; sys.exit(44)", max_restarts=2))
    assert rc == 1 and st["state"] == "failed" and len(st["attempts"]) == 3
    assert "all 2 restarts are used up" in st["detail"]


def test_supervisor_stops_survivors_with_sigterm_then_sigkill(tmp_path):
    # Host 0 dies by a signal once host 1 ignores SIGTERM (a file in their cwd says so; else
    # the supervisor's SIGTERM could come first, on a loaded machine); host 1 must be killed
    # after the grace.
    script = """
        import os, signal, time
        if os.environ["JAXJOB_PROCESS_ID"] == "0":
            while not os.path.exists("host-1-ignores-sigterm"):
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        open("host-1-ignores-sigterm", "w").close()
        time.sleep(60)
    """
    t0 = time.monotonic()
    rc, st = supervise(fake_run(tmp_path, script, max_restarts=0))
    assert time.monotonic() - t0 < 30
    assert st["state"] == "failed" and st["attempts"][0]["returncodes"] == [-9, -9]


# ---- render, validation and the CLI's own promises ---------------------------------------------


def test_render_smoke_yaml_for_local(tmp_path, state):
    out = tmp_path / "out"
    r = launch("render", "configs/smoke.yaml", "--backend", "local", "-o", str(out), state=state)
    assert r.returncode == 0, r.stderr
    assert sorted(Path(p).name for p in r.stdout.split()) == ["cfg.toml", "hosts.json", "job.yaml"]
    plan = json.loads((out / "hosts.json").read_text())
    assert [h["env"]["JAXJOB_PROCESS_ID"] for h in plan["hosts"]] == ["0", "1"]
    env = plan["hosts"][0]["env"]
    assert env["JAXJOB_NUM_PROCESSES"] == "2" and env["JAX_PLATFORMS"] == "cpu"
    assert env["JAXJOB_RUN_ID"].startswith("smoke-")
    assert env["XLA_FLAGS"].endswith("--xla_force_host_platform_device_count=1")
    assert plan["hosts"][0]["command"][-2:] == [
        "worker",
        str(state / "jaxjob" / "runs" / env["JAXJOB_RUN_ID"] / "cfg.toml"),
    ]
    assert f'id = "{env["JAXJOB_RUN_ID"]}"' in (out / "cfg.toml").read_text()
    printed = launch("render", "configs/smoke.yaml", state=state).stdout
    assert "# ==> hosts.json <==" in printed and "# ==> cfg.toml <==" in printed
    assert not (state / "jaxjob" / "runs").exists()  # render submits nothing


def test_smoke_yaml_validates():
    job = load_job(ROOT / "configs/smoke.yaml")
    assert job.spec.host_processes("local") == 2 and job.run.mesh.data == 2
    for backend in ("local", "slurm", "k8s"):
        check_mesh_fits(job.spec, job.run, backend)


def test_secret_reference_comes_from_the_shell(tmp_path, state):
    job = tmp_path / "job.yaml"
    job.write_text(
        "name: sec\nhosts: 2\nrun: {path}\nenv:\n  HF_TOKEN: {{secret: hf, key: token}}\n".format(
            path=ROOT / "configs/smoke_multihost.toml"
        )
    )
    r = launch("render", str(job), state=state, extra_env={"HF_TOKEN": "s3cret"})
    assert r.returncode == 0, r.stderr
    assert '"env_from_shell": [\n        "HF_TOKEN"' in r.stdout and "s3cret" not in r.stdout


def test_launch_never_imports_jax():
    code = "import launch.cli, launch.backends.local, launch.backends.slurm, runfolder.view, sys; assert 'jax' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


@pytest.mark.parametrize(
    "cmd", ["", "submit", "render", "status", "logs", "cancel", "list", "schema"]
)
def test_every_command_has_help(cmd, state):
    r = launch(*cmd.split(), "--help", state=state)
    assert r.returncode == 0 and "Usage: launch" in r.stdout


def test_schema_is_the_job_spec_schema(state):
    schema = json.loads(launch("schema", state=state).stdout)
    assert {"name", "run", "accelerator", "hosts", "env"} <= set(schema["properties"])


def test_missing_backend_module_is_one_clear_sentence(monkeypatch):
    monkeypatch.setitem(launch_cli.BACKENDS, "slurm", ("launch.no_such_module", "X", None))
    with pytest.raises(launch_cli.JaxjobError, match="the slurm backend is not available"):
        launch_cli.get_backend("slurm")
    monkeypatch.setitem(launch_cli.BACKENDS, "k8s", ("json", "NoSuchClass", "k8s"))
    with pytest.raises(launch_cli.JaxjobError, match="json has no NoSuchClass"):
        launch_cli.get_backend("k8s", {"context": None, "namespace": None})


def test_status_of_a_vanished_supervisor_is_failed(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (run_dir / "supervisor.json").write_text(json.dumps({
        "state": "running", "detail": "", "pid": dead.pid, "attempt": 0, "restarts": 0,
        "max_restarts": 1, "hosts": [],
    }))  # fmt: skip
    st = LocalBackend(Registry(tmp_path)).status(Handle("local", {"run_dir": str(run_dir)}))
    assert st["state"] == "failed" and "is gone" in st["detail"]


def test_status_of_a_resubmission_never_reads_the_earlier_submissions_state(tmp_path):
    """A fixed run_id resubmitted: supervisor.json is still the earlier submission's (it ended
    `succeeded`) until this submission's is written. Its status is this submission's (here its
    supervisor died before writing anything), and a cancel reaches it."""
    from launch.backends.local.submit import cancel

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (run_dir / "supervisor.json").write_text(json.dumps({
        "state": "succeeded", "detail": "all 1 hosts exited 0", "pid": dead.pid, "attempt": 0,
        "restarts": 0, "max_restarts": 0, "hosts": [], "submission_id": "local-earlier",
    }))  # fmt: skip
    handle = Handle("local", {"run_dir": str(run_dir), "pid": dead.pid,
                              "submission_id": "local-this"})  # fmt: skip
    st = LocalBackend(Registry(tmp_path)).status(handle)
    assert st["state"] == "failed", st
    assert "exited before starting the hosts" in st["detail"]
    cancel(handle)
    assert (run_dir / "cancel-requested").exists()  # the earlier end does not swallow it
    # A handle from before submission ids takes the file as it is.
    old = Handle("local", {"run_dir": str(run_dir), "pid": dead.pid})
    assert LocalBackend(Registry(tmp_path)).status(old)["state"] == "succeeded"


def test_progress_from_an_earlier_submission_is_not_this_ones(tmp_path):
    """A manifest last written before the submission followed is an earlier submission's: its
    `completed` is no progress of this one (only a note saying whose it is)."""
    from runfolder.view import read_progress

    (tmp_path / "manifest.json").write_text(json.dumps({
        "status": "completed", "steps": 300, "total_steps": 300,
        "updated": "2026-01-01T00:00:00.000+00:00",
    }))  # fmt: skip
    p = read_progress(str(tmp_path), since="2026-01-01T00:00:05.000000+00:00")
    assert p["status"] is None and p["step"] == 0, p
    assert p["note"] == (
        "no progress from this submission yet (manifest.json is an earlier submission's, "
        "written 2026-01-01 00:00:00 UTC: completed at step 300 / 300)"
    )
    same = read_progress(str(tmp_path), since="2025-12-31T23:59:59.000000+00:00")
    assert same["status"] == "completed" and same["step"] == 300


@pytest.mark.parametrize(
    "content, why",
    [("", "it is not valid JSON (Expecting value: line 1 column 1 (char 0))"),
     ('{"status": "runn', "it is not valid JSON (Unterminated string starting at: line 1 "
      "column 12 (char 11))"),
     ("[1, 2]", "it holds a JSON list, not an object")],
)  # fmt: skip
def test_an_unreadable_manifest_is_named_with_what_is_wrong(tmp_path, content, why):
    """`launch status` of a run whose manifest.json is torn or not an object: the progress line
    names the file and says what is wrong with it, in one sentence."""
    from runfolder.view import read_progress

    (tmp_path / "manifest.json").write_text(content)
    assert read_progress(str(tmp_path)) == {
        "error": f"cannot read {tmp_path / 'manifest.json'}: {why}"
    }
