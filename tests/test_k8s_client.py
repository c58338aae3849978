"""A contract test for our Kubernetes client code, not a cluster.

A small `http.server` on 127.0.0.1 answers the REST paths K8sBackend uses (ConfigMap and JobSet
create/get/delete, Job and pod lists, pod logs) from canned answers, and records every request.
The tests assert the exact requests the official `kubernetes` client sends for our calls (paths,
bodies, label selectors, propagation policy) and what the backend makes of the answers. Whether
a real API server and the JobSet controller behave as those answers say is outside this test:
that is what the schemas (test_k8s_render.py) and the pod-level run (test_k8s_pods.py) cover.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import pytest

client = pytest.importorskip(
    "kubernetes.client", reason="the k8s backend's client needs pip install 'jaxjob[k8s]'"
)

import yaml  # noqa: E402

from jobspec.files.job_yaml import load_job, run_with_id  # noqa: E402
from launch import cli as launch_cli  # noqa: E402
from launch.backend import Handle, Submission  # noqa: E402
from launch.backends.k8s.backend import K8sBackend  # noqa: E402
from launch.backends.k8s.client import K8sError  # noqa: E402
from launch.backends.k8s.render import render_manifests  # noqa: E402

SPECS = Path(__file__).resolve().parent / "k8s_specs"
NS, JS = "ml", "llm-v5e-abc123"
CM = f"{JS}-config"
SELECTOR = f"jobset.sigs.k8s.io/jobset-name={JS}"
JOBSETS = f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{NS}/jobsets"
CONFIGMAPS = f"/api/v1/namespaces/{NS}/configmaps"
PODS = f"/api/v1/namespaces/{NS}/pods"
JOBS = f"/apis/batch/v1/namespaces/{NS}/jobs"


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, str]
    body: Any
    content_type: str | None
    authorization: str | None


class FakeApiServer:
    """Canned answers by (method, path); anything else is a Kubernetes-style 404."""

    def __init__(self) -> None:
        self.answers: dict[tuple[str, str], list[tuple[int, Any]]] = {}
        self.requests: list[Request] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self._server.server_port}"
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        self._server.serve_forever(poll_interval=0.02)  # a quick shutdown in every teardown

    def answer(self, method: str, path: str, body: Any = None, status: int = 200) -> None:
        self.answers.setdefault((method, path), []).append((status, body))

    def _next(self, method: str, path: str) -> tuple[int, Any]:
        """Answers given for one path are used in turn; the last one repeats."""
        queue = self.answers.get((method, path)) or [(404, None)]
        return queue.pop(0) if len(queue) > 1 else queue[0]

    def calls(self, method: str | None = None) -> list[tuple[str, str]]:
        return [(r.method, r.path) for r in self.requests if method in (None, r.method)]

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        api = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self) -> None:
                url = urlsplit(self.path)
                size = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(size) if size else b""
                api.requests.append(
                    Request(self.command, url.path, dict(parse_qsl(url.query)),
                            json.loads(raw) if raw else None, self.headers.get("Content-Type"),
                            self.headers.get("Authorization"))
                )  # fmt: skip
                status, body = api._next(self.command, url.path)
                if status == 404 and body is None:
                    body = {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                            "message": f"{url.path} not found", "reason": "NotFound", "code": 404}  # fmt: skip
                if isinstance(body, str):  # pod logs are plain text
                    data, ctype = body.encode(), "text/plain"
                else:
                    data, ctype = json.dumps(body or {}).encode(), "application/json"
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PATCH = do_DELETE = _serve

            def log_message(self, *args: Any) -> None:
                pass

        return Handler

    def __enter__(self) -> FakeApiServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    with FakeApiServer() as server:
        yield server


@pytest.fixture
def backend(api: FakeApiServer) -> K8sBackend:
    return K8sBackend(configuration=client.Configuration(host=api.url), poll_s=0.01)


@pytest.fixture
def sub() -> Submission:
    job = load_job(SPECS / "tpu-v5e-16.yaml")
    run, toml = run_with_id(job, JS)
    return Submission(job.spec, JS, toml, job.spec_yaml, run.run.output_uri, job.path.parent)


def handle(output_uri: str = "/nonexistent/jaxjob-runs") -> Handle:
    return Handle("k8s", {"namespace": NS, "jobset": JS, "context": None,
                          "output_uri": output_uri, "run_id": JS})  # fmt: skip


def jobset(status: dict | None = None, **meta: Any) -> dict:
    """The JobSet as the API server returns it: our spec (4 hosts in 1 slice) plus status."""
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
        "metadata": {"name": JS, "namespace": NS, "uid": "js-uid", **meta},
        "spec": {"replicatedJobs": [{"name": "slice", "replicas": 1,
                                     "template": {"spec": {"completions": 4}}}]},
        "status": status or {},
    }  # fmt: skip


def pod(index: int, phase: str = "Running", attempt: int = 0, state: dict | None = None) -> dict:
    keys = {"jobset.sigs.k8s.io/job-global-index": "0",
            "jobset.sigs.k8s.io/restart-attempt": str(attempt),
            "batch.kubernetes.io/job-completion-index": str(index)}  # fmt: skip
    return {
        "metadata": {"name": f"{JS}-slice-0-{index}-a{attempt}bcd",
                     "labels": {"jobset.sigs.k8s.io/jobset-name": JS, **keys}, "annotations": keys},
        "status": {"phase": phase,
                   "containerStatuses": [{"name": "worker", "state": state or {"running": {}}}]},
    }  # fmt: skip


def pod_list(*pods: dict) -> dict:
    return {"kind": "PodList", "apiVersion": "v1", "items": list(pods)}


# ---- submit ----------------------------------------------------------------------------------


def test_submit_creates_the_configmap_then_the_jobset_and_ties_them(api, backend, sub):
    m = render_manifests(sub)
    api.answer("POST", CONFIGMAPS, m.configmap, 201)
    made = {**m.jobset["metadata"], "uid": "u-1", "creationTimestamp": "2026-01-02T03:04:05Z"}
    api.answer("POST", JOBSETS, {**m.jobset, "metadata": made}, 201)
    api.answer("PATCH", f"{CONFIGMAPS}/{CM}", m.configmap)

    h = backend.submit(sub)

    assert h.backend == "k8s"
    # The JobSet's uid and creation time: what tells this submission from an earlier one.
    assert h.data == {"namespace": NS, "jobset": JS, "context": None,
                      "output_uri": "gs://jaxjob-runs/k8s", "run_id": JS, "uid": "u-1",
                      "submitted": "2026-01-02T03:04:05Z"}  # fmt: skip
    assert api.calls() == [("POST", CONFIGMAPS), ("POST", JOBSETS), ("PATCH", f"{CONFIGMAPS}/{CM}")]
    create_cm, create_js, patch = api.requests
    assert create_cm.body == m.configmap and create_cm.content_type == "application/json"
    assert create_js.body == m.jobset and create_js.content_type == "application/json"
    assert patch.content_type == "application/merge-patch+json"
    assert patch.body == {"metadata": {"ownerReferences": [
        {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "name": JS, "uid": "u-1"}]}}  # fmt: skip


def test_submit_removes_the_configmap_when_the_jobset_is_refused(api, backend, sub):
    api.answer("POST", CONFIGMAPS, {}, 201)
    api.answer("DELETE", f"{CONFIGMAPS}/{CM}", {"kind": "Status", "status": "Success"})
    # JOBSETS is not answered: a 404, as from a cluster without the JobSet CRD.
    with pytest.raises(K8sError) as e:
        backend.submit(sub)
    assert f"creating JobSet {NS}/{JS}: the API server answered 404" in str(e.value)
    assert "JobSet (jobset.x-k8s.io/v1alpha2) is installed" in str(e.value)
    assert api.calls() == [
        ("POST", CONFIGMAPS),
        ("POST", JOBSETS),
        ("DELETE", f"{CONFIGMAPS}/{CM}"),
    ]


def test_submit_stops_at_an_existing_configmap(api, backend, sub):
    conflict = {"kind": "Status", "status": "Failure", "reason": "AlreadyExists", "code": 409,
                "message": f'configmaps "{CM}" already exists'}  # fmt: skip
    api.answer("POST", CONFIGMAPS, conflict, 409)
    with pytest.raises(K8sError, match=f'409 Conflict: configmaps "{CM}" already exists'):
        backend.submit(sub)
    assert api.calls() == [("POST", CONFIGMAPS)]


def test_an_api_client_can_be_passed_in(api, sub):
    m = render_manifests(sub)
    api.answer("POST", CONFIGMAPS, m.configmap, 201)
    api.answer("POST", JOBSETS, m.jobset, 201)  # no uid: the ConfigMap simply stays unowned
    b = K8sBackend(api_client=client.ApiClient(client.Configuration(host=api.url)))
    assert b.submit(sub).data["jobset"] == JS
    assert api.calls() == [("POST", CONFIGMAPS), ("POST", JOBSETS)]


def test_kubeconfig_context_is_used_and_pinned(api, sub, tmp_path, monkeypatch):
    """No configuration given: the kubeconfig's current context, recorded in the handle."""
    kubeconfig = {
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "c", "cluster": {"server": api.url}}],
        "users": [{"name": "u", "user": {"token": "t0ken"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "c", "user": "u"}}],
    }  # fmt: skip
    (tmp_path / "config").write_text(json.dumps(kubeconfig))
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "config"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    m = render_manifests(sub)
    api.answer("POST", CONFIGMAPS, m.configmap, 201)
    api.answer("POST", JOBSETS, m.jobset, 201)
    assert K8sBackend().submit(sub).data["context"] == "fake"
    assert {r.authorization for r in api.requests} == {"Bearer t0ken"}
    with pytest.raises(K8sError, match="cannot load Kubernetes credentials for context 'nope'"):
        K8sBackend(context="nope").status(handle())


