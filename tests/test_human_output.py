"""The human-readable form (no `--json`) of every `launch` and `runtime` command, per backend.

The `--json` forms are what the other suites read; here each command runs as a user types it
and its key lines are checked: a KeyError in a print (as `launch status` of every SLURM job
had) fails here. Backends: local for real (one short 2-host run, whose artifacts the `runtime`
commands then read), k8s through the fake API server of test_k8s_client.py, SLURM against the
real dev cluster with a job that can never start (it costs the cluster nothing); the SLURM
suite's own job checks the plain status of a finished SLURM run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from test_launch_local import ONE_SCHEDULE  # the train step the suite's 2-host runs share

from runs import ROOT, run_cli, stderr_lines, tiny_config

TERMINAL = ("succeeded", "failed", "cancelled")


def launch(state: Path, *args: str, env: dict | None = None, timeout: float = 120):
    full = {**os.environ, "XDG_STATE_HOME": str(state), "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-m", "launch.cli", *args], cwd=ROOT, env=full,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


def ok(res: subprocess.CompletedProcess) -> str:
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    return res.stdout


def fields(text: str) -> dict[str, str]:
    """`launch status`'s aligned `key   value` lines as a dict."""
    return {ln[:12].strip(): ln[12:] for ln in text.splitlines() if ln[:12].strip()}


# ---- local backend, for real; the runtime commands read its artifacts -------------------------


@pytest.fixture(scope="module")
def local_run(tmp_path_factory, prepared) -> Iterator[dict]:
    """A 4-step 2-host run submitted with plain `launch submit`, then waited for."""
    tmp = tmp_path_factory.mktemp("human")
    state = tmp / "state"
    run = tiny_config(prepared, str(tmp / "runs"), "ignored", mesh={"data": 2},
                      training={"target_tokens": 16 * 8 * 4, "log_every": 1},
                      evals=[{"name": "val", "split": "validation", "batches": 1}],
                      optimizer=ONE_SCHEDULE)  # fmt: skip
    job = tmp / "human.yaml"
    job.write_text(yaml.safe_dump({"name": "human", "hosts": 2, "max_restarts": 1, "run": run}))
    sub = ok(launch(state, "submit", str(job)))
    run_id = sub.split()[1]
    # Waited for on the supervisor's own file (polling `launch status` would start a process a
    # second for the whole run); `launch status` then says how it ended.
    sup_file = state / "jaxjob" / "runs" / run_id / "supervisor.json"
    try:
        deadline = time.monotonic() + 240
        while not (sup_file.exists() and json.loads(sup_file.read_text())["state"] in TERMINAL):
            assert time.monotonic() < deadline, f"{run_id} did not end in 240 s"
            time.sleep(0.2)
        st = json.loads(ok(launch(state, "status", run_id, "--json")))
    finally:
        for path in (state / "jaxjob" / "runs").glob("*/supervisor.json"):
            sup = json.loads(path.read_text())
            if sup["state"] not in TERMINAL:
                os.killpg(sup["pid"], 9)
    assert st["state"] == "succeeded", st
    yield {"state": state, "run_id": run_id, "submit": sub, "run_uri": st["run_uri"], "job": job}


@pytest.mark.slow
def test_local_launch_commands_plain(local_run):
    state, run_id = local_run["state"], local_run["run_id"]
    sub = local_run["submit"].splitlines()
    assert sub[0] == f"submitted {run_id} to the local backend (artifacts: {local_run['run_uri']})"
    assert sub[1:] == [f"  follow:  launch logs {run_id} --follow",
                       f"  status:  launch status {run_id}", f"  cancel:  launch cancel {run_id}"]  # fmt: skip
    st = fields(ok(launch(state, "status", run_id)))
    assert st["run"] == f"{run_id}  (local)"
    assert st["state"].startswith("succeeded")
    assert st["attempt"] == "0  (0 of 1 restarts)"
    assert st["progress"].startswith("step 4 / 4, loss ")
    assert st["last event"].startswith("finish at ")
    assert "% of " in st["goodput"] and "trained (1 attempt)" in st["goodput"]
    assert "eta" not in st  # only while running
    assert st["artifacts"] == local_run["run_uri"]
    logs = ok(launch(state, "logs", run_id, "--tail", "1", "--all-hosts")).splitlines()
    assert len(logs) == 2 and logs[0].startswith("[host 0] ") and logs[1].startswith("[host 1] ")
    quiet = ok(launch(state, "logs", run_id, "--tail", "1")).splitlines()
    assert quiet == logs[:1]  # the default view: host 0's lines
    listed = ok(launch(state, "list")).splitlines()  # a header, then the run with its state
    assert len(listed) == 2 and listed[1].split()[:3] == [run_id, "local", "succeeded"]
    assert listed[1].split()[-1] == "here"
    again = ok(launch(state, "cancel", run_id))
    assert again.strip() == f"{run_id} has already ended (succeeded); nothing to cancel"


