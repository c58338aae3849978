"""The keys a resumed run must keep (the compatibility fingerprint a checkpoint records) and the
check resume runs before restoring. jax-free: `launch submit` refuses an override of a fixed
run.id that resume would refuse with the same keys, before anything starts.

Keys are the run-config field paths, so a failed check names exactly what changed. What may
change on resume (target_tokens, log/eval/checkpoint cadence, remat, output paths) is absent.
"""

from __future__ import annotations

from typing import Any

from jobspec.errors import CheckpointError
from jobspec.files.run_toml import resolved_dict
from jobspec.run_config import RunConfig

# Recomputation policy and attention kernel: same numbers (to rounding), same shapes.
# The MoE dispatch moves the same parameters differently (a capacity factor only drops tokens).
_MODEL_FREE = {"remat", "attention", "moe_dispatch", "moe_capacity_factor"}
# Keys added after checkpoints were first written, with the value an older checkpoint implies;
# an added key whose value is None (an optional setting or section left unset) needs no entry.
_INTRODUCED = {
    "model.scan_layers": False,
    "topology.mesh.expert": 1,
    "topology.mesh.context": 1,
}


def _flatten(prefix: str, obj: Any, out: dict[str, Any]) -> None:
    if isinstance(obj, dict):
        for k, v in obj.items():
            _flatten(f"{prefix}.{k}", v, out)
    else:
        out[prefix] = obj


TOPOLOGY = "topology."  # keys that may change only with --reshard


def fingerprint(
    cfg: RunConfig,
    *,
    manifest_fingerprint: str,
    tokenizer_id: str,
    process_count: int = 1,
    source_fingerprints: list[str] | None = None,
) -> dict[str, Any]:
    """`source_fingerprints`: those of `[[data.sources]]` in order (a mixture; then
    `manifest_fingerprint` is not recorded)."""
    raw = resolved_dict(cfg)
    out: dict[str, Any] = {}
    _flatten("model", {k: v for k, v in raw["model"].items() if k not in _MODEL_FREE}, out)
    _flatten("optimizer", raw["optimizer"], out)
    out["model.resolved_head_dim"] = cfg.model.resolved_head_dim
    out["data.tokenizer"] = tokenizer_id
    if cfg.data.sources is None:
        out["data.manifest"] = manifest_fingerprint
    else:
        # Which source every sample comes from follows from the names' order and the weights.
        out["data.sources"] = [s.name for s in cfg.data.sources]
        for i, (s, fp) in enumerate(zip(cfg.data.sources, source_fingerprints or [], strict=True)):
            out[f"data.sources[{i}].manifest"] = fp
            out[f"data.sources[{i}].weight"] = s.weight
    out["data.order"] = cfg.data.order
    out["run.seed"] = cfg.run.seed
    out["training.seq_len"] = cfg.training.seq_len
    out["training.global_batch_size"] = cfg.training.global_batch_size
    out["training.gradient_accumulation_steps"] = cfg.training.gradient_accumulation_steps
    out[f"{TOPOLOGY}process_count"] = process_count
    _flatten(f"{TOPOLOGY}mesh", raw["mesh"], out)
    return out


def check_compatible(
    saved: dict[str, Any], current: dict[str, Any], *, step: int, reshard: bool = False
) -> None:
    """Raise CheckpointError naming the first field whose value differs from the checkpoint's.

    A different process count or mesh (same global batch) is allowed only with `reshard`:
    Orbax then lays the arrays out for the new mesh and the data order continues unchanged.
    """
    # The config's own order, tokenizer before manifest: a new tokenizer also changes the
    # manifest, and the tokenizer is the cause worth naming.
    keys = list(current) + [k for k in saved if k not in current]
    for key in keys:
        if key not in saved and key not in _INTRODUCED and current.get(key) is None:
            continue  # an optional setting added since the checkpoint: unset then and now
        old = saved.get(key, _INTRODUCED.get(key, "<absent>"))
        new = current.get(key, "<absent>")
        if old != new and key.startswith(TOPOLOGY):
            if reshard:
                continue
            raise CheckpointError(
                f"checkpoint {step} was written with {key.removeprefix(TOPOLOGY)} = {old!r} and this "
                f"run has {new!r}; pass --reshard to restore it onto the new layout"
            )
        if old != new:
            content = key == "data.manifest" or key.endswith("].manifest")
            what = "content fingerprint" if content else "value"
            raise CheckpointError(
                f"cannot resume from checkpoint {step}: compatibility.{key} changed ({what} "
                f"{old!r} in the checkpoint, {new!r} in the config); restore it or start a new run.id"
            )


def config_fingerprint(cfg: RunConfig) -> dict[str, Any]:
    """The part of `fingerprint` the run config alone decides (the data's content and the
    process count are left out: a job spec cannot tell them without reading the data)."""
    n = len(cfg.data.sources or [])
    out = fingerprint(cfg, manifest_fingerprint="", tokenizer_id="", source_fingerprints=[""] * n)
    content = ("data.tokenizer", "data.manifest", f"{TOPOLOGY}process_count")
    return {k: v for k, v in out.items() if k not in content and not k.endswith("].manifest")}