def test_an_unreachable_server_is_one_sentence(sub):
    cfg = client.Configuration(host="http://127.0.0.1:9")  # discard port: nothing listens
    cfg.retries = 0
    with pytest.raises(K8sError, match=r"^reading JobSet ml/.*cannot reach the API server at"):
        K8sBackend(configuration=cfg).status(handle())


# ---- status ----------------------------------------------------------------------------------


def test_status_running_reads_jobset_conditions_and_current_pods(api, backend):
    api.answer("GET", f"{JOBSETS}/{JS}", jobset({"restarts": 1, "restartsCountTowardsMax": 0}))
    old = pod(2, "Failed", attempt=0, state={"terminated": {"exitCode": 42, "reason": "Error"}})
    api.answer("GET", PODS, pod_list(old, *(pod(i, attempt=1) for i in range(4))))

    st = backend.status(handle())

    assert st["state"] == "running"
    assert st["detail"] == "4 of 4 hosts running; attempt 1 after 1 restart(s)"
    assert (st["attempt"], st["restarts_counted"]) == (1, 0)  # a preemption: not counted
    assert [(h["host"], h["phase"]) for h in st["hosts"]] == [(i, "Running") for i in range(4)]
    assert api.calls() == [("GET", f"{JOBSETS}/{JS}"), ("GET", PODS)]
    assert api.requests[1].query == {"labelSelector": SELECTOR}