@pytest.mark.slow
def test_runtime_commands_plain_on_the_runs_artifacts(local_run, prepared, tmp_path):
    run_uri = local_run["run_uri"]
    ins = ok(run_cli("inspect", run_uri)).splitlines()
    assert ins[0].startswith(f"run          {local_run['run_id']}  (")
    assert ins[1] == "status       completed"
    assert ins[2].startswith("steps        4 / 4   tokens 512")
    assert any(ln.startswith("best eval    val ") for ln in ins)
    assert any(ln.startswith("checkpoints  [4]  latest 4") for ln in ins)
    ev = ok(run_cli("eval", "checkpoint", run_uri, "--checkpoint", "latest")).splitlines()
    assert ev[0].startswith("step 4 | val | loss: ")
    assert ev[0].endswith("| tokens: 128")  # 1 batch of 8 rows x 16 tokens
    assert ev[-1] == f"wrote {run_uri}/evals/step-4.json"
    sample = ok(run_cli("sample", "checkpoint", run_uri, "--prompt-ids", "72,101",
                        "--max-new-tokens", "3", "--top-k", "1")).splitlines()  # fmt: skip
    assert len(sample[0].split(",")) == 3 and all(t.isdigit() for t in sample[0].split(","))
    assert sample[-1].startswith(f"wrote {run_uri}/samples/step-4-")
    out = tmp_path / "hf"
    exported = ok(run_cli("export", "hf", run_uri, "--checkpoint", "latest", "--out", str(out)))
    assert exported.strip() == f"exported step 4 of {local_run['run_id']} to {out}"
    cfg = Path(run_uri) / "config" / "source.toml"
    check = ok(run_cli("config", "check", str(cfg))).splitlines()
    assert check[0] == f"{cfg}: valid"
    keyed = {ln[:19].strip(): ln[19:] for ln in check[1:]}
    assert keyed["run dir"].endswith(f"/runs/{local_run['run_id']}")
    assert keyed["parameters"].startswith("26,944 (")
    assert keyed["tokens/step"].startswith("128 = 8 x 1 x 16")
    assert keyed["steps"] == "4 to reach 512 tokens"
    assert keyed["mesh"].endswith("data=2 expert=1 fsdp=1 context=1 tensor=1 (2 devices)")
    data = ok(run_cli("data", "check", prepared)).splitlines()
    assert data[0] == f"{prepared}: ok" and any(ln.split()[0] == "tokenizer" for ln in data[1:])
    pre = ok(run_cli("preflight", str(cfg), "--set", "mesh.data=1")).splitlines()
    assert {ln.split()[1] for ln in pre} >= {"devices", "mesh", "data", "output", "memory"}
    assert all(ln.startswith("ok   ") for ln in pre), pre


def test_data_prepare_plain(tmp_path, corpus_dir):
    out = tmp_path / "data"
    res = run_cli("data", "prepare", "--input", str(corpus_dir / "*.txt"), "--out", str(out))
    line = ok(res).strip()
    assert line.startswith(f"wrote {out}/manifest.json (tokenizer byte") and "fingerprint" in line


