"""Run ids: `<job name>-<6 random [a-z0-9]>`, a DNS-1123 label every backend can use as a name."""

from __future__ import annotations

import secrets
import string

from jobspec.run_config import RUN_ID_RE

SUFFIX_ALPHABET = string.ascii_lowercase + string.digits
SUFFIX_LEN = 6
MAX_LEN = 63  # DNS-1123 label


def new_run_id(name: str) -> str:
    """A fresh id for one submission of job `name` (36^6 ≈ 2e9 suffixes: collisions are rare,
    and the registry refuses the rare one rather than mixing two runs)."""
    suffix = "".join(secrets.choice(SUFFIX_ALPHABET) for _ in range(SUFFIX_LEN))
    # JobSpec names are at most 40 characters; trimming keeps any other caller within 63.
    stem = name[: MAX_LEN - SUFFIX_LEN - 1].rstrip("-")
    return f"{stem}-{suffix}"


def is_run_id(value: str) -> bool:
    return bool(RUN_ID_RE.fullmatch(value))  # a DNS-1123 label, at most MAX_LEN characters
