"""Rendering job specs into a ConfigMap and a JobSet: upstream schemas, golden files, names,
accelerator resources and the failure policy's meaning.

Golden files live in tests/golden/k8s; `JAXJOB_UPDATE_GOLDEN=1 pytest tests/test_k8s_render.py`
rewrites them (then review the diff).
"""

from __future__ import annotations

import copy
import difflib
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from jobspec.errors import ConfigError
from jobspec.exit_codes import is_restartable
from jobspec.files.job_yaml import load_job, run_with_id
from jobspec.job_spec import JobSpec
from launch.backend import Submission
from launch.backends.k8s.backend import K8sBackend
from launch.backends.k8s.render import (
    JOBSET_API_VERSION,
    Manifests,
    check_names,
    coordinator_host,
    render_manifests,
    to_yaml,
)

HERE = Path(__file__).resolve().parent
SPECS = HERE / "k8s_specs"
GOLDEN = HERE / "golden" / "k8s"
CRD = HERE / "data" / "jobset.x-k8s.io_jobsets.yaml"  # the upstream CRD: tests/data/README.md
K8S_VERSIONS = ("1.31.0", "1.37.0")  # podFailurePolicy is GA from 1.31; the newest schemas here
CASES = ("cpu-2", "tpu-v5e-16", "tpu-v5p-64x2", "gpu-h100x2")


def submission(case: str, run_id: str | None = None) -> Submission:
    job = load_job(SPECS / f"{case}.yaml")
    rid = run_id or f"{job.spec.name}-abc123"
    run, toml = run_with_id(job, rid)
    return Submission(job.spec, rid, toml, job.spec_yaml, run.run.output_uri, job.path.parent)


def inline_submission(**spec: Any) -> Submission:
    """A submission from a spec given here (the run config only needs to be some TOML)."""
    s = JobSpec.model_validate({"name": "t", "image": "img:1", "run": {}, **spec})
    rid = s.run_id or f"{s.name}-abc123"
    return Submission(s, rid, "[run]\n", "name: t\n", "gs://b/runs", HERE)


def pod_templates(jobset: dict) -> list[dict]:
    return [r["template"]["spec"]["template"] for r in jobset["spec"]["replicatedJobs"]]


def container(m: Manifests) -> dict:
    return pod_templates(m.jobset)[0]["spec"]["containers"][0]


def env_of(m: Manifests) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(m)["env"]}


@pytest.fixture(scope="module", params=CASES)
def rendered(request) -> tuple[str, Manifests]:
    return request.param, render_manifests(submission(request.param))


# ---- upstream schemas ------------------------------------------------------------------------


def _kubernetes_validate():
    return pytest.importorskip(
        "kubernetes_validate", reason="the upstream Kubernetes schemas need kubernetes-validate"
    )


def _strict(node: Any) -> Any:
    """Structural schemas prune unknown fields; for a test, make every object with `properties`
    reject other keys, so a typo fails instead of vanishing."""
    if isinstance(node, dict):
        out = {k: _strict(v) for k, v in node.items()}
        if (
            "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(node, list):
        return [_strict(v) for v in node]
    return node


@pytest.fixture(scope="module")
def jobset_validator():
    if not CRD.is_file():
        pytest.skip(
            f"the JobSet CRD is missing from {CRD} (restore it from the repository; "
            "tests/data/README.md says where it comes from)"
        )
    jsonschema = pytest.importorskip("jsonschema")

    crd = yaml.safe_load(CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha2"]
    schema = _strict(version["schema"]["openAPIV3Schema"])
    return jsonschema.Draft7Validator(schema)


def _errors(validator, obj: dict) -> list[str]:
    return [
        f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)
    ]


def _as_job(jobset: dict, rjob: dict) -> dict:
    name = f"{jobset['metadata']['name']}-{rjob['name']}-0"
    meta = {"name": name, "namespace": jobset["metadata"]["namespace"]}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta,
        "spec": rjob["template"]["spec"],
    }