def test_status_failed_keeps_the_failing_pods_message(api, backend):
    failed = {"type": "Failed", "status": "True", "reason": "FailJobSetAction",
              "message": f"jobset failed due to FailJobSet action (first failed job: {JS}-slice-0)"}  # fmt: skip
    api.answer("GET", f"{JOBSETS}/{JS}", jobset({"conditions": [failed]}))
    job_failed = {"type": "Failed", "status": "True", "reason": "PodFailurePolicy",
                  "lastTransitionTime": "2026-01-01T00:00:00Z",
                  "message": f"Container worker for pod {NS}/{JS}-slice-0-1-a0bcd failed with "
                             "exit code 2 matching FailJob rule at index 2"}  # fmt: skip
    api.answer(
        "GET", JOBS, {"kind": "JobList", "items": [{"status": {"conditions": [job_failed]}}]}
    )
    term = {"terminated": {"exitCode": 2, "reason": "Error",
                           "message": "training...\njaxjob: data.manifest: gs://x not found\n"}}  # fmt: skip
    api.answer("GET", PODS, pod_list(pod(0), pod(1, "Failed", state=term)))

    st = backend.status(handle())

    assert st["state"] == "failed"
    assert st["detail"] == (
        f"FailJobSetAction: jobset failed due to FailJobSet action (first failed job: {JS}-slice-0); "
        f"Container worker for pod {NS}/{JS}-slice-0-1-a0bcd failed with exit code 2 matching "
        "FailJob rule at index 2; host 1 said: jaxjob: data.manifest: gs://x not found"
    )
    assert st["hosts"][1] | {"message": "-"} == {
        "host": 1, "pod": f"{JS}-slice-0-1-a0bcd", "phase": "Failed", "reason": "Error",
        "exit_code": 2, "message": "-"}  # fmt: skip
    assert ("GET", JOBS) in api.calls()
    assert [r.query for r in api.requests if r.path == JOBS] == [{"labelSelector": SELECTOR}]