@pytest.mark.slow
def test_launch_plan_plain(tmp_path):
    run = tiny_config("/nonexistent/manifest.json", str(tmp_path / "runs"), mesh={"data": 2})
    job = tmp_path / "plan.yaml"
    job.write_text(yaml.safe_dump({"name": "plan", "hosts": 2, "run": run}))
    text = ok(launch(tmp_path / "state", "plan", str(job), timeout=300))
    lines = fields(text)
    assert lines["target"] == "cpu x 1 host(s) x 1 slice(s) = 2 x cpu (2)", text
    assert lines["mesh"] == "slices=1 data=2 expert=1 fsdp=1 context=1 tensor=1"
    assert lines["memory"].startswith("peak ") and lines["FLOPs/chip"].startswith("compiled ")
    assert lines["collectives"].split(":")[0].isdigit()


# ---- render for every backend --------------------------------------------------------------


@pytest.mark.parametrize(
    "backend, files",
    [("local", ["hosts.json", "cfg.toml", "job.yaml"]), ("slurm", ["job.sbatch", "cfg.toml", "job.yaml"]),
     ("k8s", ["configmap.yaml", "jobset.yaml"])],
)  # fmt: skip
def test_render_plain_for_every_backend(tmp_path, backend, files):
    job = "tests/k8s_specs/cpu-2.yaml"
    text = ok(launch(tmp_path / "state", "render", job, "--backend", backend))
    assert [
        ln[len("# ==> ") : -len(" <==")] for ln in text.splitlines() if ln.startswith("# ==> ")
    ] == files
    assert not (tmp_path / "state" / "jaxjob" / "runs").exists()


# ---- k8s, through the fake API server --------------------------------------------------------


def test_k8s_launch_commands_plain(tmp_path):
    pytest.importorskip("kubernetes.client", reason="pip install 'jaxjob[k8s]'")
    from test_k8s_client import CONFIGMAPS, JOBSETS, JS, PODS, FakeApiServer, jobset, pod, pod_list

    spec = yaml.safe_load((ROOT / "tests/k8s_specs/tpu-v5e-16.yaml").read_text())
    spec |= {"run": str(ROOT / "tests/k8s_specs/tpu-v5e-16.toml"), "run_id": JS,
             "output_uri": str(tmp_path / "runs")}  # fmt: skip
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec))
    state = tmp_path / "state"
    with FakeApiServer() as api:
        kubeconfig = {
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "c", "cluster": {"server": api.url}}],
            "users": [{"name": "u", "user": {"token": "t"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "c", "user": "u"}}],
        }  # fmt: skip
        (tmp_path / "kubeconfig").write_text(json.dumps(kubeconfig))
        env = {"KUBECONFIG": str(tmp_path / "kubeconfig"), "KUBERNETES_SERVICE_HOST": ""}
        api.answer("POST", CONFIGMAPS, {"metadata": {"name": f"{JS}-config"}}, 201)
        api.answer("POST", JOBSETS, jobset(), 201)
        sub = ok(launch(state, "submit", str(job), "--backend", "k8s", env=env)).splitlines()
        assert sub[0] == f"submitted {JS} to the k8s backend (artifacts: {tmp_path / 'runs' / JS})"

        api.answer("GET", f"{JOBSETS}/{JS}", jobset({"restarts": 1, "restartsCountTowardsMax": 1}))
        api.answer("GET", PODS, pod_list(*(pod(i, attempt=1) for i in range(4))))
        st = fields(ok(launch(state, "status", JS, env=env)))
        assert st["run"] == f"{JS}  (k8s)"
        assert st["state"] == "running  4 of 4 hosts running; attempt 1 after 1 restart(s)"
        assert st["attempt"] == "1  (1 restarts counted against max_restarts)"
        assert st["progress"] == "no artifacts yet"

        for i in range(4):
            api.answer("GET", f"{PODS}/{JS}-slice-0-{i}-a1bcd/log", f"step 3 on {i}\n")
        logs = ok(launch(state, "logs", JS, "--all-hosts", env=env)).splitlines()
        assert logs == [f"[host {i}] step 3 on {i}" for i in range(4)]
        assert ok(launch(state, "logs", JS, env=env)).splitlines() == logs[:1]
        listed = ok(launch(state, "list", env=env)).splitlines()
        assert listed[1].split()[:2] == [JS, "k8s"]

        api.answer("DELETE", f"{JOBSETS}/{JS}", {"kind": "Status", "status": "Success"})
        api.answer("DELETE", f"{CONFIGMAPS}/{JS}-config", {"kind": "Status", "status": "Success"})
        cancel = ok(launch(state, "cancel", JS, env=env)).strip()
        assert cancel == f"cancel sent to {JS}: its hosts checkpoint and stop"
        assert ("DELETE", f"{JOBSETS}/{JS}") in api.calls()


