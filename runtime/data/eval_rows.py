"""Whether each `[[evals]]` entry can run on the data, decided from manifests alone (no shard is
read, no jax): the start of a run, `runtime preflight` and `runtime config check` ask it before
any step, so an eval that cannot give one row is found before training, not at its end.

An eval reads its split in the fixed eval order (runtime/data/loader.py `eval_loader`): the
split's sequential windows of seq_len + 1 tokens, or one rollout per row. A split with no row is
an error naming the eval and the split; one with fewer distinct rows than the eval reads
(`batches` x `global_batch_size`, wrapping around) is a warning, as the eval then reuses rows.
"""

from __future__ import annotations

import math
from typing import Any

from jobspec.errors import DataError, JaxjobError
from jobspec.run_config import RunConfig
from runtime.data.manifest import Manifest


def split_rows(manifest: Manifest, split: str, seq_len: int) -> int:
    """Distinct rows an eval can read from `split` of `manifest`."""
    info = manifest.split(split)
    if manifest.layout == "rollouts":
        return info.documents
    return max(0, (info.tokens - 1) // seq_len)


def _sources(data: Any, cfg: RunConfig) -> list[tuple[str | None, Manifest, float]]:
    """(source name or None, manifest, share of the rows) of a manifest or a mixture (duck-typed:
    runtime/data/mixture.py imports jax, and `config check` must not)."""
    manifests = getattr(data, "manifests", None)
    if manifests is None:
        return [(None, data, 1.0)]
    return [(d.name, m, d.share) for d, m in zip(cfg.data.datasets, manifests, strict=True)]


def check_evals(data: Any, cfg: RunConfig) -> list[dict[str, Any]]:
    """Raise DataError (one sentence naming the eval and the split) when an eval's split cannot
    give one row; return a warning record ({eval, split, rows, needed, message}) for each eval
    whose split holds fewer distinct rows than it reads. `data`: a Manifest or a Mixture."""
    t = cfg.training
    warnings = []
    for e in cfg.evals:
        needed = e.batches * t.global_batch_size
        for name, manifest, share in _sources(data, cfg):
            where = f"{manifest.root}" + (f" (data source {name})" if name else "")
            rows = split_rows(manifest, e.split, t.seq_len)
            if rows < 1:
                info = manifest.split(e.split)
                unit = (
                    "rollouts"
                    if manifest.layout == "rollouts"
                    else f"tokens, and one row needs training.seq_len + 1 = {t.seq_len + 1}"
                )
                fix = (
                    "prepare the data with a validation share (`runtime data prepare "
                    "--val-fraction 0.05`, or data.prepare.val_fraction)"
                    if e.split == "validation"
                    else "prepare more data"
                )
                count = info.documents if manifest.layout == "rollouts" else info.tokens
                raise DataError(
                    f"eval {e.name!r} reads the {e.split} split of {where}, which holds {count:,} "
                    f"{unit}; {fix}, set that eval's split = 'train', or remove the eval"
                )
            wanted = math.ceil(needed * share)
            if rows < wanted:
                warnings.append({
                    "eval": e.name, "split": e.split, "source": name, "rows": rows,
                    "needed": wanted,
                    "message": (
                        f"eval {e.name!r} reads {wanted:,} rows of the {e.split} split of {where} "
                        f"({e.batches} batches of {t.global_batch_size}"
                        + (f", {share:.0%} from this source" if name else "")
                        + f") but it holds {rows:,} distinct rows, so rows are reused; lower that "
                        "eval's batches or prepare a larger split"
                    ),
                })  # fmt: skip
    return warnings


def check_evals_before_prepare(cfg: RunConfig) -> None:
    """A data.manifest that `[data.prepare]` will make on first use: a validation eval needs
    data.prepare.val_fraction > 0 (the sizes are not known yet; check_evals runs once they are)."""
    p = cfg.data.prepare
    if p is None or p.val_fraction > 0:
        return
    for e in cfg.evals:
        if e.split == "validation":
            raise DataError(
                f"eval {e.name!r} reads the validation split, but data.prepare.val_fraction = 0 "
                "leaves it empty; raise data.prepare.val_fraction, set that eval's split = "
                "'train', or remove the eval"
            )


def check_evals_of_config(cfg: RunConfig, *, remote: bool = True) -> list[dict[str, Any]] | None:
    """check_evals on the manifests `cfg` names, as they are now: its warnings, or None when a
    manifest cannot be read (absent, unreachable; with remote=False, on gs://): then only what
    the config itself says is checked (check_evals_before_prepare). Raises DataError for an
    eval that cannot run."""
    from types import SimpleNamespace

    from jobspec.run_config import is_remote
    from runtime.data.manifest import load_manifest

    uris = (
        [cfg.data.manifest or ""]
        if cfg.data.sources is None
        else [s.manifest for s in cfg.data.sources]
    )
    try:
        if not remote and any(is_remote(uri) for uri in uris):
            raise DataError("not read here")  # `config check` stays off the network
        manifests = [load_manifest(uri) for uri in uris]
    except (JaxjobError, OSError, ValueError):
        check_evals_before_prepare(cfg)
        return None
    data = manifests[0] if cfg.data.sources is None else SimpleNamespace(manifests=manifests)
    return check_evals(data, cfg)