@pytest.mark.parametrize(
    "status, meta, pods, state, detail",
    [
        ({"conditions": [{"type": "Completed", "status": "True", "message": "jobset completed successfully"}]},
         {}, [], "succeeded", "jobset completed successfully"),
        ({"conditions": [{"type": "Suspended", "status": "True"}]}, {}, [], "pending",
         "suspended (waiting for admission by a queue such as Kueue)"),
        ({}, {"deletionTimestamp": "2026-01-01T00:00:00Z"}, [pod(0)], "cancelled",
         "the JobSet is being deleted; its pods got SIGTERM to checkpoint"),
        ({}, {}, [pod(0, "Pending", state={"waiting": {"reason": "ImagePullBackOff"}})], "pending",
         "1 of 4 host pods created, none running yet (ImagePullBackOff)"),
        ({"conditions": [{"type": "Suspended", "status": "False"}]}, {}, [pod(0), pod(1, "Pending")],
         "running", "1 of 4 hosts running"),
    ],
)  # fmt: skip
def test_status_states(api, backend, status, meta, pods, state, detail):
    api.answer("GET", f"{JOBSETS}/{JS}", jobset(status, **meta))
    api.answer("GET", PODS, pod_list(*pods))
    st = backend.status(handle())
    assert (st["state"], st["detail"]) == (state, detail)
    assert ("GET", JOBS) not in api.calls()


def write_manifest(run_dir: Path, status: str, updated: str, steps: int = 7) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "manifest.json").write_text(
        json.dumps({"status": status, "steps": steps, "updated": updated})
    )


@pytest.mark.parametrize("status, state", [("completed", "succeeded"), ("interrupted", "cancelled"),
                                           ("failed", "failed"), (None, "unknown")])  # fmt: skip
def test_status_when_the_jobset_is_gone_reads_the_runs_manifest(
    api, backend, tmp_path, status, state
):
    if status:
        write_manifest(tmp_path / JS, status, "2026-01-01T00:00:00.000+00:00")
    st = backend.status(handle(str(tmp_path)))
    assert st["state"] == state and st["ended"]  # nothing will change it: --wait stops
    assert st["detail"].startswith(
        f"JobSet {NS}/{JS} no longer exists (deleted, or removed by its TTL)"
    )
    assert api.calls() == [("GET", f"{JOBSETS}/{JS}")]


