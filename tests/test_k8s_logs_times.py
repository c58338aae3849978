"""`launch logs --follow --since/--timestamps` on k8s: the API's own `timestamps=true` and
`sinceSeconds` for live pods, the kubelet's times shown as ours; without pods, the run folder's
recorded times. Against test_k8s_client.py's FakeApiServer, which records every request."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

pytest.importorskip(
    "kubernetes.client", reason="the k8s backend's client needs pip install 'jaxjob[k8s]'"
)

from kubernetes import client  # noqa: E402
from test_k8s_client import (  # noqa: E402
    JOBSETS,
    JS,
    NS,
    PODS,
    FakeApiServer,
    handle,
    jobset,
    launch_main,
    pod,
    pod_list,
    point_kubeconfig_at,
)

from launch.backends.k8s.backend import K8sBackend  # noqa: E402
from launch.logs_options import stamp  # noqa: E402
from launch.registry import Registry, RunRecord  # noqa: E402
from launch.state import utc_now  # noqa: E402
from runfolder.layout import line_times_record  # noqa: E402

KUBELET = "2026-12-07T23:01:0{}.{}Z"  # RFC 3339 with nanoseconds, as the kubelet writes it


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    with FakeApiServer() as server:
        yield server


@pytest.fixture
def backend(api: FakeApiServer) -> K8sBackend:
    return K8sBackend(configuration=client.Configuration(host=api.url), poll_s=0.01)


def two_live_pods(api: FakeApiServer) -> None:
    api.answer("GET", f"{JOBSETS}/{JS}", jobset())
    api.answer("GET", PODS, pod_list(pod(1), pod(0)))
    for i in (0, 1):
        body = (
            f"{KUBELET.format(2 + i, '345678901')} step 1 on {i}\n"
            f"{KUBELET.format(4 + i, '5')} WARNING: slow on {i}\n"
        )
        api.answer("GET", f"{PODS}/{JS}-slice-0-{i}-a0bcd/log", body)


def log_queries(api: FakeApiServer) -> list[dict[str, str]]:
    return [r.query for r in api.requests if r.path.endswith("/log")]


def test_follow_with_timestamps_and_since_asks_the_api_and_shows_our_times(api, backend):
    two_live_pods(api)
    lines = list(backend.timed_logs(handle(), host=None, tail=None, since_s=90, timestamps=True))
    assert sorted(lines) == sorted(
        [f"2026-12-07T23:01:0{2 + i}.345Z [host {i}] step 1 on {i}" for i in (0, 1)]
        + [f"2026-12-07T23:01:0{4 + i}.500Z [host {i}] WARNING: slow on {i}" for i in (0, 1)]
    )
    asked = {"container": "worker", "follow": "true", "timestamps": "true", "sinceSeconds": "90"}
    assert log_queries(api) == [asked, asked]


def test_follow_with_since_only_asks_for_whole_seconds_and_no_times(api, backend):
    two_live_pods(api)
    lines = list(backend.timed_logs(handle(), host=1, tail=3, since_s=90.2, timestamps=False))
    assert lines == [
        f"[host 1] {KUBELET.format(3, '345678901')} step 1 on 1",  # the body as the server sent it
        f"[host 1] {KUBELET.format(5, '5')} WARNING: slow on 1",
    ]
    assert log_queries(api) == [
        {"container": "worker", "follow": "true", "tailLines": "3", "sinceSeconds": "91"}
    ]


def test_follow_without_pods_reads_the_run_folders_times(api, backend, tmp_path):
    now = time.time()
    folder = tmp_path / JS / "logs" / "attempt-0"
    folder.mkdir(parents=True)
    (folder / "host-0.log").write_text("old\nnew\n")
    times = line_times_record(1, now - 3600) + line_times_record(2, now - 30)
    (folder / "host-0.log.times").write_bytes(times)
    lines = list(
        backend.timed_logs(handle(str(tmp_path)), host=None, tail=None, since_s=60, timestamps=True)
    )
    assert lines == [f"{stamp(now - 30)} [host 0] new"]
    # Without the options, the saved logs as before: the sidecar is not a host log.
    plain = list(backend.logs(handle(str(tmp_path)), host=None, follow=False, tail=None))
    assert plain == ["[host 0] old", "[host 0] new"]
    assert not log_queries(api)


def test_launch_logs_follow_timestamps_through_the_cli(api, tmp_path, monkeypatch, capsys):
    """The whole command: the registry's k8s run, the kubeconfig's cluster (the fake server),
    the quiet view over stamped lines (a warning both hosts said: once, at the earlier time)."""
    point_kubeconfig_at(api, tmp_path, monkeypatch)
    registry = Registry(tmp_path / "state" / "jaxjob")
    registry.run_dir(JS).mkdir(parents=True)
    data = {"namespace": NS, "jobset": JS, "context": "fake", "output_uri": str(tmp_path),
            "run_id": JS}  # fmt: skip
    registry.record(RunRecord(JS, "k8s", data, str(tmp_path), utc_now(), "job.yaml"))
    api.answer("GET", f"{JOBSETS}/{JS}", jobset())
    api.answer("GET", PODS, pod_list(pod(1), pod(0)))
    for i in (0, 1):
        body = f"{KUBELET.format(2 + i, '1')} step 1\n{KUBELET.format(6 - i, '2')} WARNING: slow\n"
        api.answer("GET", f"{PODS}/{JS}-slice-0-{i}-a0bcd/log", body)

    assert launch_main("logs", JS, "--follow", "--timestamps", "--since", "2m") == 0

    out = capsys.readouterr().out.splitlines()
    assert out == [
        "2026-12-07T23:01:02.100Z [host 0] step 1",
        "2026-12-07T23:01:05.200Z [2 hosts: 0,1] WARNING: slow",  # host 1 said it first
    ]
    assert {q.get("sinceSeconds") for q in log_queries(api)} == {"120"}
    assert {q.get("timestamps") for q in log_queries(api)} == {"true"}
