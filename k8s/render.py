"""The Kubernetes manifests of one run: a ConfigMap (cfg.toml, job.yaml) and a JobSet.

Built as plain dicts and serialised once (STYLE.md, "Manifests as data"). Nothing here imports
jax or kubernetes, so a job spec renders anywhere.

How a pod learns the env contract (DESIGN.md, "The seam"): one replicated job `slice` with one
Indexed Job per slice, so JobSet's `job-global-index` is the slice index and the Job's
JOB_COMPLETION_INDEX is the host within it; a one-line `sh -c` wrapper computes
JAXJOB_PROCESS_ID = slice index x hosts per slice + completion index and execs the runtime.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import yaml

from jobspec.errors import ConfigError
from jobspec.job_spec import JobSpec, SecretRef
from launch.backend import RESTARTABLE_EXIT_CODES, Submission

JOBSET_API_VERSION = "jobset.x-k8s.io/v1alpha2"
REPLICATED_JOB = "slice"
CONTAINER = "worker"
CONFIG_DIR = "/etc/jaxjob"  # where the ConfigMap is mounted
CONFIG_FILE = "cfg.toml"
SPEC_FILE = "job.yaml"
COORDINATOR_PORT = 8476  # JAX's usual coordinator port
MAX_NAME = 63  # DNS-1035 label: pod and Job names, hostnames
POD_SUFFIX = "-abcde"  # Kubernetes appends '-' and 5 random characters to each pod's name
CONFIGMAP_MAX_BYTES = 1024 * 1024

# What JobSet and the Job controller put on every pod, as labels and as annotations (FACTS.md,
# "JobSet and JAX on Kubernetes"); the ones used here:
JOBSET_NAME_KEY = "jobset.sigs.k8s.io/jobset-name"
JOBSET_UID_KEY = "jobset.sigs.k8s.io/jobset-uid"
JOB_GLOBAL_INDEX_KEY = "jobset.sigs.k8s.io/job-global-index"
RESTART_ATTEMPT_KEY = "jobset.sigs.k8s.io/restart-attempt"
COMPLETION_INDEX_KEY = "batch.kubernetes.io/job-completion-index"
# One slice per GKE node pool, so a TPU slice's hosts share one ICI domain.
EXCLUSIVE_TOPOLOGY_KEY = "alpha.jobset.sigs.k8s.io/exclusive-topology"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
RUN_ID_LABEL = "jaxjob/run-id"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"

# `${VAR:?}` makes a missing variable a clear shell error instead of a silent process id 0.
PROCESS_ID_SCRIPT = (
    "export JAXJOB_PROCESS_ID=$(( ${JAXJOB_SLICE_INDEX:?} * ${JAXJOB_HOSTS_PER_SLICE:?}"
    ' + ${JOB_COMPLETION_INDEX:?} )); exec "$@"'
)

# podFailurePolicy rule indexes; the Job controller writes them into the failure message, which
# is how the JobSet rules below tell a preemption from a restartable exit (both have reason
# PodFailurePolicy).
_PREEMPTED, _RESTARTABLE, _OTHER = 0, 1, 2


@dataclass(frozen=True)
class Manifests:
    configmap: dict[str, Any]
    jobset: dict[str, Any]


def jobset_name(run_id: str) -> str:
    return run_id


def configmap_name(run_id: str) -> str:
    return f"{run_id}-config"


def coordinator_host(run_id: str) -> str:
    """Stable DNS name of process 0: `<jobset>-<rjob>-<job>-<pod>.<subdomain>`."""
    name = jobset_name(run_id)
    return f"{name}-{REPLICATED_JOB}-0-0.{name}"


def longest_pod_name(run_id: str, spec: JobSpec) -> str:
    name = jobset_name(run_id)
    return f"{name}-{REPLICATED_JOB}-{spec.slices - 1}-{spec.hosts_per_slice - 1}{POD_SUFFIX}"


def check_names(run_id: str, spec: JobSpec) -> None:
    """Kubernetes names Jobs, pods and hostnames after the JobSet: say what to shorten first."""
    field = "run_id" if spec.run_id else "name"
    if not run_id[:1].isalpha():
        raise ConfigError(
            f"{field}: run id {run_id!r} starts with a digit, but the JobSet's pod and Job names "
            f"start with it and must start with a letter; start {field} with a letter"
        )
    longest = longest_pod_name(run_id, spec)
    if len(longest) > MAX_NAME:
        over = len(longest) - MAX_NAME
        raise ConfigError(
            f"{field}: the longest pod name, {longest!r} (with Kubernetes' 5-character suffix), is "
            f"{len(longest)} characters, over the {MAX_NAME} allowed; shorten {field} by at least "
            f"{over} characters"
        )


def _pod_failure_policy() -> dict[str, Any]:
    codes = sorted(RESTARTABLE_EXIT_CODES)

    def exits(operator: str) -> dict[str, Any]:
        return {"containerName": CONTAINER, "operator": operator, "values": codes}

    rules = [
        # _PREEMPTED: preemption, eviction, node drain give the pod a DisruptionTarget condition.
        {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        # _RESTARTABLE: the runtime stopped cleanly after a checkpoint, or lost a peer.
        {"action": "FailJob", "onExitCodes": exits("In")},
        # _OTHER: FailJob rather than backoffLimit keeps the pod and exit code in the message.
        {"action": "FailJob", "onExitCodes": exits("NotIn")},
    ]
    return {"rules": rules}


def _failure_policy(max_restarts: int) -> dict[str, Any]:
    codes = "|".join(str(c) for c in sorted(RESTARTABLE_EXIT_CODES))
    # Patterns match the Job controller's messages (pkg/controller/job/pod_failure_policy.go):
    #   "Pod <ns>/<pod> has condition DisruptionTarget matching FailJob rule at index 0"
    #   "Container worker for pod <ns>/<pod> failed with exit code 42 matching FailJob rule at index 1"
    return {
        "maxRestarts": max_restarts,
        "restartStrategy": "Recreate",
        "rules": [
            {
                "name": "Preempted",
                "action": "RestartJobSetAndIgnoreMaxRestarts",
                "onJobFailureReasons": ["PodFailurePolicy"],
                "onJobFailureMessagePatterns": [
                    f"has condition DisruptionTarget matching FailJob rule at index {_PREEMPTED}$"
                ],
            },
            {
                "name": "RestartableExit",
                "action": "RestartJobSet",
                "onJobFailureReasons": ["PodFailurePolicy"],
                "onJobFailureMessagePatterns": [
                    f"failed with exit code ({codes}) matching FailJob rule at index {_RESTARTABLE}$"
                ],
            },
            # Everything else (a user error, a crash, a pod that failed without an exit code).
            {"name": "AnyOtherFailure", "action": "FailJobSet"},
        ],
    }


def _env(sub: Submission, port: int) -> list[dict[str, Any]]:
    spec = sub.spec

    def annotation(key: str) -> dict[str, Any]:
        return {"fieldRef": {"fieldPath": f"metadata.annotations['{key}']"}}

    env: list[dict[str, Any]] = [
        {"name": "JAXJOB_RUN_ID", "value": sub.run_id},
        {"name": "JAXJOB_COORDINATOR", "value": f"{coordinator_host(sub.run_id)}:{port}"},
        {"name": "JAXJOB_NUM_PROCESSES", "value": str(spec.total_hosts)},
        {"name": "JAXJOB_HOSTS_PER_SLICE", "value": str(spec.hosts_per_slice)},
        {"name": "JAXJOB_SLICE_INDEX", "valueFrom": annotation(JOB_GLOBAL_INDEX_KEY)},
        {"name": "JAXJOB_ATTEMPT", "valueFrom": annotation(RESTART_ATTEMPT_KEY)},
        # The JobSet's uid: the same across its restarts, new for a resubmitted JobSet.
        {"name": "JAXJOB_SUBMISSION_ID", "valueFrom": annotation(JOBSET_UID_KEY)},
        {"name": "JAXJOB_OUTPUT_URI", "value": sub.output_uri},
        {"name": "PYTHONUNBUFFERED", "value": "1"},  # log lines reach `launch logs` as printed
    ]
    if spec.catalogue.kind == "cpu":  # TPU/GPU images pick their platform themselves
        env.append({"name": "JAX_PLATFORMS", "value": "cpu"})
    env = [e for e in env if e["name"] not in spec.env]  # the spec may override PYTHONUNBUFFERED
    for name, value in spec.env.items():
        if isinstance(value, SecretRef):
            ref = {"secretKeyRef": {"name": value.secret, "key": value.key}}
            env.append({"name": name, "valueFrom": ref})
        else:
            env.append({"name": name, "value": value})
    return env


def _container(sub: Submission, port: int) -> dict[str, Any]:
    acc = sub.spec.catalogue
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": sub.spec.image,
        "command": ["sh", "-c", PROCESS_ID_SCRIPT, "sh"],
        "args": ["runtime", "worker", f"{CONFIG_DIR}/{CONFIG_FILE}"],
        "env": _env(sub, port),
        "ports": [{"name": "coordinator", "containerPort": port, "protocol": "TCP"}],
    }
    if acc.resource:
        container["resources"] = {"limits": {acc.resource: acc.chips_per_host}}
    container |= {
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "dshm", "mountPath": "/dev/shm"},
        ],
        # The end of a failed host's output becomes its pod's termination message (status).
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    return container


def _pod_spec(sub: Submission, port: int) -> dict[str, Any]:
    spec, k8s = sub.spec, sub.spec.k8s
    pod: dict[str, Any] = {
        "restartPolicy": "Never",  # the JobSet webhook would default OnFailure
        "subdomain": jobset_name(sub.run_id),
        "terminationGracePeriodSeconds": k8s.termination_grace_s,
    }
    if k8s.service_account:
        pod["serviceAccountName"] = k8s.service_account
    if k8s.priority_class:
        pod["priorityClassName"] = k8s.priority_class
    selector = {**spec.catalogue.node_selector, **k8s.node_selector}
    if selector:
        pod["nodeSelector"] = selector
    if k8s.tolerations:
        pod["tolerations"] = [dict(t) for t in k8s.tolerations]
    pod |= {
        "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [_container(sub, port)],
        "volumes": [
            {"name": "config", "configMap": {"name": configmap_name(sub.run_id)}},
            {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        ],
    }
    return pod


def _labels(sub: Submission) -> dict[str, str]:
    # Ours last: a user label must not break how `status`/`logs` find the run.
    return {**sub.spec.k8s.labels, RUN_ID_LABEL: sub.run_id, MANAGED_BY_LABEL: "jaxjob"}


def _metadata(
    name: str, namespace: str, labels: dict[str, str], annotations: dict[str, str]
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": labels}
    if annotations:
        meta["annotations"] = annotations
    return meta


def render_manifests(
    sub: Submission, *, namespace: str | None = None, coordinator_port: int = COORDINATOR_PORT
) -> Manifests:
    """The ConfigMap and JobSet for `sub`; a ConfigError (one sentence) if Kubernetes would refuse."""
    spec = sub.spec
    if not spec.image:
        raise ConfigError(
            "image: the k8s backend runs a container image on every host; set image to one with "
            "jaxjob installed (the `runtime` command on PATH)"
        )
    check_names(sub.run_id, spec)
    ns = namespace or spec.k8s.namespace
    name = jobset_name(sub.run_id)

    data = {CONFIG_FILE: sub.run_toml, SPEC_FILE: sub.spec_yaml}
    size = sum(len(v.encode()) for v in data.values())
    if size > CONFIGMAP_MAX_BYTES:
        raise ConfigError(
            f"run: the run config and job spec are {size} bytes, over a ConfigMap's 1 MiB; "
            "move large inline values (e.g. lists of files) into the data manifest"
        )
    configmap = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(configmap_name(sub.run_id), ns, _labels(sub), {}),
        "immutable": True,  # a running job's hosts must all read the same config
        "data": data,
    }

    js_labels = _labels(sub)
    if spec.k8s.queue:
        js_labels[QUEUE_LABEL] = spec.k8s.queue
    js_annotations = dict(spec.k8s.annotations)
    if spec.catalogue.kind == "tpu":
        js_annotations[EXCLUSIVE_TOPOLOGY_KEY] = "cloud.google.com/gke-nodepool"
    pod_meta: dict[str, Any] = {"labels": _labels(sub)}
    if spec.k8s.annotations:
        pod_meta["annotations"] = dict(spec.k8s.annotations)

    hosts = spec.hosts_per_slice
    js_spec: dict[str, Any] = {
        "failurePolicy": _failure_policy(spec.max_restarts),
        # The rest is what the JobSet webhook would default, written out so the file says it.
        "successPolicy": {"operator": "All"},
        "startupPolicy": {"startupPolicyOrder": "AnyOrder"},
        "network": {
            "enableDNSHostnames": True,
            "subdomain": name,
            "publishNotReadyAddresses": True,  # host 0 resolves before every pod is ready
        },
    }
    if spec.k8s.ttl_after_finished_s is not None:
        js_spec["ttlSecondsAfterFinished"] = spec.k8s.ttl_after_finished_s
    js_spec["replicatedJobs"] = [
        {
            "name": REPLICATED_JOB,
            "replicas": spec.slices,
            "template": {
                "spec": {
                    "completionMode": "Indexed",
                    "parallelism": hosts,
                    "completions": hosts,
                    "backoffLimit": 0,  # one host down is the whole slice down: JobSet decides
                    "podFailurePolicy": _pod_failure_policy(),
                    "template": {
                        "metadata": pod_meta,
                        "spec": _pod_spec(sub, coordinator_port),
                    },
                }
            },
        }
    ]
    jobset = {
        "apiVersion": JOBSET_API_VERSION,
        "kind": "JobSet",
        "metadata": _metadata(name, ns, js_labels, js_annotations),
        "spec": js_spec,
    }
    return Manifests(configmap=configmap, jobset=jobset)


class _Dumper(yaml.SafeDumper):
    """Safe YAML; multi-line strings (cfg.toml, job.yaml) as literal blocks; no anchors."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    # Literal blocks cannot hold trailing spaces or tabs; PyYAML would quote those anyway.
    style = "|" if "\n" in value and not re.search(r"[ \t]\n|\t", value) else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def to_yaml(obj: dict[str, Any]) -> str:
    return yaml.dump(obj, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=4096)
