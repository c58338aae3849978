"""K8sBackend: a run is one ConfigMap and one JobSet; status, logs and cancel read them back.

Rendering needs nothing but the job spec; the `kubernetes` package is imported only when the
cluster is contacted, so `launch render --backend k8s` works without it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from jobspec.errors import ConfigError
from jobspec.run_config import check_dns_label
from launch.backend import ClusterRun, Handle, RenderedFile, Submission, tail_lines
from launch.backends.k8s.render import (
    COMPLETION_INDEX_KEY,
    CONTAINER,
    COORDINATOR_PORT,
    JOB_GLOBAL_INDEX_KEY,
    JOBSET_NAME_KEY,
    MANAGED_BY_LABEL,
    RESTART_ATTEMPT_KEY,
    RUN_ID_LABEL,
    Manifests,
    configmap_name,
    render_manifests,
    to_yaml,
)
from launch.state import utc_now
from runfolder.layout import LOGS, MANIFEST, parse_host_log

if TYPE_CHECKING:
    from kubernetes import client as k8s_client

    from launch.backends.k8s.client import K8sClient


class K8sBackend:
    name = "k8s"
    writes_run_files = False  # the config goes to a ConfigMap; `launch submit` keeps the copy
    handle_keys = ("namespace", "jobset")
    # One submission on the cluster (launch list: a run this machine recorded is seen once).
    identity_keys = ("namespace", "jobset", "uid")
    cli_options = ("context", "namespace")  # the kube context; a namespace over k8s.namespace

    def __init__(
        self,
        context: str | None = None,
        namespace: str | None = None,
        *,
        api_client: k8s_client.ApiClient | None = None,
        configuration: k8s_client.Configuration | None = None,
        coordinator_port: int = COORDINATOR_PORT,
        poll_s: float = 2.0,
    ) -> None:
        if namespace is not None:  # it replaces k8s.namespace, which the job spec checks
            try:
                check_dns_label(namespace, "--namespace ")
            except ValueError as e:
                raise ConfigError(str(e)) from None
        self.context = context
        self.namespace = namespace
        self._api_client = api_client
        self._configuration = configuration
        self.coordinator_port = coordinator_port
        self.poll_s = poll_s

    # ---- render / submit ----------------------------------------------------------------------

    def manifests(self, sub: Submission) -> Manifests:
        return render_manifests(
            sub, namespace=self.namespace, coordinator_port=self.coordinator_port
        )

    def render(self, sub: Submission) -> list[RenderedFile]:
        m = self.manifests(sub)
        return [
            RenderedFile("configmap.yaml", to_yaml(m.configmap)),
            RenderedFile("jobset.yaml", to_yaml(m.jobset)),
        ]

    def _client(self, context: str | None) -> tuple[K8sClient, str | None]:
        from launch.backends.k8s.client import K8sClient, connect

        if self._api_client is not None:
            return K8sClient(self._api_client), context
        api, used = connect(context, self._configuration)
        return K8sClient(api), used

    def _client_for(self, handle: Handle) -> K8sClient:
        # The context the run was submitted to, so a later `kubectl config use-context` does not
        # point status/logs/cancel at another cluster.
        return self._client(handle.data.get("context") or self.context)[0]

    def submit(self, sub: Submission) -> Handle:
        from launch.backends.k8s.client import K8sError

        m = self.manifests(sub)  # a ConfigError before anything reaches the cluster
        c, context = self._client(self.context)
        asked = utc_now()  # this machine's clock: the API server's time is kept when it says it
        ns = m.jobset["metadata"]["namespace"]
        cm_name = m.configmap["metadata"]["name"]
        c.create_configmap(ns, m.configmap)
        try:
            created = c.create_jobset(ns, m.jobset)
        except K8sError:
            try:
                c.delete_configmap(ns, cm_name)  # nothing half-submitted stays behind
            except K8sError:
                pass  # the JobSet's refusal is the error worth reporting
            raise
        try:
            c.set_owner(ns, cm_name, created)
        except (K8sError, KeyError):
            pass  # only garbage collection is lost: cancel deletes the ConfigMap itself
        meta = created.get("metadata") or {}
        data = {
            "namespace": ns,
            "jobset": m.jobset["metadata"]["name"],
            "context": context,
            "output_uri": sub.output_uri,
            "run_id": sub.run_id,
            # This submission's JobSet (a later one of the same name is another submission's)
            # and when it was made (what the run wrote before is an earlier submission's).
            "uid": meta.get("uid"),
            "submitted": meta.get("creationTimestamp") or asked,
        }
        return Handle(self.name, data)

    # ---- status -------------------------------------------------------------------------------

    def status(self, handle: Handle) -> dict[str, Any]:
        d = handle.data
        c = self._client_for(handle)
        js = c.get_jobset(d["namespace"], d["jobset"])
        if js is None or not _same_submission(js, d):
            return status_without_jobset(d, replaced=js is not None)
        selector = f"{JOBSET_NAME_KEY}={d['jobset']}"
        pods = c.list_pods(d["namespace"], selector)
        jobs = c.list_jobs(d["namespace"], selector) if _conditions(js).get("Failed") else []
        return summarise(js, pods, jobs)

    # ---- logs ---------------------------------------------------------------------------------

    def logs(
        self,
        handle: Handle,
        *,
        host: int | None,
        follow: bool,
        tail: int | None,
        since_submission: bool = False,  # a JobSet's pods are its submission's already
    ) -> Iterator[str]:
        d = handle.data
        c = self._client_for(handle)
        pods = self._live_pods(c, d, host)
        if not pods:  # restarted, deleted or past its TTL: the run's own copy of the logs
            yield from saved_logs(d["output_uri"], d["run_id"], host=host, tail=tail)
            return
        ns = d["namespace"]
        if not follow:
            for h, pod in sorted(pods.items()):
                yield from self._pod_lines(c, ns, h, pod, follow=False, tail=tail)
            return
        yield from self._follow(c, ns, pods, tail)

    def timed_logs(
        self,
        handle: Handle,
        *,
        host: int | None,
        tail: int | None,
        since_s: float | None,
        timestamps: bool,
    ) -> Iterator[str]:
        """`launch logs --follow` with --since/--timestamps (launch/logs_options.py): each live
        pod's stream with the API's own times (timestamps=true, sinceSeconds), as `<time> [host
        N] text`; without pods (ended, or between restarts) the run folder's lines and times."""
        from launch.logs_options import timed_lines
        from runfolder.storage import join

        d = handle.data
        c = self._client_for(handle)
        pods = self._live_pods(c, d, host)
        if not pods:
            run_uri = join(d["output_uri"], d["run_id"])
            yield from timed_lines(
                run_uri, d["run_id"], attempt=None, host=host, tail=tail, since_s=since_s,
                timestamps=timestamps,
            )  # fmt: skip
            return
        yield from self._follow(
            c, d["namespace"], pods, tail, timestamps=timestamps, since_s=since_s
        )

    def _live_pods(self, c: K8sClient, d: dict[str, Any], host: int | None) -> dict[int, dict]:
        """The current submission's pods by host (`host`'s only), none once the JobSet is gone."""
        js = c.get_jobset(d["namespace"], d["jobset"])
        selector = f"{JOBSET_NAME_KEY}={d['jobset']}"
        pods = current_pods(js, c.list_pods(d["namespace"], selector)) if js else {}
        if host is not None:
            pods = {h: p for h, p in pods.items() if h == host}
        return pods

    def _pod_lines(
        self,
        c: K8sClient,
        ns: str,
        h: int,
        pod: dict,
        *,
        follow: bool,
        tail: int | None,
        timestamps: bool = False,
        since_s: float | None = None,
    ) -> Iterator[str]:
        from launch.backends.k8s.client import K8sError
        from launch.logs_options import split_kubelet_time

        name = pod["metadata"]["name"]
        while True:
            try:
                for line in c.pod_log(
                    ns, name, CONTAINER, follow=follow, tail=tail, timestamps=timestamps,
                    since_s=since_s,
                ):  # fmt: skip
                    stamp, text = split_kubelet_time(line) if timestamps else (None, line)
                    # The time first, before the host, as kubectl puts it.
                    yield f"{stamp} [host {h}] {text}" if stamp else f"[host {h}] {line}"
                return
            except K8sError as e:
                # 400: the container has not started yet; following waits for it.
                if not follow or e.status != 400:
                    phase = (pod.get("status") or {}).get("phase", "Unknown")
                    yield f"[host {h}] (no log from pod {name}, {phase}: {e})"
                    return
                time.sleep(self.poll_s)

    def _follow(
        self,
        c: K8sClient,
        ns: str,
        pods: dict[int, dict],
        tail: int | None,
        *,
        timestamps: bool = False,
        since_s: float | None = None,
    ) -> Iterator[str]:
        """Every host's stream at once, interleaved as lines arrive."""
        lines: queue.Queue[str | None] = queue.Queue()

        def pump(h: int, pod: dict) -> None:
            try:
                for line in self._pod_lines(
                    c, ns, h, pod, follow=True, tail=tail, timestamps=timestamps, since_s=since_s
                ):
                    lines.put(line)
            finally:
                lines.put(None)

        for h, pod in sorted(pods.items()):
            threading.Thread(target=pump, args=(h, pod), daemon=True, name=f"log-{h}").start()
        open_streams = len(pods)
        while open_streams:
            line = lines.get()
            if line is None:
                open_streams -= 1
            else:
                yield line

    # ---- cancel -------------------------------------------------------------------------------

    def cancel(self, handle: Handle) -> None:
        """Delete the JobSet in the foreground: every pod gets SIGTERM and its grace period to
        checkpoint (the runtime exits 42); then the ConfigMap."""
        d = handle.data
        c = self._client_for(handle)
        c.delete_jobset(d["namespace"], d["jobset"])
        c.delete_configmap(d["namespace"], configmap_name(d["run_id"]))

    # ---- the cluster's runs (launch list/cancel/clean) ------------------------------------------

    def cluster_runs(self, all_namespaces: bool = False) -> list[ClusterRun]:
        """The JobSets jaxjob made in the namespace (--namespace, else `default`; every
        namespace with `all_namespaces`), newest first, each with its state as `status` reads
        it (conditions and pods; one pod list for all of them)."""
        c, context = self._client(self.context)
        ns = None if all_namespaces else (self.namespace or "default")
        selector = f"{MANAGED_BY_LABEL}=jaxjob"
        pods_of: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for pod in c.list_pods(ns, selector):
            meta = pod.get("metadata") or {}
            owner = (meta.get("labels") or {}).get(JOBSET_NAME_KEY)
            pods_of.setdefault((meta.get("namespace", ns or ""), owner or ""), []).append(pod)
        out = []
        for js in c.list_jobsets(ns, selector):
            meta = js.get("metadata") or {}
            name, where_ns = meta.get("name", ""), meta.get("namespace", ns or "")
            run_id = (meta.get("labels") or {}).get(RUN_ID_LABEL, name)
            data = {"namespace": where_ns, "jobset": name, "context": context, "run_id": run_id,
                    "output_uri": _env_value(js, "JAXJOB_OUTPUT_URI") or "", "uid": meta.get("uid"),
                    "submitted": meta.get("creationTimestamp", "")}  # fmt: skip
            try:
                st = summarise(js, pods_of.get((where_ns, name), []), [])
            except (KeyError, TypeError, ValueError):  # not a JobSet jaxjob rendered
                st = {"state": "unknown", "detail": "its spec is not one jaxjob renders"}
            out.append(ClusterRun(run_id, st["state"], st["detail"], data["submitted"],
                                  Handle(self.name, data), f"k8s {where_ns}/{name}"))  # fmt: skip
        out.sort(key=lambda r: (r.submitted, r.run_id), reverse=True)
        return out

    def forget(self, handle: Handle) -> str | None:
        """Delete an ended run's JobSet and ConfigMap (its storage stays); what was deleted, or
        None when the JobSet was already gone."""
        d = handle.data
        c = self._client_for(handle)
        js = c.get_jobset(d["namespace"], d["jobset"])
        if js is not None and not _same_submission(js, d):
            return None  # a later submission's JobSet of the same name: not this run's to remove
        gone = c.delete_jobset(d["namespace"], d["jobset"]) if js is not None else False
        c.delete_configmap(d["namespace"], configmap_name(d["run_id"]))
        return f"JobSet {d['namespace']}/{d['jobset']}" if gone else None


