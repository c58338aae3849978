"""The few Kubernetes API calls the backend makes, through the official `kubernetes` client.

Objects go in and come out as plain dicts (the JSON the API server speaks), so the backend and
its tests never depend on the client's model classes. Every API failure becomes a K8sError with
one sentence naming what was asked and what the server said.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from typing import Any

from jobspec.errors import JaxjobError
from jobspec.extras import require

# Rendering needs no client; talking to a cluster does (the `k8s` extra): one sentence if absent.
require({"kubernetes": "kubernetes"}, "k8s", "talking to a cluster (--backend k8s)")
from kubernetes import client, config  # noqa: E402
from kubernetes.client.exceptions import ApiException  # noqa: E402
from urllib3.exceptions import HTTPError  # noqa: E402

JOBSET_GROUP, JOBSET_VERSION, JOBSET_PLURAL = "jobset.x-k8s.io", "v1alpha2", "jobsets"
# The client leaves Content-Type unset on POST/DELETE bodies (the server assumes JSON); say it.
JSON_BODY = {"Content-Type": "application/json"}
_HINTS = {
    401: "; check your credentials (kubeconfig or --context)",
    403: "; your account lacks the RBAC permission for it",
}


class K8sError(JaxjobError):
    """The cluster refused or could not be reached; `status` is the HTTP status, if any."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def connect(
    context: str | None = None, configuration: client.Configuration | None = None
) -> tuple[client.ApiClient, str | None]:
    """An ApiClient and the kube context it uses: `configuration` if given, else the kubeconfig
    (`context`, or its current one), else the pod's service account when run in a cluster."""
    if configuration is not None:
        return client.ApiClient(configuration), context
    cfg = client.Configuration()
    if context is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        try:
            config.load_incluster_config(client_configuration=cfg)
            return client.ApiClient(cfg), None
        except config.ConfigException:
            pass  # e.g. no service-account token mounted: try a kubeconfig
    # Read KUBECONFIG now: the client reads it once, when it is imported.
    path = os.environ.get("KUBECONFIG") or None
    try:
        config.load_kube_config(config_file=path, context=context, client_configuration=cfg)
        if context is None:  # pin the context, so later status/logs reach the same cluster
            _, active = config.list_kube_config_contexts(config_file=path)
            context = active.get("name") if active else None
    except (config.ConfigException, OSError) as e:
        where = f"context {context!r}" if context else "the current context"
        raise K8sError(
            f"cannot load Kubernetes credentials for {where} ({e}); check KUBECONFIG or pass "
            "--context"
        ) from None
    return client.ApiClient(cfg), context


def _reason(e: ApiException) -> str:
    try:
        message = json.loads(e.body or "{}").get("message")
    except (ValueError, AttributeError):
        message = None
    return f"{e.status} {e.reason}" + (f": {message}" if message else "")


