"""The Kubernetes manifests of one run: a ConfigMap (cfg.toml, job.yaml) and a JobSet.

Built as plain dicts and serialised once (STYLE.md, "Manifests as data"). Nothing here imports
jax or kubernetes, so a job spec renders anywhere.

How a pod learns the env contract (docs/jobs-and-backends.md, "Multi-host"): one replicated job `slice` with one
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
from jobspec.exit_codes import RESTARTABLE_EXIT_CODES, SIGNAL_EXIT_CODES
from jobspec.job_spec import JobSpec, SecretRef
from jobspec.run_config import is_remote
from launch.backend import Submission

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
# Where the runtime and the libraries under it write (the root filesystem is read-only, Pod
# Security "restricted"): HOME (~/.cache: Hugging Face, pip, JAX's compilation cache, via
# XDG_CACHE_HOME too), /tmp (Python's tempfile, libtpu's /tmp/tpu_logs, XLA dumps) and
# /dev/shm (NCCL, multiprocessing). Each is an emptyDir with a size limit.
HOME_DIR = "/home/jaxjob"
TMP_DIR = "/tmp"
SHM_DIR = "/dev/shm"
# Exits that restart the JobSet, counted against maxRestarts: the runtime's restartable codes
# and deaths by signal (134 SIGABRT, 137 SIGKILL or OOM-kill, 139 SIGSEGV, 143 SIGTERM).
# The same table as is_restartable (tests/test_k8s_render.py checks every code).
RESTART_EXIT_CODES = sorted(set(RESTARTABLE_EXIT_CODES) | set(SIGNAL_EXIT_CODES))

# What JobSet and the Job controller put on every pod, as labels and as annotations; the ones
# used here:
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

# The kubelet expands `$(NAME)` in env values, commands and arguments to another variable's value
# (the ones it cannot resolve stay as written) and turns `$$` into `$`. Nothing rendered here
# relies on that (the pod's own values come from valueFrom, and sh computes the process id), so
# every value, command and argument is written to reach the container as it reads here.
_KUBELET_DOLLAR = re.compile(r"\$(?=[$(])")


def literal(text: str) -> str:
    """`text` escaped for the kubelet: each `$` that would start `$(NAME)` or `$$` doubled, so
    the container gets `text` unchanged (`pa$(HOME)ss` is written `pa$$(HOME)ss`)."""
    return _KUBELET_DOLLAR.sub("$$", text)


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
    codes = RESTART_EXIT_CODES  # sorted, as the API requires; at most 255 values

    def exits(operator: str) -> dict[str, Any]:
        return {"containerName": CONTAINER, "operator": operator, "values": codes}

    rules = [
        # _PREEMPTED: preemption, eviction, node drain give the pod a DisruptionTarget condition.
        {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        # _RESTARTABLE: the runtime stopped after a checkpoint, lost a peer, or met a storage
        # fault; or the process died by a signal (OOM-kill, a crash of the runtime under it).
        {"action": "FailJob", "onExitCodes": exits("In")},
        # _OTHER: FailJob rather than backoffLimit keeps the pod and exit code in the message.
        {"action": "FailJob", "onExitCodes": exits("NotIn")},
    ]
    return {"rules": rules}


def _failure_policy(max_restarts: int) -> dict[str, Any]:
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
                    # rule _RESTARTABLE matches only RESTART_EXIT_CODES
                    f"failed with exit code [0-9]+ matching FailJob rule at index {_RESTARTABLE}$"
                ],
            },
            # Everything else (a user error, a bug's exit 1, a pod that failed without an exit
            # code) fails the JobSet: restarting cannot help.
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
    env += _writable_env()
    env = [e for e in env if e["name"] not in spec.env]  # the spec may override PYTHONUNBUFFERED
    for name, value in spec.env.items():
        if isinstance(value, SecretRef):
            ref = {"secretKeyRef": {"name": value.secret, "key": value.key}}
            env.append({"name": name, "valueFrom": ref})
        else:
            env.append({"name": name, "value": value})
    return [{**e, "value": literal(e["value"])} if "value" in e else e for e in env]


def _writable_env() -> list[dict[str, Any]]:
    """Point every writer at the emptyDirs: the image's HOME may be unwritable, or root's."""
    return [
        {"name": "HOME", "value": HOME_DIR},
        {"name": "TMPDIR", "value": TMP_DIR},
        {"name": "XDG_CACHE_HOME", "value": f"{HOME_DIR}/.cache"},
    ]


def local_output_dir(sub: Submission) -> str | None:
    """The container path of a local output_uri (an emptyDir there), None for gs:// and the like."""
    uri = sub.output_uri
    if is_remote(uri):
        return None
    path = uri.removeprefix("file://")
    if not path.startswith("/"):
        raise ConfigError(
            f"output_uri: {uri!r} is relative, so inside a k8s container it would be under the "
            "image's working directory on a read-only root filesystem; use gs://… (kept after the "
            "pods are gone) or an absolute path"
        )
    path = path.rstrip("/")
    if not path:
        raise ConfigError(f"output_uri: {uri!r} is the root directory; use gs://… or a directory")
    return path


