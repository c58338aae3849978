"""Hugging Face safetensors <-> NNX parameters, bit-exact in both directions.

Import reads `config.json` plus `model.safetensors`, or the shards a `model.safetensors.index.json`
lists, with `safetensors.numpy` (no torch). Export writes `config.json` and `model.safetensors`,
split into `model-0000k-of-0000n.safetensors` shards with an index above `max_shard_bytes`.
Tensors keep their stored dtype both ways (a bf16 parameter is written as bf16); only an
explicit `param_dtype` that differs from the checkpoint's casts on import.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from jobspec.errors import ConfigError
from jobspec.hf_config import hf_config_from_model, hf_dir, model_fields_from_hf, read_hf_config
from jobspec.run_config import ModelConfig
from runtime.hf.names import names_for

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3

Path_ = tuple[str | int, ...]


def model_config_from_hf(path: str | Path, **overrides: Any) -> ModelConfig:
    """The ModelConfig an HF dir's config.json describes (`overrides` are our key names)."""
    fields = model_fields_from_hf(read_hf_config(path, what=str(path)), what=str(path))
    return ModelConfig(**{**fields, **overrides})


def _shard_files(path: Path) -> list[Path]:
    if (path / INDEX).is_file():
        index = json.loads((path / INDEX).read_text())
        return [path / f for f in sorted(set(index["weight_map"].values()))]
    if (path / SINGLE).is_file():
        return [path / SINGLE]
    raise ConfigError(f"{path}: no {SINGLE} or {INDEX} (only safetensors checkpoints are read)")


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of an HF dir (single file or sharded), by HF name, as stored."""
    out: dict[str, np.ndarray] = {}
    for f in _shard_files(Path(path)):
        with safe_open(str(f), framework="numpy") as fh:
            for name in fh.keys():  # noqa: SIM118 (safe_open is not a mapping)
                out[name] = fh.get_tensor(name)
    return out


def params_from_hf(cfg: ModelConfig, tensors: dict[str, np.ndarray]) -> dict[Path_, np.ndarray]:
    """Our parameters (flat: NNX path -> array) from an HF state dict."""
    table = names_for(cfg)
    known = {e.name for e in table}
    if cfg.tie_word_embeddings:
        known.add("lm_head.weight")  # some tied checkpoints store the shared matrix twice
    extra = sorted(set(tensors) - known)
    if extra:
        raise ConfigError(
            f"HF checkpoint has tensors jaxjob does not map, e.g. {extra[0]!r} ({len(extra)} in all)"
        )
    out: dict[Path_, np.ndarray] = {}
    stacks: dict[Path_, dict[int, np.ndarray]] = {}
    for e in table:
        if e.name not in tensors:
            raise ConfigError(f"HF checkpoint lacks tensor {e.name!r}")
        a = tensors[e.name]
        a = np.ascontiguousarray(a.T) if e.transpose else a
        if e.expert is None:
            out[e.path] = a
        else:
            stacks.setdefault(e.path, {})[e.expert] = a
    for path, per_expert in stacks.items():
        out[path] = np.stack([per_expert[k] for k in range(len(per_expert))])
    return out


def hf_from_params(cfg: ModelConfig, flat: dict[Path_, Any]) -> dict[str, np.ndarray]:
    """An HF state dict from our flat parameters (NNX path -> array-like)."""
    out: dict[str, np.ndarray] = {}
    for e in names_for(cfg):
        a = np.asarray(flat[e.path])
        if e.expert is not None:
            a = a[e.expert]
        out[e.name] = np.ascontiguousarray(a.T) if e.transpose else np.ascontiguousarray(a)
    return out


def flat_params(params: Any) -> dict[Path_, Any]:
    """nnx.State (or a pure nested dict) of parameters -> {path: array}."""
    from flax import nnx, traverse_util

    if isinstance(params, nnx.State):
        params = nnx.to_pure_dict(params)
    return traverse_util.flatten_dict(params)


def load_hf_params(path: str | Path, cfg: ModelConfig) -> dict[Path_, np.ndarray]:
    """Flat parameters for `cfg` from the HF dir at `path`."""
    return params_from_hf(cfg, read_safetensors(path))


def write_hf(
    cfg: ModelConfig,
    params: Any,
    out_dir: str | Path,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> list[str]:
    """config.json + safetensors for `params` (nnx.State or pure nested dict); the file names."""
    tensors = hf_from_params(cfg, {k: _host(v) for k, v in flat_params(params).items()})
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf_cfg = hf_config_from_model(cfg.model_dump())
    (out / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")

    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, a in tensors.items():
        if shards[-1] and size + a.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = a
        size += a.nbytes
    for stale in [*out.glob("model*.safetensors"), out / INDEX]:
        if stale.exists():
            os.remove(stale)
    meta = {"format": "pt"}  # transformers refuses safetensors files without it
    if len(shards) == 1:
        save_file(shards[0], str(out / SINGLE), metadata=meta)
        return ["config.json", SINGLE]
    files = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    weight_map = {}
    for f, shard in zip(files, shards, strict=True):
        save_file(shard, str(out / f), metadata=meta)
        weight_map.update(dict.fromkeys(shard, f))
    index = {
        "metadata": {"total_size": sum(a.nbytes for a in tensors.values())},
        "weight_map": weight_map,
    }
    (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return ["config.json", *files, INDEX]


def _host(x: Any) -> np.ndarray:
    import jax

    return np.asarray(jax.device_get(x))


def place_params(flat: dict[Path_, np.ndarray], abstract_params: Any, shardings: Any) -> Any:
    """Device arrays laid out with `shardings`, in the structure of `abstract_params` (nnx.State).

    Each host builds only its own shards from the full host copy (multi-host safe). A shape that
    differs from the model's is a ConfigError; a dtype that differs is cast to the model's.
    """
    import jax
    from flax import nnx, traverse_util

    abs_flat = flat_params(abstract_params)
    sh_flat = flat_params(shardings)
    missing = sorted(set(abs_flat) - set(flat), key=str)
    if missing:
        raise ConfigError(f"HF weights lack parameter {_fmt(missing[0])}")
    placed = {}
    for path, ab in abs_flat.items():
        a = flat[path]
        if tuple(a.shape) != tuple(ab.shape):
            raise ConfigError(
                f"HF weight for {_fmt(path)} has shape {tuple(a.shape)}, the model needs "
                f"{tuple(ab.shape)}"
            )
        if a.dtype != ab.dtype:
            a = a.astype(ab.dtype)
        placed[path] = jax.make_array_from_callback(a.shape, sh_flat[path], lambda i, a=a: a[i])
    new = jax.tree.map(lambda x: x, abstract_params)  # a copy; the target stays abstract
    nnx.replace_by_pure_dict(new, traverse_util.unflatten_dict(placed))
    return new


def _fmt(path: Path_) -> str:
    return ".".join(str(p) for p in path)


# ---- run directories ------------------------------------------------------------------------


def export_checkpoint(
    run: str, selector: str, out_dir: str, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
) -> dict[str, Any]:
    """`runtime export hf`: one checkpoint of RUN as an HF model dir (config.json + safetensors).

    Only parameters are exported: a qwen3_moe run's router bias (router_bias_update_rate > 0)
    has no HF tensor, so HF routes such an export as if that bias were zero.
    """
    from runtime.offline import _restore

    _, cfg, step, parts, _ = _restore(run, selector)
    files = write_hf(cfg.model, parts.params, out_dir, max_shard_bytes=max_shard_bytes)
    return {
        "run_id": cfg.run.id,
        "step": step,
        "checkpoint": selector,
        "out": out_dir,
        "files": files,
    }


def _import_run_config(path: Path, out: Path, config: str | None):
    from jobspec.load import parse_run_config, read_toml

    data: dict[str, Any] = read_toml(config) if config else {}
    model = dict(data.get("model") or {})
    given = model.get("init_from")
    # Keep the TOML's own spelling of the same dir: init_from is part of the resume fingerprint.
    if not (isinstance(given, str) and given.startswith("hf:") and _same_dir(hf_dir(given), path)):
        model["init_from"] = f"hf:{path}"
    if not config:
        hf = model_config_from_hf(path)
        seq_len = min(hf.max_position_embeddings, 2048)
        data["data"] = {"manifest": ""}  # no data: sample works, eval needs a real manifest
        data["training"] = {"seq_len": seq_len, "global_batch_size": 1, "target_tokens": seq_len}
    data["model"] = model
    data["run"] = {**(data.get("run") or {}), "id": out.name, "output_uri": str(out.parent)}
    return parse_run_config(data, config or str(path))


def _same_dir(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False


def import_to_run(path: str, out_dir: str, *, config: str | None = None) -> dict[str, Any]:
    """`runtime import hf`: an HF model dir as checkpoint 0 of a run dir at `out_dir`.

    The run dir holds manifest.json, config/{source.toml,resolved.json} and an Orbax checkpoint
    with the HF weights and a fresh optimizer state, so `runtime eval/sample/export` read it.
    With `config` (a run TOML; run.id/output_uri come from `out_dir`) whose data manifest exists,
    the checkpoint also records the data position and fingerprint, so training that config
    continues from it with `--resume`.
    """
    import jax

    from jobspec.errors import JaxjobError
    from jobspec.load import resolved_dict, to_toml
    from runtime.artifacts import LAYOUT, now, package_versions
    from runtime.checkpoint import CheckpointService, load_index
    from runtime.compat import fingerprint
    from runtime.data.manifest import load_manifest
    from runtime.data.pipeline import train_batches
    from runtime.optim import build_optimizer
    from runtime.session import build_model, opt_state_shardings
    from runtime.sharding import offline_mesh
    from runtime.store import ArtifactStore

    src = Path(path).expanduser().resolve()
    out = Path(out_dir).expanduser().resolve()
    if not src.is_dir():  # its config.json is read (and checked) as the run config is built
        raise ConfigError(f"{path} is not a directory (expected a local Hugging Face model dir)")
    cfg = _import_run_config(src, out, config)
    store = ArtifactStore(str(out))
    if load_index(store).get("latest") is not None:
        raise ConfigError(f"{out} already has checkpoints; import into a new directory")
    store.check_writable()

    mesh = offline_mesh(cfg.mesh)
    parts = build_model(cfg.model, cfg.run.seed, mesh)
    decay_steps = cfg.optimizer.schedule.decay_steps or cfg.training.total_steps
    tx, _ = build_optimizer(cfg.optimizer, decay_steps)
    o_sh = opt_state_shardings(tx, parts.params, parts.param_shardings, mesh)
    opt_state = jax.jit(tx.init, out_shardings=o_sh)(parts.params)
    meta: dict[str, Any] = {
        "step": 0,
        "tokens": 0,
        "rng": np.asarray(jax.random.PRNGKey(cfg.run.seed)).tolist(),
        "decay_steps": decay_steps,
        "config": resolved_dict(cfg),
        "imported_from": str(src),
    }
    try:
        manifest = load_manifest(cfg.data.manifest) if cfg.data.manifest else None
    except JaxjobError:
        manifest = None
    if manifest is not None:
        batches = train_batches(manifest, cfg.data, cfg.training, cfg.run.seed)
        try:
            meta["data_state"] = {"0": batches.state_for(0)}
        finally:
            batches.close()
        meta["fingerprint"] = fingerprint(
            cfg,
            manifest_fingerprint=manifest.fingerprint,
            tokenizer_id=manifest.tokenizer.id,
            process_count=jax.process_count(),
        )
    store.write_text("config/source.toml", to_toml(cfg))
    store.write_json("config/resolved.json", resolved_dict(cfg))
    ckpt = CheckpointService(store, keep=cfg.checkpoint.keep, async_save=False)
    try:
        ckpt.save(0, params=parts.params, opt_state=opt_state, meta=meta)
        ckpt.wait()
    finally:
        ckpt.close()
    store.write_json(
        "manifest.json",
        {
            "run_id": cfg.run.id,
            "status": "imported",
            "output_uri": store.uri(""),
            "created": now(),
            "imported_from": str(src),
            "total_steps": cfg.training.total_steps,
            "tokens_per_step": cfg.training.tokens_per_step,
            "layout": LAYOUT,
            "jaxjob_version": package_versions()["jaxjob"],
        },
    )
    return {"run_id": cfg.run.id, "out": store.uri(""), "step": 0, "from": str(src),
            "resumable": manifest is not None}  # fmt: skip