class K8sClient:
    """ConfigMaps, JobSets, Jobs and pods in one namespace-agnostic wrapper."""

    def __init__(self, api: client.ApiClient) -> None:
        self.api = api
        self.core = client.CoreV1Api(api)
        self.batch = client.BatchV1Api(api)
        self.custom = client.CustomObjectsApi(api)

    def _call(
        self,
        what: str,
        fn: Any,
        *args: Any,
        missing_ok: bool = False,
        hints: dict[int, str] | None = None,
        **kw: Any,
    ) -> Any:
        """Run one request; None for a 404 when `missing_ok`; K8sError for any other failure."""
        try:
            return fn(*args, **kw)
        except ApiException as e:
            if missing_ok and e.status == 404:
                return None
            hint = {**_HINTS, **(hints or {})}.get(e.status, "")
            raise K8sError(
                f"{what}: the API server answered {_reason(e)}{hint}", e.status
            ) from None
        except HTTPError as e:
            host = self.api.configuration.host
            raise K8sError(f"{what}: cannot reach the API server at {host} ({e})") from None

    @staticmethod
    def _json(resp: Any) -> dict[str, Any]:
        return json.loads(resp.data)

    # ---- create -------------------------------------------------------------------------------

    def create_configmap(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        name = body["metadata"]["name"]
        resp = self._call(
            f"creating ConfigMap {namespace}/{name}",
            self.core.create_namespaced_config_map,
            namespace,
            body,
            _headers=dict(JSON_BODY),
            _preload_content=False,
        )
        return self._json(resp)

    def create_jobset(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        name = body["metadata"]["name"]
        return self._call(
            f"creating JobSet {namespace}/{name}",
            self.custom.create_namespaced_custom_object,
            JOBSET_GROUP,
            JOBSET_VERSION,
            namespace,
            JOBSET_PLURAL,
            body,
            _headers=dict(JSON_BODY),
            hints={
                404: f"; check that JobSet ({JOBSET_GROUP}/{JOBSET_VERSION}) is installed on the "
                f"cluster and that namespace {namespace} exists"
            },
        )

    def set_owner(self, namespace: str, configmap: str, owner: dict[str, Any]) -> None:
        """Make the ConfigMap the JobSet's dependent: deleting the JobSet (cancel, TTL) deletes it."""
        ref = {
            "apiVersion": owner["apiVersion"],
            "kind": owner["kind"],
            "name": owner["metadata"]["name"],
            "uid": owner["metadata"]["uid"],
        }
        self._call(
            f"setting the owner of ConfigMap {namespace}/{configmap}",
            self.core.patch_namespaced_config_map,
            configmap,
            namespace,
            {"metadata": {"ownerReferences": [ref]}},
            _content_type="application/merge-patch+json",
            _preload_content=False,
        )

    # ---- read ---------------------------------------------------------------------------------

    def get_jobset(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._call(
            f"reading JobSet {namespace}/{name}",
            self.custom.get_namespaced_custom_object,
            JOBSET_GROUP,
            JOBSET_VERSION,
            namespace,
            JOBSET_PLURAL,
            name,
            missing_ok=True,
        )

    def list_jobsets(self, namespace: str | None, selector: str) -> list[dict[str, Any]]:
        """The JobSets matching `selector` in `namespace` (None: in every namespace)."""
        if namespace is None:
            return (
                self._call(
                    f"listing JobSets {selector} in every namespace",
                    self.custom.list_cluster_custom_object,
                    JOBSET_GROUP,
                    JOBSET_VERSION,
                    JOBSET_PLURAL,
                    label_selector=selector,
                ).get("items")
                or []
            )
        return (
            self._call(
                f"listing JobSets {selector} in {namespace}",
                self.custom.list_namespaced_custom_object,
                JOBSET_GROUP,
                JOBSET_VERSION,
                namespace,
                JOBSET_PLURAL,
                label_selector=selector,
            ).get("items")
            or []
        )

    def list_pods(self, namespace: str | None, selector: str) -> list[dict[str, Any]]:
        """The pods matching `selector` in `namespace` (None: in every namespace)."""
        if namespace is None:
            resp = self._call(
                f"listing pods {selector} in every namespace",
                self.core.list_pod_for_all_namespaces,
                label_selector=selector,
                _preload_content=False,
            )
        else:
            resp = self._call(
                f"listing pods {selector} in {namespace}",
                self.core.list_namespaced_pod,
                namespace,
                label_selector=selector,
                _preload_content=False,
            )
        return self._json(resp).get("items") or []

    def list_jobs(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        resp = self._call(
            f"listing Jobs {selector} in {namespace}",
            self.batch.list_namespaced_job,
            namespace,
            label_selector=selector,
            _preload_content=False,
        )
        return self._json(resp).get("items") or []

    def pod_log(
        self,
        namespace: str,
        pod: str,
        container: str,
        *,
        follow: bool,
        tail: int | None,
        timestamps: bool = False,
        since_s: float | None = None,
    ) -> Iterator[str]:
        """The container's output, line by line (without newlines); streamed when `follow`.
        `timestamps`: each line starts with the kubelet's time as `launch logs --timestamps`
        shows times (`2026-12-07T23:01:02.345Z text`; launch.logs_options.split_kubelet_time);
        `since_s`: only lines of the last that many seconds (the API's sinceSeconds, whole
        seconds, rounded up)."""
        from launch.logs_options import split_kubelet_time

        extra: dict[str, Any] = {}
        if timestamps:
            extra["timestamps"] = True
        if since_s is not None:
            extra["since_seconds"] = max(1, math.ceil(since_s))
        resp = self._call(
            f"reading the log of pod {namespace}/{pod}",
            self.core.read_namespaced_pod_log,
            pod,
            namespace,
            container=container,
            follow=follow,
            tail_lines=tail,
            _preload_content=False,
            **extra,
        )
        try:
            for raw in resp:  # urllib3 yields the body line by line
                line = raw.decode(errors="replace").rstrip("\r\n")
                if timestamps:
                    stamp, text = split_kubelet_time(line)
                    line = f"{stamp} {text}" if stamp is not None else line
                yield line
        except HTTPError:
            return  # the stream broke off (the pod went away): its log ends here
        finally:
            resp.release_conn()

    # ---- delete -------------------------------------------------------------------------------

    def delete_jobset(self, namespace: str, name: str) -> bool:
        """Foreground: the JobSet goes only after its Jobs and pods, which get SIGTERM first."""
        out = self._call(
            f"deleting JobSet {namespace}/{name}",
            self.custom.delete_namespaced_custom_object,
            JOBSET_GROUP,
            JOBSET_VERSION,
            namespace,
            JOBSET_PLURAL,
            name,
            body=client.V1DeleteOptions(propagation_policy="Foreground"),
            _headers=dict(JSON_BODY),
            missing_ok=True,
        )
        return out is not None

    def delete_configmap(self, namespace: str, name: str) -> bool:
        out = self._call(
            f"deleting ConfigMap {namespace}/{name}",
            self.core.delete_namespaced_config_map,
            name,
            namespace,
            _headers=dict(JSON_BODY),
            _preload_content=False,
            missing_ok=True,
        )
        return out is not None