def _env_value(js: dict[str, Any], name: str) -> str | None:
    """The literal value of env `name` in the JobSet's first container (None: not there)."""
    for rj in (js.get("spec") or {}).get("replicatedJobs") or []:
        pod = ((rj.get("template") or {}).get("spec") or {}).get("template") or {}
        for ctr in (pod.get("spec") or {}).get("containers") or []:
            for e in ctr.get("env") or []:
                if e.get("name") == name and "value" in e:
                    return str(e["value"])
    return None


# ---- reading JobSet state (pure functions of the API objects) ----------------------------------


def _conditions(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    conds = (obj.get("status") or {}).get("conditions") or []
    return {c["type"]: c for c in conds if c.get("status") == "True"}


def _meta(pod: dict[str, Any], key: str) -> str | None:
    m = pod.get("metadata") or {}
    return (m.get("annotations") or {}).get(key) or (m.get("labels") or {}).get(key)


def _hosts_per_slice(js: dict[str, Any]) -> int:
    return int(js["spec"]["replicatedJobs"][0]["template"]["spec"]["completions"])


def current_pods(js: dict[str, Any] | None, pods: list[dict[str, Any]]) -> dict[int, dict]:
    """The pods of the JobSet's current restart attempt, by process id."""
    if js is None:
        return {}
    attempt = str((js.get("status") or {}).get("restarts", 0))
    per_slice = _hosts_per_slice(js)
    out: dict[int, dict] = {}
    for pod in pods:
        slice_index, index = _meta(pod, JOB_GLOBAL_INDEX_KEY), _meta(pod, COMPLETION_INDEX_KEY)
        if _meta(pod, RESTART_ATTEMPT_KEY) != attempt or slice_index is None or index is None:
            continue
        out[int(slice_index) * per_slice + int(index)] = pod
    return out


def _host_row(h: int, pod: dict[str, Any]) -> dict[str, Any]:
    st = pod.get("status") or {}
    row: dict[str, Any] = {"host": h, "pod": pod["metadata"]["name"], "phase": st.get("phase")}
    for cs in st.get("containerStatuses") or []:
        state = cs.get("state") or {}
        if "waiting" in state:
            row["reason"] = state["waiting"].get("reason")
        elif "terminated" in state:
            term = state["terminated"]
            row |= {"reason": term.get("reason"), "exit_code": term.get("exitCode")}
            if term.get("message"):
                row["message"] = term["message"]
    return row


def _first_failed_job_message(jobs: list[dict[str, Any]]) -> str | None:
    failed = [(c.get("lastTransitionTime") or "", c) for j in jobs for c in _failed(j)]
    return min(failed, key=lambda x: x[0])[1].get("message") if failed else None


def _failed(job: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in ((job.get("status") or {}).get("conditions") or [])
            if c.get("type") == "Failed" and c.get("status") == "True"]  # fmt: skip


def _last_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1].strip() if lines else ""