def test_jobset_matches_the_crd(rendered, jobset_validator):
    case, m = rendered
    assert m.jobset["apiVersion"] == JOBSET_API_VERSION
    assert _errors(jobset_validator, m.jobset) == [], case


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_configmap_and_pod_templates_match_kubernetes(rendered, version):
    kubernetes_validate = _kubernetes_validate()

    case, m = rendered
    kubernetes_validate.validate(m.configmap, version, strict=True)
    for rjob in m.jobset["spec"]["replicatedJobs"]:
        kubernetes_validate.validate(_as_job(m.jobset, rjob), version, strict=True)


def test_a_typo_fails_validation(jobset_validator):
    kubernetes_validate = _kubernetes_validate()

    m = render_manifests(submission("tpu-v5p-64x2"))
    bad = copy.deepcopy(m.jobset)
    bad["spec"]["network"]["enableDnsHostnames"] = True
    assert any("enableDnsHostnames" in e for e in _errors(jobset_validator, bad))
    bad = copy.deepcopy(m.jobset)
    bad["spec"]["failurePolicy"]["rules"][0]["onJobFailureReason"] = ["PodFailurePolicy"]
    assert _errors(jobset_validator, bad)
    bad = copy.deepcopy(m.jobset)
    pod_templates(bad)[0]["spec"]["containers"][0]["volumeMount"] = []
    assert _errors(jobset_validator, bad)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(
            _as_job(bad, bad["spec"]["replicatedJobs"][0]), K8S_VERSIONS[-1], strict=True
        )


# ---- golden files ----------------------------------------------------------------------------


def test_golden_files(rendered):
    case, m = rendered
    update = os.environ.get("JAXJOB_UPDATE_GOLDEN") == "1"
    for kind, obj in (("configmap", m.configmap), ("jobset", m.jobset)):
        path = GOLDEN / f"{case}.{kind}.yaml"
        text = to_yaml(obj)
        if update:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            continue
        assert path.is_file(), f"{path} is missing; run with JAXJOB_UPDATE_GOLDEN=1 to write it"
        want = path.read_text()
        if text != want:
            diff = "".join(difflib.unified_diff(want.splitlines(True), text.splitlines(True),
                                                str(path), "rendered"))  # fmt: skip
            pytest.fail(f"{path} differs (JAXJOB_UPDATE_GOLDEN=1 rewrites it):\n{diff}")
    if update:  # rewritten, so nothing was checked: say so rather than pass
        pytest.skip(f"golden files of {case} rewritten; review the diff and run again")


def test_backend_render_is_the_yaml_of_the_manifests():
    sub = submission("tpu-v5e-16")
    files = K8sBackend().render(sub)
    assert [f.name for f in files] == ["configmap.yaml", "jobset.yaml"]
    m = render_manifests(sub)
    assert yaml.safe_load(files[0].content) == m.configmap
    assert yaml.safe_load(files[1].content) == m.jobset
    # The run config stays readable in the file: a literal block, not one escaped line.
    assert "  cfg.toml: |\n    [run]\n" in files[0].content
    assert "&id" not in files[1].content and "*id" not in files[1].content  # no YAML anchors


def test_namespace_override():
    m = K8sBackend(namespace="other").manifests(submission("tpu-v5e-16"))
    assert m.jobset["metadata"]["namespace"] == m.configmap["metadata"]["namespace"] == "other"


# ---- what the JobSet says ----------------------------------------------------------------------