# ---- SLURM, against the real dev cluster ----------------------------------------------------


@pytest.mark.slow
def test_slurm_job_that_can_never_start_says_why(tmp_path, prepared, slurm_cluster):
    """More nodes than the partition has: slurmctld accepts the job and leaves it pending with
    reason PartitionConfig; status says so and why, and `submit --wait` does not wait forever."""
    nodes = int(subprocess.run(["sinfo", "-h", "-o", "%D"], capture_output=True, text=True,
                               check=True).stdout.split()[0])  # fmt: skip
    hosts = nodes + 1  # one host per node: one node more than there are
    run = tiny_config(prepared, str(tmp_path / "runs"), "ignored", mesh={"data": hosts})
    spec = {"name": "sl-never", "run": run, "hosts": hosts, "max_restarts": 0,
            "slurm": {"time": "00:05:00"}}  # fmt: skip
    job = tmp_path / "never.yaml"
    job.write_text(yaml.safe_dump(spec))
    state = tmp_path / "state"
    try:
        res = launch(state, "submit", str(job), "--backend", "slurm", "--wait", timeout=120)
        (record,) = (state / "jaxjob" / "runs").glob("*/record.json")
        run_id = json.loads(record.read_text())["run_id"]
        err = stderr_lines(res.stderr)
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
        assert err[-1].startswith(f"error: run {run_id} is queued but SLURM reason "), err
        assert "it can never start" in err[-1] and f"launch cancel {run_id}" in err[-1]
        st = fields(ok(launch(state, "status", run_id)))
        assert st["state"].startswith("pending  pending (waiting; reason Partition"), st
        assert st["attempt"] == "0  (0 of 0 restarts)"
        assert st["hint"].endswith(
            f"it can never start: the partition debug has {nodes} node(s) for one job and this "
            f"job asks for {hosts}; reduce hosts (or raise slurm.hosts_per_node for a CPU job) or "
            "choose another partition (slurm.partition), then cancel and resubmit"
        ), st["hint"]
        listed = ok(launch(state, "list", "--status", "pending")).splitlines()
        assert listed[1].split()[:3] == [run_id, "slurm", "pending"]
        # Another machine (a registry that never saw the run) finds it in squeue by its comment,
        # and cancels it from there; here it is listed once, as this machine's.
        job_id = json.loads(record.read_text())["handle"]["job_id"]
        elsewhere = tmp_path / "elsewhere"
        found = json.loads(ok(launch(elsewhere, "list", "--backend", "slurm", "--json")))
        mine = [r for r in found if r["run_id"] == run_id]
        assert [(r["state"], r["submitted_here"], r["where"]) for r in mine] == [
            ("pending", False, f"slurm job {job_id}")
        ], found
        here = json.loads(ok(launch(state, "list", "--backend", "slurm", "--json")))
        assert [r["where"] for r in here if r["run_id"] == run_id] == ["here"]
        cancel = ok(launch(elsewhere, "cancel", "--backend", "slurm", "--name", run_id, "--yes"))
        assert f"cancel sent to {run_id}: its hosts checkpoint and stop" in cancel
        deadline = time.monotonic() + 60
        while not fields(ok(launch(state, "status", run_id)))["state"].startswith("cancelled"):
            assert time.monotonic() < deadline
            time.sleep(0.5)
    finally:  # a failed assert (or a --wait that hangs) must not leave the job queued
        for record in (state / "jaxjob" / "runs").glob("*/record.json"):
            job_id = str(json.loads(record.read_text())["handle"]["job_id"])
            subprocess.run(["scancel", job_id], capture_output=True, timeout=60)