def test_status_when_the_jobset_is_gone_ignores_an_earlier_submissions_records(
    api, backend, tmp_path
):
    """A resubmitted run (fixed run_id) whose JobSet is gone before its hosts wrote anything
    (refused at boot, then removed by its TTL): the earlier submission's `completed` records are
    not this one's end."""
    write_manifest(tmp_path / JS, "completed", "2026-01-01T00:00:00.000+00:00", steps=300)
    final = tmp_path / JS / "summaries" / "final.json"
    final.parent.mkdir(parents=True)
    final.write_text(json.dumps({"status": "completed", "steps": 300}))
    h = handle(str(tmp_path))
    h.data.update(uid="u-2", submitted="2026-01-02T00:00:00Z")
    st = backend.status(h)
    assert st["state"] == "unknown" and st["ended"], st
    assert "it wrote nothing" in st["detail"] and "an earlier submission's" in st["detail"]
    # What it wrote once it booted is its own.
    write_manifest(tmp_path / JS, "failed", "2026-01-02T00:00:30.000+00:00", steps=300)
    assert backend.status(h)["state"] == "failed"


def test_status_of_a_jobset_of_another_submission_is_not_followed(api, backend, tmp_path):
    """The JobSet of the handle's name has another uid (the run was resubmitted elsewhere): its
    state is that submission's, not the handle's."""
    api.answer("GET", f"{JOBSETS}/{JS}", jobset({"conditions": [
        {"type": "Completed", "status": "True", "message": "jobset completed successfully"}]}))  # fmt: skip
    h = handle(str(tmp_path))
    h.data.update(uid="mine", submitted="2026-01-02T00:00:00Z")
    st = backend.status(h)
    assert st["state"] == "unknown", st
    assert st["detail"].startswith(f"JobSet {NS}/{JS} is another submission's now")
    assert api.calls() == [("GET", f"{JOBSETS}/{JS}")]  # its pods are not ours either


# ---- `launch submit` of a fixed run_id, through the CLI ---------------------------------------


def point_kubeconfig_at(api: FakeApiServer, tmp_path: Path, monkeypatch) -> None:
    """The kube context "fake" at the fake API server, as the current one; the registry under
    tmp_path/state."""
    kubeconfig = {
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "c", "cluster": {"server": api.url}}],
        "users": [{"name": "u", "user": {"token": "t0ken"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "c", "user": "u"}}],
    }  # fmt: skip
    (tmp_path / "kubeconfig").write_text(json.dumps(kubeconfig))
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "kubeconfig"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)


@pytest.fixture
def job_yaml(api, tmp_path, monkeypatch) -> Path:
    """A job spec with run_id fixed to JS, its artifacts under tmp_path/runs; the kubeconfig
    points at the fake API server and the registry is under tmp_path."""
    point_kubeconfig_at(api, tmp_path, monkeypatch)
    spec = yaml.safe_load((SPECS / "tpu-v5e-16.yaml").read_text())
    spec.update(run_id=JS, run=str(SPECS / "tpu-v5e-16.toml"), output_uri=str(tmp_path / "runs"))
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def answer_submit(api: FakeApiServer, uid: str, created: str) -> None:
    m = render_manifests(load_sub(JS))
    api.answer("POST", CONFIGMAPS, m.configmap, 201)
    made = {**m.jobset["metadata"], "uid": uid, "creationTimestamp": created}
    api.answer("POST", JOBSETS, {**m.jobset, "metadata": made}, 201)
    api.answer("PATCH", f"{CONFIGMAPS}/{CM}", m.configmap)


def load_sub(run_id: str) -> Submission:
    job = load_job(SPECS / "tpu-v5e-16.yaml")
    run, toml = run_with_id(job, run_id)
    return Submission(job.spec, run_id, toml, job.spec_yaml, run.run.output_uri, job.path.parent)


def launch_main(*args: str) -> int:
    try:
        launch_cli.main(list(args))
    except SystemExit as e:
        return int(e.code or 0)
    return 0


