"""The compatibility fingerprint of a run on this job's hosts, and the check resume runs before
Orbax (the keys and the check live in jobspec.compat: `launch` reads them without jax)."""

from __future__ import annotations

from typing import Any

import jax

from jobspec.compat import TOPOLOGY, check_compatible, fingerprint
from jobspec.run_config import RunConfig
from runtime.data.mixture import manifests_of

__all__ = ["TOPOLOGY", "check_compatible", "fingerprint", "run_fingerprint"]


def run_fingerprint(cfg: RunConfig, manifest: Any) -> dict[str, Any]:
    """The fingerprint of `cfg` training on `manifest` (or a mixture) with this job's process
    count."""
    return fingerprint(
        cfg,
        manifest_fingerprint=manifest.fingerprint,
        tokenizer_id=manifest.tokenizer.id,
        process_count=jax.process_count(),
        source_fingerprints=[m.fingerprint for m in manifests_of(manifest)],
    )