def summarise(
    js: dict[str, Any], pods: list[dict[str, Any]], jobs: list[dict[str, Any]]
) -> dict[str, Any]:
    """The Backend status dict from a JobSet, its pods and (when it failed) its Jobs."""
    status = js.get("status") or {}
    conds = _conditions(js)
    spec = js["spec"]
    total = _hosts_per_slice(js) * sum(int(r.get("replicas", 1)) for r in spec["replicatedJobs"])
    hosts = [_host_row(h, p) for h, p in sorted(current_pods(js, pods).items())]
    restarts = int(status.get("restarts", 0))
    out: dict[str, Any] = {
        "jobset": js["metadata"]["name"],
        "attempt": restarts,
        "restarts_counted": int(status.get("restartsCountTowardsMax", 0)),
        "hosts": hosts,
    }
    running = sum(1 for h in hosts if h["phase"] == "Running")
    if (js.get("metadata") or {}).get("deletionTimestamp"):
        state, detail = (
            "cancelled",
            "the JobSet is being deleted; its pods got SIGTERM to checkpoint",
        )
    elif "Completed" in conds:
        state, detail = "succeeded", conds["Completed"].get("message") or "all hosts finished"
    elif "Failed" in conds:
        c = conds["Failed"]
        parts = [f"{c.get('reason')}: {c.get('message')}"]
        job_message = _first_failed_job_message(jobs)
        if job_message:
            parts.append(job_message)  # names the pod and its exit code or condition
        said = [h for h in hosts if h.get("message") and h.get("exit_code")]
        if said:
            parts.append(f"host {said[0]['host']} said: {_last_line(said[0]['message'])}")
        state, detail = "failed", "; ".join(parts)
    elif "Suspended" in conds:
        state, detail = "pending", "suspended (waiting for admission by a queue such as Kueue)"
    elif running:
        state, detail = "running", f"{running} of {total} hosts running"
    else:
        waiting = sorted({h["reason"] for h in hosts if h.get("reason")})
        detail = f"{len(hosts)} of {total} host pods created, none running yet"
        state, detail = "pending", detail + (f" ({', '.join(waiting)})" if waiting else "")
    if restarts and state in ("pending", "running"):
        detail += f"; attempt {restarts} after {restarts} restart(s)"
    return {"state": state, "detail": detail, **out}