def test_a_second_submit_of_a_running_run_is_refused_before_anything_is_sent(
    api, job_yaml, tmp_path, capsys
):
    answer_submit(api, "u-1", "2026-01-02T03:04:05Z")
    assert launch_main("submit", str(job_yaml), "--backend", "k8s") == 0
    record = tmp_path / "state" / "jaxjob" / "runs" / JS / "record.json"
    first = record.read_text()
    api.answer("GET", f"{JOBSETS}/{JS}", jobset(uid="u-1"))
    api.answer("GET", PODS, pod_list(pod(0), pod(1)))
    sent = len(api.requests)
    capsys.readouterr()

    assert launch_main("submit", str(job_yaml), "--backend", "k8s") == 2
    err = capsys.readouterr().err
    assert err == (
        f"error: run {JS} is already running (attempt 0, started "
        f"{json.loads(first)['submitted'][:19].replace('T', ' ')} UTC); launch cancel {JS} "
        "first or use another run_id\n"
    )
    assert {r.method for r in api.requests[sent:]} == {"GET"}  # nothing created, nothing deleted
    assert record.read_text() == first  # the state a user sees is the running submission's


def test_resubmit_wait_never_reports_an_earlier_submissions_end(api, job_yaml, tmp_path, capsys):
    """The earlier submission completed; the new JobSet is gone before its hosts wrote anything
    (refused at boot, removed by its TTL): `--wait` must not say `succeeded`."""
    run_dir = tmp_path / "runs" / JS
    write_manifest(run_dir, "completed", "2026-01-01T00:00:00.000+00:00", steps=300)
    (run_dir / "summaries").mkdir()
    (run_dir / "summaries" / "final.json").write_text(json.dumps({"status": "completed"}))
    answer_submit(api, "u-1", "2025-12-31T00:00:00Z")  # answers are given in turn
    answer_submit(api, "u-2", "2026-01-02T00:00:00Z")  # every GET of the JobSet: 404
    assert launch_main("submit", str(job_yaml), "--backend", "k8s") == 0
    capsys.readouterr()

    assert launch_main("submit", str(job_yaml), "--backend", "k8s", "--wait", "--json") == 1
    info = json.loads(capsys.readouterr().out)
    assert info["state"] == "unknown", info
    assert "it wrote nothing" in info["detail"] and "an earlier submission's" in info["detail"]
    assert info["progress"]["note"].startswith("no progress from this submission yet")
    assert api.calls("POST") == [("POST", CONFIGMAPS), ("POST", JOBSETS)] * 2


# ---- logs ------------------------------------------------------------------------------------


def test_logs_prefix_every_host_and_pass_tail(api, backend):
    api.answer("GET", f"{JOBSETS}/{JS}", jobset())
    api.answer("GET", PODS, pod_list(pod(1), pod(0)))
    for i in (0, 1):
        api.answer("GET", f"{PODS}/{JS}-slice-0-{i}-a0bcd/log", f"step 1 on {i}\nstep 2 on {i}\n")

    lines = list(backend.logs(handle(), host=None, follow=False, tail=5))

    assert lines == ["[host 0] step 1 on 0", "[host 0] step 2 on 0",
                     "[host 1] step 1 on 1", "[host 1] step 2 on 1"]  # fmt: skip
    logs = [r for r in api.requests if r.path.endswith("/log")]
    assert [r.query for r in logs] == [
        {"container": "worker", "follow": "false", "tailLines": "5"}
    ] * 2
    assert [r.query for r in api.requests if r.path == PODS] == [{"labelSelector": SELECTOR}]


WAITING = {"kind": "Status", "status": "Failure", "reason": "BadRequest", "code": 400,
           "message": 'container "worker" in pod "p" is waiting to start: ContainerCreating'}  # fmt: skip


def test_logs_follow_one_host_waits_for_its_container(api, backend):
    api.answer("GET", f"{JOBSETS}/{JS}", jobset())
    api.answer("GET", PODS, pod_list(*(pod(i) for i in range(4))))
    api.answer("GET", f"{PODS}/{JS}-slice-0-3-a0bcd/log", WAITING, 400)
    api.answer("GET", f"{PODS}/{JS}-slice-0-3-a0bcd/log", "a\nb")

    lines = list(backend.logs(handle(), host=3, follow=True, tail=None))

    assert lines == ["[host 3] a", "[host 3] b"]
    logs = [r for r in api.requests if r.path.endswith("/log")]
    assert [r.path for r in logs] == [f"{PODS}/{JS}-slice-0-3-a0bcd/log"] * 2
    assert logs[-1].query == {"container": "worker", "follow": "true"}


