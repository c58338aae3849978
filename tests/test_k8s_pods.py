"""Pod-level checks of the rendered JobSet, without a cluster.

Each pod's container command runs here as a local process with exactly the environment
Kubernetes and JobSet would give that pod: the Indexed Job's JOB_COMPLETION_INDEX, the
downward-API values read from the labels and annotations JobSet puts on every pod, and the
literal env. Only the coordinator's DNS name becomes 127.0.0.1 (no cluster DNS here) and the
ConfigMap's mount path a temp dir holding its files.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from kubelet import expand
from multihost import free_port

from jobspec.files.job_yaml import load_job, run_with_id
from jobspec.job_spec import check_mesh_fits
from launch.backend import Submission
from launch.backends.k8s.backend import saved_logs
from launch.backends.k8s.render import CONFIG_DIR, coordinator_host, render_manifests

from runs import tiny_config, write_config, xla_flags

REPO = Path(__file__).resolve().parents[1]
SPECS = REPO / "tests" / "k8s_specs"
FIELD = re.compile(r"^metadata\.(labels|annotations)\['([^']+)'\]$")


def pod_metadata(jobset: dict, job_index: int, completion_index: int, restarts: int = 0) -> dict:
    """Labels and annotations of one pod: the template's, plus what JobSet adds to every Job and
    pod (jobset's labelAndAnnotateObject, as labels and as annotations) and the Job
    controller's completion index."""
    (rjob,) = jobset["spec"]["replicatedJobs"]  # one replicated job: global index = job index
    template = rjob["template"]["spec"]["template"]["metadata"]
    name = jobset["metadata"]["name"]
    added = {
        "jobset.sigs.k8s.io/jobset-name": name,
        "jobset.sigs.k8s.io/jobset-uid": "8a6f3c1e-0000-4000-8000-000000000001",
        "jobset.sigs.k8s.io/replicatedjob-name": rjob["name"],
        "jobset.sigs.k8s.io/restart-attempt": str(restarts),
        "jobset.sigs.k8s.io/replicatedjob-replicas": str(rjob["replicas"]),
        "jobset.sigs.k8s.io/global-replicas": str(rjob["replicas"]),
        "jobset.sigs.k8s.io/job-index": str(job_index),
        "jobset.sigs.k8s.io/job-global-index": str(job_index),
        "jobset.sigs.k8s.io/job-key": "0" * 40,
        "batch.kubernetes.io/job-completion-index": str(completion_index),
    }
    return {
        "labels": {**template.get("labels", {}), **added},
        "annotations": {**template.get("annotations", {}), **added},
    }


def pod_env(container: dict, meta: dict, completion_index: int) -> dict[str, str]:
    """The container's environment as the kubelet builds it for this pod."""
    env = {"JOB_COMPLETION_INDEX": str(completion_index)}  # injected by the Indexed Job
    for e in container["env"]:
        if "value" in e:
            env[e["name"]] = expand(e["value"], env)  # `$(NAME)` and `$$`, as the kubelet does
            continue
        source = e["valueFrom"]
        if "secretKeyRef" in source:  # a stand-in value: no secrets here
            ref = source["secretKeyRef"]
            env[e["name"]] = f"secret:{ref['name']}/{ref['key']}"
            continue
        kind, key = FIELD.match(source["fieldRef"]["fieldPath"]).groups()
        assert key in meta[kind], f"{e['name']}: the pod has no {kind[:-1]} {key}"
        env[e["name"]] = meta[kind][key]
    return env


def pods(jobset: dict) -> list[tuple[int, int]]:
    (rjob,) = jobset["spec"]["replicatedJobs"]
    per_job = rjob["template"]["spec"]["completions"]
    return [(j, i) for j in range(rjob["replicas"]) for i in range(per_job)]


def the_container(jobset: dict) -> dict:
    (c,) = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"]
    return c


def spec_submission(case: str) -> Submission:
    job = load_job(SPECS / f"{case}.yaml")
    rid = f"{job.spec.name}-abc123"
    run, toml = run_with_id(job, rid)
    return Submission(job.spec, rid, toml, job.spec_yaml, run.run.output_uri, job.path.parent)


@pytest.mark.parametrize("case", ["cpu-2", "tpu-v5e-16", "tpu-v5p-64x2", "gpu-h100x2"])
def test_every_pod_computes_its_process_id(case):
    """The wrapper, run by a real sh: process id = job-global-index x pods per job + index."""
    m = render_manifests(spec_submission(case))
    c = the_container(m.jobset)
    per_job = m.jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["completions"]
    probe = ["sh", "-c", 'echo "$JAXJOB_PROCESS_ID $JAXJOB_NUM_PROCESSES $JAXJOB_ATTEMPT"']
    seen = []
    for j, i in pods(m.jobset):
        env = pod_env(c, pod_metadata(m.jobset, j, i, restarts=3), i)
        argv = [expand(a, env) for a in c["command"]] + probe
        out = subprocess.run(argv, env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        pid, n, attempt = out.stdout.split()
        assert int(pid) == j * per_job + i
        assert (int(n), attempt) == (len(pods(m.jobset)), "3")
        seen.append(int(pid))
    assert sorted(seen) == list(range(len(seen)))


def test_a_missing_variable_stops_the_pod_with_its_name():
    m = render_manifests(spec_submission("cpu-2"))
    c = the_container(m.jobset)
    env = pod_env(c, pod_metadata(m.jobset, 0, 1), 1)
    del env["JOB_COMPLETION_INDEX"]
    argv = [expand(a, env) for a in c["command"]] + ["true"]
    out = subprocess.run(argv, env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "JOB_COMPLETION_INDEX" in out.stderr


@pytest.mark.slow
def test_cpu_pods_form_one_cluster_and_finish(tmp_path, prepared):
    run_id = "podtest-abc123"
    out_uri = str(tmp_path / "out")
    cfg = tiny_config(
        prepared, out_uri, run_id="placeholder", mesh={"data": 2},
        training={"target_tokens": 16 * 8 * 6},
        runtime={"boot_timeout_s": 90, "host_loss_timeout_s": 30},
    )  # fmt: skip
    write_config(tmp_path / "cfg.toml", cfg)
    spec = {"name": "podtest", "image": "jaxjob:test", "run": "cfg.toml", "hosts": 2}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    job = load_job(tmp_path / "job.yaml")
    run, toml = run_with_id(job, run_id)
    check_mesh_fits(job.spec, run, "k8s")
    sub = Submission(job.spec, run_id, toml, job.spec_yaml, run.run.output_uri, tmp_path)
    m = render_manifests(sub, coordinator_port=free_port())

    # The ConfigMap volume: one file per key.
    etc = tmp_path / "etc-jaxjob"
    etc.mkdir()
    for key, text in m.configmap["data"].items():
        (etc / key).write_text(text)
    # The image's `runtime` command, from this checkout.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "runtime"
    shim.write_text(f'#!/bin/sh\nexec {sys.executable} -m runtime "$@"\n')
    shim.chmod(0o755)

    c = the_container(m.jobset)
    argv = [a.replace(CONFIG_DIR, str(etc)) for a in c["command"] + c["args"]]
    dns = coordinator_host(run_id)
    procs: list[tuple[int, subprocess.Popen, Path]] = []
    try:
        for j, i in pods(m.jobset):
            env = pod_env(c, pod_metadata(m.jobset, j, i), i)
            env["JAXJOB_COORDINATOR"] = env["JAXJOB_COORDINATOR"].replace(dns, "127.0.0.1")
            env |= {
                "PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin",
                # The pod's emptyDirs (HOME, its cache) are directories of this test.
                "HOME": str(tmp_path),
                "XDG_CACHE_HOME": str(tmp_path / ".cache"),
                "JAX_PLATFORMS": "cpu",
                "XLA_FLAGS": xla_flags(1),
            }
            log = tmp_path / f"pod-{j}-{i}.log"
            with open(log, "wb") as f:
                cmd = [expand(w, env) for w in argv]  # as the kubelet passes them
                p = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
            procs.append((i, p, log))
        for _, p, _ in procs:
            p.wait(timeout=400)
    finally:
        for _, p, _ in procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    outputs = {i: log.read_text(errors="replace") for i, _, log in procs}
    for i, p, _ in procs:
        assert p.returncode == 0, f"pod {i} exited {p.returncode}:\n{outputs[i][-4000:]}"
        assert f"host {i} of 2 (contract" in outputs[i], outputs[i][-2000:]
    run_dir = Path(out_uri) / run_id
    final = json.loads((run_dir / "summaries/final.json").read_text())
    assert final["status"] == "completed" and final["run_id"] == run_id
    diag = json.loads((run_dir / "diagnostics/runtime.json").read_text())
    boot = diag["boot"]
    assert (boot["mode"], boot["process_count"], boot["global_device_count"]) == ("contract", 2, 2)
    assert (boot["run_id"], boot["attempt"]) == (run_id, 0)

    # What `launch logs` shows once the pods are gone: the hosts' own copies.
    lines = list(saved_logs(out_uri, run_id, host=None, tail=None))
    assert any(ln.startswith("[host 0] ") for ln in lines)
    assert any(ln.startswith("[host 1] ") for ln in lines)
    assert os.path.isfile(run_dir / "logs/attempt-0/host-1.log")
