"""The storage under Orbax set up before it opens a run's checkpoints: the GCS environment, and
on gs:// tensorstore's request retries bounded by the run's storage budget and etils' listing
cache made fresh."""

from __future__ import annotations

from typing import Any

from etils import epath

from runfolder.layout import CHECKPOINTS
from runfolder.storage import RetryPolicy, configure_gcs_env
from runfolder.store import ArtifactStore


def prepare_storage(store: ArtifactStore) -> None:
    """What Orbax needs before it touches `store`'s checkpoints (every service, every host)."""
    configure_gcs_env()
    if store.remote:
        bound_tensorstore_retries(store.retry)
        invalidate_epath_cache(store.uri(CHECKPOINTS))


def tensorstore_retries(policy: RetryPolicy) -> dict[str, Any]:
    """tensorstore's `gcs_request_retries` for `policy`: the same backoff, and as many tries as
    it takes for the waits (initial_s doubling up to max_s) to add up to total_s. Its default
    (32 tries up to 32 s apart) retries a failing upload for about 15 minutes, past every
    deadline of the run's own storage calls."""
    waited, tries = 0.0, 0
    while waited < policy.total_s:
        waited += policy.backoff_s(tries)
        tries += 1
    return {
        "max_retries": max(tries, 1),
        "initial_delay": f"{policy.initial_s}s",
        "max_delay": f"{policy.max_s}s",
    }


def bound_tensorstore_retries(policy: RetryPolicy) -> None:
    """Make the tensorstore contexts Orbax builds for every save and restore retry gs:// requests
    within `policy` (runtime.storage_retry_s). Orbax has no parameter for it: it copies these
    module-level defaults for each context (tests/test_checkpoint.py checks that it still
    does); a version without them keeps tensorstore's own retries."""
    from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

    retries = tensorstore_retries(policy)
    for name in ("_BASE_TS_CONTEXT", "_DEFAULT_OCDBT_TS_CONTEXT"):
        context = getattr(ts_utils, name, None)
        if isinstance(context, dict):
            context["gcs_request_retries"] = retries


def invalidate_epath_cache(uri: str) -> None:
    """Forget the gs:// listings etils.epath holds for `uri`.

    etils.epath keeps one gcsfs instance per process whose listings go stale when anything
    else (our store, another process) changed the bucket; Orbax lists steps through it."""
    fs = getattr(epath.Path(uri), "_backend", None)
    if fs is not None and hasattr(fs, "fs"):
        fs.fs(uri).invalidate_cache()