def test_logs_of_a_pod_not_started_say_so(api, backend):
    api.answer("GET", f"{JOBSETS}/{JS}", jobset())
    api.answer("GET", PODS, pod_list(pod(0, "Pending")))
    api.answer("GET", f"{PODS}/{JS}-slice-0-0-a0bcd/log", WAITING, 400)
    (line,) = backend.logs(handle(), host=None, follow=False, tail=None)
    assert line.startswith(f"[host 0] (no log from pod {JS}-slice-0-0-a0bcd, Pending: ")
    assert "is waiting to start: ContainerCreating" in line


def test_logs_follow_every_host_at_once(api, backend):
    api.answer("GET", f"{JOBSETS}/{JS}", jobset())
    api.answer("GET", PODS, pod_list(*(pod(i) for i in range(4))))
    for i in range(4):
        api.answer("GET", f"{PODS}/{JS}-slice-0-{i}-a0bcd/log", f"x{i}\ny{i}\n")
    lines = list(backend.logs(handle(), host=None, follow=True, tail=None))
    assert sorted(lines) == sorted(f"[host {i}] {t}{i}" for i in range(4) for t in "xy")
    assert lines.index("[host 2] x2") < lines.index("[host 2] y2")


def test_logs_fall_back_to_the_runs_saved_logs(api, backend, tmp_path):
    for attempt, text in ((0, "old\n"), (1, "first\nlast\n")):
        for i in (0, 1):
            f = tmp_path / JS / "logs" / f"attempt-{attempt}" / f"host-{i}.log"
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(text.replace("last", f"last {i}"))
    # The JobSet is gone (404) and so are its pods.
    lines = list(backend.logs(handle(str(tmp_path)), host=None, follow=False, tail=1))
    assert lines == ["[host 0] last 0", "[host 1] last 1"]
    assert list(backend.logs(handle(str(tmp_path)), host=None, follow=False, tail=0)) == []
    one = list(backend.logs(handle(str(tmp_path)), host=1, follow=True, tail=None))
    assert one == ["[host 1] first", "[host 1] last 1"]
    assert not [r for r in api.requests if r.path.endswith("/log")]
    with pytest.raises(K8sError, match="has no pods now and no saved logs under"):
        list(backend.logs(handle(str(tmp_path / "nothing")), host=None, follow=False, tail=None))


# ---- cancel ----------------------------------------------------------------------------------


def test_cancel_deletes_the_jobset_in_the_foreground_then_the_configmap(api, backend):
    api.answer("DELETE", f"{JOBSETS}/{JS}", {"kind": "Status", "status": "Success"})
    api.answer("DELETE", f"{CONFIGMAPS}/{CM}", {"kind": "Status", "status": "Success"})
    backend.cancel(handle())
    assert api.calls() == [("DELETE", f"{JOBSETS}/{JS}"), ("DELETE", f"{CONFIGMAPS}/{CM}")]
    assert api.requests[0].body == {"propagationPolicy": "Foreground"}
    assert api.requests[0].content_type == "application/json"


def test_cancel_of_a_run_already_gone_is_quiet(api, backend):
    backend.cancel(handle())  # both 404
    assert api.calls("DELETE") == [("DELETE", f"{JOBSETS}/{JS}"), ("DELETE", f"{CONFIGMAPS}/{CM}")]


def test_forbidden_names_the_request_and_rbac(api, backend):
    denied = {"kind": "Status", "status": "Failure", "reason": "Forbidden", "code": 403,
              "message": 'jobsets.jobset.x-k8s.io "x" is forbidden'}  # fmt: skip
    api.answer("DELETE", f"{JOBSETS}/{JS}", denied, 403)
    with pytest.raises(K8sError) as e:
        backend.cancel(handle())
    assert str(e.value) == (
        f"deleting JobSet {NS}/{JS}: the API server answered 403 Forbidden: "
        'jobsets.jobset.x-k8s.io "x" is forbidden; your account lacks the RBAC permission for it'
    )
    assert e.value.status == 403