def _same_submission(js: dict[str, Any], d: dict[str, Any]) -> bool:
    """Whether JobSet `js` is the one the handle `d` created (a handle from before uids were
    kept: taken as is)."""
    uid = (js.get("metadata") or {}).get("uid")
    return d.get("uid") is None or uid is None or uid == d["uid"]


# How the runtime's manifest status reads as a run's end.
_ENDED = {"completed": "succeeded", "interrupted": "cancelled", "failed": "failed",
          "diverged": "failed"}  # fmt: skip


def status_without_jobset(d: dict[str, Any], replaced: bool = False) -> dict[str, Any]:
    """This submission's JobSet is gone (cancelled, past its TTL, or `replaced` by a later
    submission's of the same name): the run's manifest says how it ended, if this submission
    wrote it. `ended`: no later look will say more."""
    from runfolder.storage import join, url_to_fs
    from runfolder.view import ManifestError, earlier_submission, read_manifest

    name = f"JobSet {d['namespace']}/{d['jobset']}"
    gone = (
        f"{name} is another submission's now (this one's, uid {d.get('uid')}, was deleted)"
        if replaced
        else f"{name} no longer exists (deleted, or removed by its TTL)"
    )
    uri = join(d["output_uri"], d["run_id"], MANIFEST)
    try:
        fs, path = url_to_fs(uri)
        manifest = read_manifest(fs, path, uri)
    except ManifestError as e:  # it names the file and what is wrong with it
        return {"state": "unknown", "detail": f"{gone}; {e}"}
    except Exception as e:  # storage trouble must not hide what is known; it may pass
        return {"state": "unknown", "detail": f"{gone}; reading {uri} failed: {e}"}
    if manifest is None:
        return {"state": "unknown", "detail": f"{gone}, and the run wrote no {uri}", "ended": True}
    if earlier_submission(manifest, d.get("submitted")):
        return {"state": "unknown", "detail": f"{gone}, and it wrote nothing: {uri} is an "
                f"earlier submission's (written {manifest.get('updated')})",
                "ended": True}  # fmt: skip
    status = manifest.get("status")
    return {
        "state": _ENDED.get(str(status), "unknown"),
        "detail": f"{gone}; {uri} says {status} at step {manifest.get('steps', 0)}",
        "ended": True,  # nothing is left to change it: `--wait` stops here
    }


