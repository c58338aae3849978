"""Rendered pods pass the Pod Security Standards' "restricted" profile, for every accelerator.

`violations` below is the profile written out from the Kubernetes documentation
(concepts/security/pod-security-standards): every Baseline control and every Restricted one,
plus what this project adds (read-only root filesystem with writable emptyDirs where the
runtime writes, no service-account token, a sized /dev/shm). Each rule is also shown to fire
on a pod that breaks it, so the checker cannot pass by accident.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from jobspec.errors import ConfigError
from jobspec.files.job_yaml import load_job, run_with_id
from jobspec.job_spec import JobSpec
from launch.backend import Submission
from launch.backends.k8s.render import render_manifests

SPECS = Path(__file__).resolve().parent / "k8s_specs"
CASES = ("cpu-2", "gpu-h100x2", "tpu-v5e-16", "tpu-v5p-64x2")

BASELINE_CAPS = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                 "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}  # fmt: skip
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range",
                "net.ipv4.ip_unprivileged_port_start", "net.ipv4.tcp_syncookies",
                "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout",
                "net.ipv4.tcp_keepalive_intvl", "net.ipv4.tcp_keepalive_probes"}  # fmt: skip
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                      "persistentVolumeClaim", "projected", "secret"}  # fmt: skip
# Where the runtime, Python and the accelerator libraries write (k8s/render.py).
WRITTEN = ("/tmp", "/dev/shm")


def _containers(pod: dict) -> list[dict]:
    return [*pod.get("initContainers", []), *pod["containers"], *pod.get("ephemeralContainers", [])]


def violations(template: dict) -> set[str]:
    """The rules a pod template breaks (empty: it passes)."""
    pod, meta = template["spec"], template.get("metadata", {})
    psc = pod.get("securityContext", {})
    out: set[str] = set()

    def bad(rule: str, broken: bool) -> None:
        if broken:
            out.add(rule)

    scs = [(c, c.get("securityContext", {})) for c in _containers(pod)]
    # ---- Baseline
    bad("hostProcess", any(sc.get("windowsOptions", {}).get("hostProcess") for sc in
                           [psc, *(s for _, s in scs)]))  # fmt: skip
    bad("hostNamespaces", any(pod.get(k) for k in ("hostNetwork", "hostPID", "hostIPC")))
    bad("privileged", any(sc.get("privileged") for _, sc in scs))
    bad("capabilities.baseline",
        any(set(sc.get("capabilities", {}).get("add", [])) - BASELINE_CAPS for _, sc in scs))  # fmt: skip
    bad("hostPath", any("hostPath" in v for v in pod.get("volumes", [])))
    bad("hostPorts", any(p.get("hostPort") for c, _ in scs for p in c.get("ports", [])))
    apparmor_ok = {None, "RuntimeDefault", "Localhost"}
    bad("appArmor",
        any(sc.get("appArmorProfile", {}).get("type") not in apparmor_ok
            for sc in [psc, *(s for _, s in scs)])
        or any(k.startswith("container.apparmor.security.beta.kubernetes.io/")
               and v != "runtime/default" and not v.startswith("localhost/")
               for k, v in meta.get("annotations", {}).items()))  # fmt: skip
    se = [sc.get("seLinuxOptions", {}) for sc in [psc, *(s for _, s in scs)]]
    bad("seLinux", any(o.get("type", "") not in SELINUX_TYPES or "user" in o or "role" in o
                       for o in se))  # fmt: skip
    bad("procMount", any(sc.get("procMount", "Default") != "Default" for _, sc in scs))
    seccomp = [sc.get("seccompProfile", {}).get("type") for sc in [psc, *(s for _, s in scs)]]
    bad("seccomp.baseline", "Unconfined" in seccomp)
    bad("sysctls", any(s["name"] not in SAFE_SYSCTLS for s in psc.get("sysctls", [])))
    # ---- Restricted
    bad("volumeTypes", any(set(v) - {"name"} - RESTRICTED_VOLUMES for v in pod.get("volumes", [])))
    bad("allowPrivilegeEscalation", any(sc.get("allowPrivilegeEscalation") is not False
                                        for _, sc in scs))  # fmt: skip
    bad("runAsNonRoot",
        any(sc.get("runAsNonRoot") is False for _, sc in scs)
        or not (psc.get("runAsNonRoot") is True
                or all(sc.get("runAsNonRoot") is True for _, sc in scs)))  # fmt: skip
    bad("runAsUser", any(sc.get("runAsUser") == 0 for sc in [psc, *(s for _, s in scs)]))
    pod_seccomp = psc.get("seccompProfile", {}).get("type")
    bad("seccomp.restricted",
        any(t not in (None, "RuntimeDefault", "Localhost") for t in seccomp)
        or (pod_seccomp is None
            and any(sc.get("seccompProfile", {}).get("type") is None for _, sc in scs)))  # fmt: skip
    bad("capabilities.restricted",
        any("ALL" not in sc.get("capabilities", {}).get("drop", [])
            or set(sc.get("capabilities", {}).get("add", [])) - {"NET_BIND_SERVICE"}
            for _, sc in scs))  # fmt: skip
    # ---- this project's additions (the list)
    bad("numericUser", not isinstance(psc.get("runAsUser"), int) or psc["runAsUser"] < 1)
    bad("readOnlyRootFilesystem", any(sc.get("readOnlyRootFilesystem") is not True
                                      for _, sc in scs))  # fmt: skip
    bad("serviceAccountToken", pod.get("automountServiceAccountToken") is not False)
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for c, _ in scs:
        mounts = {m["mountPath"]: volumes.get(m["name"], {}) for m in c.get("volumeMounts", [])}
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        shm = mounts.get("/dev/shm", {}).get("emptyDir", {})
        bad("shmSized", shm.get("medium") != "Memory" or not shm.get("sizeLimit"))
        writable = [p for p, v in mounts.items() if "emptyDir" in v]
        home = env.get("HOME")
        for path in [*WRITTEN, home, env.get("TMPDIR"), env.get("XDG_CACHE_HOME")]:
            inside = path is not None and any(
                path == w or path.startswith(w + "/") for w in writable
            )
            bad("writableDirs", not inside)
        bad("scratchSized", any(not v["emptyDir"].get("sizeLimit") for v in volumes.values()
                                if "emptyDir" in v))  # fmt: skip
    return out


def submission(case: str, **k8s: Any) -> Submission:
    job = load_job(SPECS / f"{case}.yaml")
    spec = job.spec
    if k8s:
        spec = JobSpec.model_validate(
            {**job.spec.model_dump(exclude_unset=True), "k8s": {**job.spec.k8s.model_dump(), **k8s}}
        )
    rid = f"{spec.name}-abc123"
    run, toml = run_with_id(job, rid)
    return Submission(spec, rid, toml, job.spec_yaml, run.run.output_uri, job.path.parent)


def templates(sub: Submission) -> list[dict]:
    m = render_manifests(sub)
    return [r["template"]["spec"]["template"] for r in m.jobset["spec"]["replicatedJobs"]]


@pytest.mark.parametrize("case", CASES)
def test_rendered_pods_are_restricted(case):
    for t in templates(submission(case)):
        assert violations(t) == set(), case
        assert t["spec"]["securityContext"]["runAsUser"] == 1000


def _set(path: str, value: Any) -> Callable[[dict], None]:
    """A mutation: set `path` (dotted, `c` = the first container) in a pod template."""

    def apply(t: dict) -> None:
        node: Any = t["spec"]
        keys = path.split(".")
        for k in keys[:-1]:
            node = node["containers"][0] if k == "c" else node.setdefault(k, {})
        node[keys[-1]] = value

    return apply


def _drop(path: str) -> Callable[[dict], None]:
    def apply(t: dict) -> None:
        node: Any = t["spec"]
        keys = path.split(".")
        for k in keys[:-1]:
            node = node["containers"][0] if k == "c" else node[k]
        del node[keys[-1]]

    return apply


def _add_volume(volume: dict) -> Callable[[dict], None]:
    return lambda t: t["spec"]["volumes"].append(volume)


BREAKS = [
    ("hostProcess", _set("c.securityContext.windowsOptions", {"hostProcess": True})),
    ("hostNamespaces", _set("hostNetwork", True)),
    ("hostNamespaces", _set("hostIPC", True)),
    ("privileged", _set("c.securityContext.privileged", True)),
    ("capabilities.baseline", _set("c.securityContext.capabilities", {"drop": ["ALL"], "add": ["SYS_ADMIN"]})),
    ("capabilities.restricted", _set("c.securityContext.capabilities", {"drop": ["ALL"], "add": ["CHOWN"]})),
    ("capabilities.restricted", _set("c.securityContext.capabilities", {})),
    ("hostPath", _add_volume({"name": "h", "hostPath": {"path": "/dev"}})),
    ("volumeTypes", _add_volume({"name": "n", "nfs": {"server": "s", "path": "/"}})),
    ("hostPorts", _set("c.ports", [{"containerPort": 1, "hostPort": 8476}])),
    ("appArmor", _set("c.securityContext.appArmorProfile", {"type": "Unconfined"})),
    ("seLinux", _set("securityContext.seLinuxOptions", {"type": "spc_t"})),
    ("procMount", _set("c.securityContext.procMount", "Unmasked")),
    ("seccomp.baseline", _set("c.securityContext.seccompProfile", {"type": "Unconfined"})),
    ("seccomp.restricted", _drop("securityContext.seccompProfile")),
    ("sysctls", _set("securityContext.sysctls", [{"name": "kernel.msgmax", "value": "1"}])),
    ("allowPrivilegeEscalation", _drop("c.securityContext.allowPrivilegeEscalation")),
    ("runAsNonRoot", _set("c.securityContext.runAsNonRoot", False)),
    ("runAsUser", _set("c.securityContext.runAsUser", 0)),
    ("numericUser", _drop("securityContext.runAsUser")),
    ("readOnlyRootFilesystem", _set("c.securityContext.readOnlyRootFilesystem", False)),
    ("serviceAccountToken", _drop("automountServiceAccountToken")),
    ("shmSized", lambda t: t["spec"]["volumes"][1]["emptyDir"].pop("sizeLimit")),
    ("writableDirs", lambda t: t["spec"]["containers"][0]["volumeMounts"].pop()),  # /tmp
    ("writableDirs", lambda t: t["spec"]["containers"][0]["env"].append(
        {"name": "HOME", "value": "/root"})),  # fmt: skip
]  # fmt: skip


@pytest.mark.parametrize(
    "rule, mutate", BREAKS, ids=[f"{r}-{i}" for i, (r, _) in enumerate(BREAKS)]
)
def test_each_rule_fires_on_a_pod_that_breaks_it(rule, mutate):
    (t,) = templates(submission("gpu-h100x2"))
    broken = copy.deepcopy(t)
    mutate(broken)
    assert rule in violations(broken)


def test_user_group_and_sizes_come_from_the_spec():
    (t,) = templates(submission("tpu-v5e-16", run_as_user=2000, run_as_group=3000,
                                shm_size="64Gi", scratch_size="5Gi"))  # fmt: skip
    psc, vols = t["spec"]["securityContext"], {v["name"]: v for v in t["spec"]["volumes"]}
    assert (psc["runAsUser"], psc["runAsGroup"], psc["fsGroup"]) == (2000, 3000, 3000)
    assert vols["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}
    assert vols["tmp"]["emptyDir"] == vols["home"]["emptyDir"] == {"sizeLimit": "5Gi"}
    assert violations(t) == set()


@pytest.mark.parametrize("k8s, field", [({"run_as_user": 0}, "k8s.run_as_user"),
                                        ({"shm_size": "lots"}, "k8s.shm_size"),
                                        ({"scratch_size": "16Gi\n"}, "k8s.scratch_size")])  # fmt: skip
def test_root_and_bad_sizes_are_refused(k8s, field):
    with pytest.raises(ValidationError) as e:
        JobSpec.model_validate({"name": "t", "run": {}, "k8s": k8s})
    assert ".".join(map(str, e.value.errors()[0]["loc"])) == field


def test_a_local_output_path_gets_a_writable_volume():
    base = submission("cpu-2")
    sub = Submission(base.spec, base.run_id, base.run_toml, "", "/runs/out", base.workdir)
    (t,) = templates(sub)
    c = t["spec"]["containers"][0]
    output = [m for m in c["volumeMounts"] if m["mountPath"] == "/runs/out"]
    assert output and violations(t) == set()
    under_tmp = Submission(base.spec, base.run_id, base.run_toml, "", "/tmp/out", base.workdir)
    (t,) = templates(under_tmp)  # already writable: no second volume over /tmp
    mounts = [m["mountPath"] for m in t["spec"]["containers"][0]["volumeMounts"]]
    assert mounts.count("/tmp") == 1 and "/tmp/out" not in mounts, mounts
    assert len(t["spec"]["volumes"]) == len(templates(base)[0]["spec"]["volumes"])
    relative = Submission(base.spec, base.run_id, base.run_toml, "", "runs", base.workdir)
    with pytest.raises(ConfigError, match=r"^output_uri: 'runs' is relative.*use gs://"):
        render_manifests(relative)
