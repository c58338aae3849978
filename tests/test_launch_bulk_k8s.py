"""`launch list/cancel/clean --backend k8s` against a fake API server (tests/test_k8s_client.py's):
the JobSets jaxjob made in a namespace are listed with their state even when this machine's
registry has never seen them; clean deletes only the finished ones, cancel only the running."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

pytest.importorskip("kubernetes.client", reason="the k8s backend's client needs jaxjob[k8s]")

from test_k8s_client import (  # noqa: E402
    CONFIGMAPS,
    JOBSETS,
    NS,
    PODS,
    FakeApiServer,
    jobset,
    launch_main,
    pod,
    pod_list,
    point_kubeconfig_at,
)

SELECTOR = "app.kubernetes.io/managed-by=jaxjob"


def _named(obj: dict, name: str) -> dict:
    """A test_k8s_client JobSet or pod, renamed from its run to run `name`."""
    out = json.loads(json.dumps(obj).replace("llm-v5e-abc123", name))
    out["metadata"].setdefault("labels", {}).update({"jaxjob/run-id": name, **_managed()})
    return out


def _managed() -> dict[str, str]:
    return {"app.kubernetes.io/managed-by": "jaxjob"}


def _js(name: str, created: str, status: dict | None = None) -> dict[str, Any]:
    js = _named(jobset(status, uid=f"uid-{name}", creationTimestamp=created), name)
    container = {"name": "worker",
                 "env": [{"name": "JAXJOB_OUTPUT_URI", "value": "gs://bucket/runs"}]}  # fmt: skip
    js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"] = {
        "spec": {"containers": [copy.deepcopy(container)]}
    }
    return js


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    """The fake API server as the current kube context; an empty registry under tmp_path."""
    with FakeApiServer() as api:
        point_kubeconfig_at(api, tmp_path, monkeypatch)
        running = _js("train-a1", "2026-12-07T10:00:00Z")
        done = _js("train-b2", "2026-12-07T09:00:00Z", {"conditions": [
            {"type": "Completed", "status": "True", "message": "jobset completed"}]})  # fmt: skip
        api.answer("GET", JOBSETS, {"items": [done, running]})
        api.answer("GET", PODS, pod_list(*(_named(pod(i), "train-a1") for i in range(4))))
        yield api


def test_list_shows_the_namespaces_jaxjob_jobsets(cluster, capsys):
    assert launch_main("list", "--backend", "k8s", "--namespace", NS, "--json") == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["run_id"], r["state"], r["submitted_here"], r["where"]) for r in rows] == [
        ("train-a1", "running", False, f"k8s {NS}/train-a1"),
        ("train-b2", "succeeded", False, f"k8s {NS}/train-b2"),
    ]
    listed = [r for r in cluster.requests if r.method == "GET"]
    assert {(r.path, r.query.get("labelSelector")) for r in listed} == {
        (JOBSETS, SELECTOR), (PODS, SELECTOR)
    }  # fmt: skip
    assert launch_main("list", "--backend", "k8s", "--namespace", NS, "--status", "running") == 0
    out = capsys.readouterr().out.splitlines()
    assert [ln.split()[:3] for ln in out[1:]] == [["train-a1", "k8s", "running"]]


def test_list_all_namespaces_asks_the_cluster_wide_paths(cluster, capsys):
    cluster.answer("GET", "/apis/jobset.x-k8s.io/v1alpha2/jobsets", {"items": []})
    cluster.answer("GET", "/api/v1/pods", pod_list())
    assert launch_main("list", "--backend", "k8s", "-A") == 0
    assert capsys.readouterr().out.strip() == "no runs match"
    assert [p for _, p in cluster.calls("GET")] == [
        "/api/v1/pods",
        "/apis/jobset.x-k8s.io/v1alpha2/jobsets",
    ]


def test_clean_deletes_the_finished_jobset_only(cluster, capsys):
    cluster.answer("GET", f"{JOBSETS}/train-b2", _js("train-b2", "2026-12-07T09:00:00Z"))
    cluster.answer("DELETE", f"{JOBSETS}/train-b2", {"kind": "Status"})
    cluster.answer("DELETE", f"{CONFIGMAPS}/train-b2-config", {"kind": "Status"})
    assert launch_main("clean", "--backend", "k8s", "--namespace", NS, "--yes") == 0
    out, err = capsys.readouterr()
    assert f"deleted JobSet {NS}/train-b2 (train-b2)" in out
    assert cluster.calls("DELETE") == [
        ("DELETE", f"{JOBSETS}/train-b2"), ("DELETE", f"{CONFIGMAPS}/train-b2-config")
    ]  # fmt: skip
    assert "and 1 finished JobSet(s) from the cluster" in err


def test_cancel_all_deletes_the_running_jobset_only(cluster, capsys):
    cluster.answer("DELETE", f"{JOBSETS}/train-a1", {"kind": "Status"})
    cluster.answer("DELETE", f"{CONFIGMAPS}/train-a1-config", {"kind": "Status"})
    assert launch_main("cancel", "--all", "--backend", "k8s", "--namespace", NS, "--yes") == 0
    assert "cancel sent to train-a1" in capsys.readouterr().out
    assert cluster.calls("DELETE") == [
        ("DELETE", f"{JOBSETS}/train-a1"), ("DELETE", f"{CONFIGMAPS}/train-a1-config")
    ]  # fmt: skip
    delete = next(r for r in cluster.requests if r.method == "DELETE")
    assert delete.body["propagationPolicy"] == "Foreground"  # graceful: pods get SIGTERM