def saved_logs(
    output_uri: str, run_id: str, *, host: int | None, tail: int | None
) -> Iterator[str]:
    """Lines of the latest attempt's host logs that every runtime host tees to
    `<output_uri>/<run_id>/logs/attempt-<n>/host-<i>.log`."""
    from launch.backends.k8s.client import K8sError
    from runfolder.storage import PARTS_SUFFIX, join, read_parted, url_to_fs

    root = join(output_uri, run_id, LOGS)
    fs, path = url_to_fs(root)
    attempts = sorted(
        (found[0], p)
        for p in (fs.ls(path, detail=False) if fs.exists(path) else [])
        if (found := parse_host_log(p)) and found[1] is None
    )
    if not attempts:
        raise K8sError(f"run {run_id} has no pods now and no saved logs under {root}")
    _, latest = attempts[-1]
    # On object stores a host log is parts, `host-<i>.log.parts/000000.log`, …: read in order.
    files = sorted(
        {
            (found[1], log)
            for p in fs.ls(latest, detail=False)
            if (found := parse_host_log(log := p.rstrip("/").removesuffix(PARTS_SUFFIX)))
            and found[1] is not None
        }
    )
    for h, p in files:
        if host is not None and h != host:
            continue
        lines = read_parted(fs, p).decode(errors="replace").splitlines()
        for line in tail_lines(lines, tail):
            yield f"[host {h}] {line}"


__all__ = ["K8sBackend", "current_pods", "saved_logs", "status_without_jobset", "summarise"]