def test_jobset_shape_and_webhook_defaults_written_out():
    m = render_manifests(submission("tpu-v5p-64x2"))
    spec = m.jobset["spec"]
    assert spec["network"] == {"enableDNSHostnames": True, "subdomain": "llm-v5p-abc123",
                               "publishNotReadyAddresses": True}  # fmt: skip
    assert spec["successPolicy"] == {"operator": "All"}
    assert spec["startupPolicy"] == {"startupPolicyOrder": "AnyOrder"}
    (rjob,) = spec["replicatedJobs"]
    job = rjob["template"]["spec"]
    assert rjob["replicas"] == 2
    assert (job["completionMode"], job["parallelism"], job["completions"]) == ("Indexed", 8, 8)
    assert job["backoffLimit"] == 0
    pod = job["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    assert pod["subdomain"] == spec["network"]["subdomain"]
    assert spec["failurePolicy"]["maxRestarts"] == 10
    assert env_of(m)["JAXJOB_COORDINATOR"] == "llm-v5p-abc123-slice-0-0.llm-v5p-abc123:8476"
    assert coordinator_host("llm-v5p-abc123") == "llm-v5p-abc123-slice-0-0.llm-v5p-abc123"
    assert m.jobset["metadata"]["annotations"]["alpha.jobset.sigs.k8s.io/exclusive-topology"] == (
        "cloud.google.com/gke-nodepool"
    )


@pytest.mark.parametrize(
    "case, resource, selector",
    [
        ("cpu-2", None, {}),
        ("tpu-v5e-16", {"google.com/tpu": 4},
         {"cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
          "cloud.google.com/gke-tpu-topology": "4x4"}),
        ("tpu-v5p-64x2", {"google.com/tpu": 4},
         {"cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
          "cloud.google.com/gke-tpu-topology": "2x4x4"}),
        ("gpu-h100x2", {"nvidia.com/gpu": 8},
         {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb",
          "cloud.google.com/gke-nodepool": "h100-pool"}),
    ],
)  # fmt: skip
def test_accelerator_resources_and_selectors(case, resource, selector):
    m = render_manifests(submission(case))
    pod = pod_templates(m.jobset)[0]["spec"]
    c = container(m)
    assert c.get("resources", {}).get("limits") == resource
    assert pod.get("nodeSelector", {}) == selector
    assert ("JAX_PLATFORMS" in env_of(m)) == (case == "cpu-2")  # never forced on TPU/GPU
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"].get("privileged", False) is False  # no accelerator needs it
    mounts = {v["mountPath"]: v["name"] for v in c["volumeMounts"]}
    assert mounts == {"/etc/jaxjob": "config", "/dev/shm": "dshm", "/home/jaxjob": "home",
                      "/tmp": "tmp"}  # fmt: skip
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    assert vols["config"]["configMap"]["name"] == m.configmap["metadata"]["name"]
    assert c["command"] + c["args"] == [
        "sh", "-c", c["command"][2], "sh", "runtime", "worker", "/etc/jaxjob/cfg.toml"
    ]  # fmt: skip


def test_k8s_section_queue_priority_and_env():
    m = render_manifests(submission("tpu-v5e-16"))
    pod = pod_templates(m.jobset)[0]["spec"]
    assert m.jobset["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "tpu-queue"
    assert pod["priorityClassName"] == "high-priority"
    assert pod["serviceAccountName"] == "jaxjob-runner"
    assert pod["terminationGracePeriodSeconds"] == 600
    assert m.jobset["spec"]["ttlSecondsAfterFinished"] == 86400
    assert env_of(m)["HF_HUB_OFFLINE"] == "1"
    assert m.configmap["data"]["cfg.toml"].startswith('[run]\nid = "llm-v5e-abc123"')
    # The validated spec re-serialised, not the file: no comments, the same spec when read back.
    carried = m.configmap["data"]["job.yaml"]
    assert "#" not in carried and carried != (SPECS / "tpu-v5e-16.yaml").read_text()
    assert (
        JobSpec.model_validate(yaml.safe_load(carried)) == load_job(SPECS / "tpu-v5e-16.yaml").spec
    )
    assert m.configmap["immutable"] is True

    gpu = render_manifests(submission("gpu-h100x2"))
    assert env_of(gpu)["HF_TOKEN"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
    assert pod_templates(gpu.jobset)[0]["spec"]["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    v5p = render_manifests(submission("tpu-v5p-64x2"))
    meta = pod_templates(v5p.jobset)[0]["metadata"]
    assert meta["labels"]["team"] == "research"
    assert meta["annotations"] == {"example.com/owner": "llm-team"}
    assert "kueue.x-k8s.io/queue-name" not in meta["labels"]  # Kueue reads it from the JobSet


def test_env_contract_fields():
    env = env_of(render_manifests(submission("tpu-v5p-64x2")))
    annotation = "metadata.annotations['jobset.sigs.k8s.io/{}']".format
    assert env["JAXJOB_RUN_ID"] == "llm-v5p-abc123"
    assert env["JAXJOB_NUM_PROCESSES"] == "16"
    assert env["JAXJOB_HOSTS_PER_SLICE"] == "8"
    assert env["JAXJOB_SLICE_INDEX"] == {"fieldRef": {"fieldPath": annotation("job-global-index")}}
    assert env["JAXJOB_ATTEMPT"] == {"fieldRef": {"fieldPath": annotation("restart-attempt")}}
    # Kept across the JobSet's restarts, so a restarted attempt succeeds the run's owner.
    assert env["JAXJOB_SUBMISSION_ID"] == {"fieldRef": {"fieldPath": annotation("jobset-uid")}}
    assert env["JAXJOB_OUTPUT_URI"] == "gs://jaxjob-runs/k8s"
    assert "JAXJOB_PROCESS_ID" not in env  # computed by the wrapper in each pod


# ---- failure policy --------------------------------------------------------------------------


def _job_failure(job_spec: dict, exit_code: int | None, condition: str | None) -> tuple[str, str]:
    """(reason, message) of the Job's Failed condition, as the Job controller writes them
    (pkg/controller/job/pod_failure_policy.go) for a pod that failed this way."""
    pod = "ml/llm-v5p-abc123-slice-1-3-x7k2p"
    for index, rule in enumerate(job_spec["podFailurePolicy"]["rules"]):
        if "onPodConditions" in rule and condition:
            if any(
                p["type"] == condition and p["status"] == "True" for p in rule["onPodConditions"]
            ):
                return "PodFailurePolicy", (
                    f"Pod {pod} has condition {condition} matching {rule['action']} rule at index {index}"
                )
        if "onExitCodes" in rule and exit_code:  # exit code 0 never matches
            req = rule["onExitCodes"]
            hit = (exit_code in req["values"]) == (req["operator"] == "In")
            if hit:
                return "PodFailurePolicy", (
                    f"Container {req['containerName']} for pod {pod} failed with exit code "
                    f"{exit_code} matching {rule['action']} rule at index {index}"
                )
    return "BackoffLimitExceeded", "Job has reached the specified backoff limit"


def _jobset_action(policy: dict, reason: str, message: str) -> tuple[str, str]:
    """First matching rule (jobset's pkg/controllers/failure_policy.go), RestartJobSet if none."""
    for rule in policy["rules"]:
        reasons, patterns = rule.get("onJobFailureReasons"), rule.get("onJobFailureMessagePatterns")
        if reasons and reason not in reasons:
            continue
        if patterns and not any(re.search(p, message) for p in patterns):
            continue
        return rule["name"], rule["action"]
    return "(default)", "RestartJobSet"


@pytest.mark.parametrize(
    "exit_code, condition, action",
    [
        (42, "DisruptionTarget", "RestartJobSetAndIgnoreMaxRestarts"),  # preempted, checkpointed
        (None, "DisruptionTarget", "RestartJobSetAndIgnoreMaxRestarts"),  # evicted before a save
        (137, "DisruptionTarget", "RestartJobSetAndIgnoreMaxRestarts"),  # killed after the grace
        (42, None, "RestartJobSet"),  # SIGTERM from elsewhere, after a checkpoint
        (43, None, "RestartJobSet"),  # a peer host was lost
        (44, None, "RestartJobSet"),  # the cluster did not form
        (45, None, "RestartJobSet"),  # a storage fault after retries
        (134, None, "RestartJobSet"),  # SIGABRT: JAX aborts when host 0 is gone
        (137, None, "RestartJobSet"),  # SIGKILL: OOM-killed
        (139, None, "RestartJobSet"),  # SIGSEGV
        (143, None, "RestartJobSet"),  # SIGTERM without a checkpoint (during start-up)
        (2, None, "FailJobSet"),  # user error: restarting cannot help
        (1, None, "FailJobSet"),  # a bug's exit
        (128, None, "FailJobSet"),  # not a signal death
        (255, None, "FailJobSet"),  # exit(-1)
        (None, None, "FailJobSet"),  # failed without an exit code
    ],
)
def test_failure_policy_decides(exit_code, condition, action):
    m = render_manifests(submission("tpu-v5p-64x2"))
    job = m.jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    reason, message = _job_failure(job, exit_code, condition)
    name, got = _jobset_action(m.jobset["spec"]["failurePolicy"], reason, message)
    assert got == action, (name, reason, message)
    if action == "FailJobSet" and exit_code:
        assert f"exit code {exit_code}" in message  # the failing pod's message is kept


@pytest.mark.parametrize("case", CASES)
def test_failure_policy_agrees_with_the_shared_exit_code_table(case):
    """Every exit code 1-255: the JobSet restarts (counted) exactly when is_restartable says so,
    the table the local supervisor and the SLURM verdict use too."""
    m = render_manifests(submission(case))
    job = m.jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    policy = m.jobset["spec"]["failurePolicy"]
    for code in range(1, 256):
        _, got = _jobset_action(policy, *_job_failure(job, code, None))
        assert got == ("RestartJobSet" if is_restartable(code) else "FailJobSet"), code
    values = job["podFailurePolicy"]["rules"][1]["onExitCodes"]["values"]
    assert values == sorted(set(values)) and len(values) <= 255 and 0 not in values  # API limits


def test_failure_policy_rules_are_named_as_the_webhook_requires():
    rules = render_manifests(submission("cpu-2")).jobset["spec"]["failurePolicy"]["rules"]
    names = [r["name"] for r in rules]
    assert len(set(names)) == len(names)
    for n in names:
        assert re.fullmatch(r"[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?", n), n
    reasons = {"BackoffLimitExceeded", "DeadlineExceeded", "FailedIndexes",
               "MaxFailedIndexesExceeded", "PodFailurePolicy"}  # fmt: skip
    for r in rules:
        assert set(r.get("onJobFailureReasons", [])) <= reasons


# ---- names -------------------------------------------------------------------------------------


def test_longest_pod_name_fits_or_says_which_field():
    name40 = "a" * 40
    # 47-character run id + "-slice-0-9" + 6 = 63: fits exactly.
    render_manifests(inline_submission(name=name40, accelerator="h100-80gb", hosts=10))
    with pytest.raises(ConfigError) as e:
        render_manifests(inline_submission(name=name40, accelerator="h100-80gb", hosts=11))
    msg = str(e.value)
    assert msg.startswith("name: ") and "64 characters" in msg and "by at least 1 " in msg
    assert msg.count(". ") == 0 and "\n" not in msg  # one sentence
    with pytest.raises(ConfigError, match=r"^run_id: .*shorten run_id"):
        render_manifests(
            inline_submission(name="t", run_id="r" * 50, accelerator="tpu-v5p-64", slices=2)
        )


def test_run_id_must_start_with_a_letter():
    s = inline_submission(run_id="1abc")
    with pytest.raises(ConfigError, match="^run_id: .*start run_id with a letter$"):
        check_names(s.run_id, s.spec)
    s = inline_submission(name="1job")
    with pytest.raises(ConfigError, match="^name: .*start name with a letter$"):
        check_names(s.run_id, s.spec)


def test_image_is_required():
    s = inline_submission(image=None)
    with pytest.raises(ConfigError, match="^image: "):
        render_manifests(s)


def test_k8s_modules_never_import_jax():
    code = ("import sys, launch.backends.k8s.render, launch.backends.k8s.client, "
            "launch.backends.k8s.backend; "
            "bad = [m for m in sys.modules if m == 'jax' or m.startswith('jax.')]; "
            "assert not bad, bad")  # fmt: skip
    subprocess.run([sys.executable, "-c", code], check=True, cwd=HERE.parent)