def _writable_volumes(sub: Submission) -> list[tuple[str, str, dict[str, Any]]]:
    """(volume name, mount path, emptyDir) for each place the runtime writes."""
    k8s = sub.spec.k8s
    out = [
        ("dshm", SHM_DIR, {"medium": "Memory", "sizeLimit": k8s.shm_size}),
        ("home", HOME_DIR, {"sizeLimit": k8s.scratch_size}),
        ("tmp", TMP_DIR, {"sizeLimit": k8s.scratch_size}),
    ]
    output = local_output_dir(sub)
    inside = output is not None and any(
        output == path or output.startswith(path + "/") for _, path, _ in out
    )
    if output is not None and not inside:  # gone with the pod: a try-out; gs:// keeps a run
        out.append(("output", output, {"sizeLimit": k8s.scratch_size}))
    return out


def _container_security() -> dict[str, Any]:
    # Pod Security "restricted" (tests/test_pod_security.py checks each rule); no accelerator
    # needs an exception: GKE's TPU and GPU device plugins work without privileged mode.
    return {
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


def _pod_security(k8s: Any) -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": k8s.run_as_user,
        "runAsGroup": k8s.run_as_group,
        "fsGroup": k8s.run_as_group,  # the emptyDirs and any mounted volume are the group's
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _container(sub: Submission, port: int) -> dict[str, Any]:
    acc = sub.spec.catalogue
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": sub.spec.image,
        "command": [literal(w) for w in ("sh", "-c", PROCESS_ID_SCRIPT, "sh")],
        "args": [literal(w) for w in ("runtime", "worker", f"{CONFIG_DIR}/{CONFIG_FILE}")],
        "env": _env(sub, port),
        "ports": [{"name": "coordinator", "containerPort": port, "protocol": "TCP"}],
    }
    if acc.resource:
        container["resources"] = {"limits": {acc.resource: acc.chips_per_host}}
    container |= {
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            *({"name": n, "mountPath": path} for n, path, _ in _writable_volumes(sub)),
        ],
        # The end of a failed host's output becomes its pod's termination message (status).
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": _container_security(),
    }
    return container


def _pod_spec(sub: Submission, port: int) -> dict[str, Any]:
    spec, k8s = sub.spec, sub.spec.k8s
    pod: dict[str, Any] = {
        "restartPolicy": "Never",  # the JobSet webhook would default OnFailure
        "subdomain": jobset_name(sub.run_id),
        "terminationGracePeriodSeconds": k8s.termination_grace_s,
        # The runtime never calls the API server; with a service account (e.g. for GKE
        # Workload Identity, served by the metadata server) the token still stays out.
        "automountServiceAccountToken": False,
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
        "securityContext": _pod_security(k8s),
        "containers": [_container(sub, port)],
        "volumes": [
            {"name": "config", "configMap": {"name": configmap_name(sub.run_id)}},
            *({"name": n, "emptyDir": ed} for n, _, ed in _writable_volumes(sub)),
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

    # The validated spec, re-serialised: the file as written may carry comments (or worse).
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
