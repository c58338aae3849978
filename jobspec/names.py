"""Kubernetes name rules for the job spec's k8s section, checked before anything is rendered.

Every pattern is applied with `fullmatch`: with `re.match`, a trailing `$` also matches just
before a final newline, so "team-a\\n" would pass and reach the API server (or a label) verbatim.
"""

from __future__ import annotations

import re

from jobspec.run_config import check_dns_label

_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS_SUBDOMAIN = re.compile(rf"{_LABEL}(\.{_LABEL})*")  # service accounts, priority classes: 253
LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")  # label name and value: 63


def check_dns_subdomain(value: str, what: str) -> str:
    if len(value) > 253 or not DNS_SUBDOMAIN.fullmatch(value):
        raise ValueError(
            f"{what} {value!r} is not a DNS-1123 subdomain: use lowercase letters, digits, '-' "
            "and '.', at most 253 characters, starting and ending with a letter or digit"
        )
    return value


def check_label_value(value: str, what: str) -> str:
    if value and (len(value) > 63 or not LABEL_NAME.fullmatch(value)):
        raise ValueError(
            f"{what} {value!r} is not a Kubernetes label value: use at most 63 letters, digits, "
            "'-', '_' or '.', starting and ending with a letter or digit (or leave it empty)"
        )
    return value


def check_label_key(key: str, what: str) -> str:
    """`[prefix/]name`: an optional DNS subdomain prefix, then a label name."""
    prefix, _, name = key.rpartition("/")
    if (
        not name
        or len(name) > 63
        or not LABEL_NAME.fullmatch(name)
        or (prefix and (len(prefix) > 253 or not DNS_SUBDOMAIN.fullmatch(prefix)))
        or (not prefix and "/" in key)
    ):
        raise ValueError(
            f"{what} {key!r} is not a Kubernetes label key: use [PREFIX/]NAME, NAME at most 63 "
            "letters, digits, '-', '_' or '.' starting and ending with a letter or digit, and "
            "PREFIX a DNS subdomain"
        )
    return key


def check_k8s_names(
    *,
    namespace: str,
    service_account: str | None,
    queue: str | None,
    priority_class: str | None,
    node_selector: dict[str, str],
    labels: dict[str, str],
    annotations: dict[str, str],
) -> None:
    """Every name of the k8s section that Kubernetes checks, checked here first (ValueError)."""
    check_dns_label(namespace, "namespace ")
    if service_account is not None:
        check_dns_subdomain(service_account, "service_account")
    if queue is not None:  # the value of the kueue.x-k8s.io/queue-name label
        check_label_value(queue, "queue")
    if priority_class is not None:
        check_dns_subdomain(priority_class, "priority_class")
    for field, mapping in (("node_selector", node_selector), ("labels", labels)):
        for k, v in mapping.items():
            check_label_key(k, f"{field} key")
            check_label_value(v, f"{field}.{k} value")
    for k in annotations:
        check_label_key(k, "annotations key")
