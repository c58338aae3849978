"""An env value reaches the hosts exactly as written, on every backend: the kubelet's `$(NAME)`
expansion and `$$` escape are escaped in the JobSet, the sbatch script single-quotes, and the
local backend hands the process a plain environment."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from kubelet import expand

from jobspec.files.job_yaml import load_job, run_with_id
from launch.backend import Submission
from launch.backends.k8s.backend import K8sBackend
from launch.backends.k8s.render import PROCESS_ID_SCRIPT, literal, render_manifests
from launch.backends.local.render import host_plan
from launch.backends.local.supervisor import host_env
from launch.backends.slurm.render import render_script

from runs import tiny_config

# What users write that a shell or the kubelet would read as something else.
VALUES = {
    "GREETING": "pa$(HOME)ss",
    "PRICE": "cost: $$5, or $$(HOME)",
    "OWN": "$(JAXJOB_RUN_ID) is a variable every pod has",
    "SHELLISH": "$HOME ${HOME} `id` $(id) 'q' \"d\" \\ ; #x",
    "OPEN": "$(never closed",
    "LAST": "ends with $",
    "MULTI": "two\nlines $(HOME)",
}
PRINT_ENV = (
    f"import json, os; print(json.dumps({{k: os.environ.get(k) for k in {sorted(VALUES)}}}))"
)


@pytest.fixture(scope="module")
def sub(tmp_path_factory) -> Submission:
    """A job spec as a user writes it, loaded as `launch render` does (secret scan included)."""
    d = tmp_path_factory.mktemp("env-literal")
    run = tiny_config("/m.json", "unused", mesh={"data": 2})
    spec = {"name": "lit", "image": "img:1", "hosts": 2, "output_uri": "gs://b/$(HOME)",
            "run": run, "env": VALUES}  # fmt: skip
    (d / "job.yaml").write_text(yaml.safe_dump(spec))
    job = load_job(d / "job.yaml")
    cfg, toml = run_with_id(job, "lit-abc123")
    return Submission(job.spec, "lit-abc123", toml, job.spec_yaml, cfg.run.output_uri, d)


def test_every_string_survives_the_kubelet():
    """All strings of `$`, parentheses and name characters up to 7 long, against variables
    that exist: what is written is what the container reads."""
    env = {"a": "VALUE-A", "ab": "VALUE-AB", "": "EMPTY-NAME"}
    for n in range(8):
        for chars in itertools.product("$()ab", repeat=n):
            text = "".join(chars)
            assert expand(literal(text), env) == text, repr(text)


def test_k8s_env_values_are_the_users_text(sub):
    files = {f.name: f.content for f in K8sBackend().render(sub)}
    jobset = files["jobset.yaml"]
    assert "value: pa$$(HOME)ss\n" in jobset  # the literal in the file kubectl applies
    (c,) = yaml.safe_load(jobset)["spec"]["replicatedJobs"][0]["template"]["spec"]["template"][
        "spec"
    ]["containers"]
    pod = {"HOME": "/home/jaxjob", "JAXJOB_RUN_ID": "lit-abc123", "JOB_COMPLETION_INDEX": "0"}
    seen = dict(pod)
    for e in c["env"]:  # as the kubelet builds the env: each value against those before it
        if "value" in e:
            seen[e["name"]] = expand(e["value"], seen)
    assert {k: seen[k] for k in VALUES} == VALUES
    assert seen["JAXJOB_OUTPUT_URI"] == "gs://b/$(HOME)"
    argv = [expand(w, seen) for w in c["command"] + c["args"]]
    assert argv == [
        "sh",
        "-c",
        PROCESS_ID_SCRIPT,
        "sh",
        "runtime",
        "worker",
        "/etc/jaxjob/cfg.toml",
    ]


@pytest.mark.parametrize("version", ["1.31.0", "1.37.0"])
def test_k8s_manifests_with_escaped_values_match_the_schemas(sub, version):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    jsonschema = pytest.importorskip("jsonschema")
    from test_k8s_render import CRD, _as_job, _strict

    m = render_manifests(sub)
    for rjob in m.jobset["spec"]["replicatedJobs"]:
        kubernetes_validate.validate(_as_job(m.jobset, rjob), version, strict=True)
    crd = yaml.safe_load(CRD.read_text())
    (v1a2,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha2"]
    errors = jsonschema.Draft7Validator(_strict(v1a2["schema"]["openAPIV3Schema"]))
    assert list(errors.iter_errors(m.jobset)) == []


def test_slurm_exports_are_the_users_text(sub, tmp_path):
    """The script's own env block, run by bash (scontrol and the job id stubbed)."""
    script = render_script(sub, tmp_path / "run")
    block = script[script.index("# ---- the env contract") : script.index("\nexits=")]
    stubs = "scontrol() { echo node-0; }\nSLURM_JOB_ID=7 SLURM_JOB_NODELIST=node-0\n"
    shell = f"set -uo pipefail\n{stubs}{block}\n"
    shell += f"{sys.executable} -c {json.dumps(PRINT_ENV)}\n"
    env = {"PATH": os.environ["PATH"]}  # nothing else: each value comes from the script
    out = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert json.loads(out.stdout) == VALUES


def test_local_hosts_get_the_users_text(sub, tmp_path):
    (host, _) = host_plan(sub, tmp_path)["hosts"]
    env = host_env(host, attempt=0, port=1234, submission_id="local-x")
    out = subprocess.run([sys.executable, "-c", PRINT_ENV], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == VALUES
    assert env["JAXJOB_OUTPUT_URI"] == "gs://b/$(HOME)"


def test_the_process_id_wrapper_reaches_sh_unchanged(sub):
    """The renderer's own `$((…))` is escaped too: the kubelet must not read it as `$(NAME)`."""
    c = render_manifests(sub).jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    (container,) = c["template"]["spec"]["containers"]
    assert container["command"][2] == PROCESS_ID_SCRIPT.replace("$((", "$$((")
    assert Path(container["args"][2]).name == "cfg.toml"
