"""`runtime export hf` and `runtime import hf`: a checkpoint as an HF model dir, and back."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jobspec.errors import ConfigError, JaxjobError
from jobspec.files.run_toml import parse_run_config, read_toml, resolved_dict, to_toml
from jobspec.hf_config import hf_dir
from jobspec.run_config import RunConfig
from runfolder.layout import MANIFEST, RESOLVED_CONFIG, SOURCE_CONFIG, now
from runfolder.store import ArtifactStore
from runtime.commands.offline import restore_checkpoint
from runtime.data.loader import train_batches
from runtime.data.manifest import Manifest
from runtime.data.mixture import Mixture, open_data
from runtime.hf.convert import model_config_from_hf
from runtime.hf.export_dir import check_out, replace_folder
from runtime.hf.files import DEFAULT_MAX_SHARD_BYTES, check_safetensors
from runtime.model.build import build_model
from runtime.model.hf_weights import write_hf
from runtime.model.sharding import offline_mesh
from runtime.run.artifacts import package_versions
from runtime.run.checkpoint.index import load_index
from runtime.run.checkpoint.service import CheckpointService
from runtime.run.compat import run_fingerprint
from runtime.run.meta import CheckpointMeta, run_manifest
from runtime.train.optim import build_optimizer
from runtime.train.state import model_state_record, new_state, state_shardings


def export_checkpoint(
    run: str,
    selector: str,
    out_dir: str,
    *,
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> dict[str, Any]:
    """`runtime export hf`: one checkpoint of RUN as an HF model dir (config.json + safetensors).

    The folder is replaced whole (runtime/hf/export_dir.py): a folder holding files jaxjob did
    not export is refused unless `overwrite`, and even then only its model files are replaced.
    A qwen3_moe or qwen3_next run's router bias (router_bias_update_rate > 0) has no HF tensor,
    so HF routes such an export as if that bias were zero; deepseek_v3's is HF's
    e_score_correction_bias and is exported as the checkpoint holds it.
    """
    check_out(out_dir, overwrite=overwrite)  # before the restore: a bad --out costs no read
    _, cfg, step, parts, _ = restore_checkpoint(run, selector)

    def write(folder: Path) -> list[str]:
        return write_hf(
            cfg.model, parts.params, folder, others=parts.others, max_shard_bytes=max_shard_bytes
        )

    record = {"run_id": cfg.run.id, "step": step, "checkpoint": selector, "time": now()}
    files = replace_folder(out_dir, write, overwrite=overwrite, record=record)
    return {
        "run_id": cfg.run.id,
        "step": step,
        "checkpoint": selector,
        "out": out_dir,
        "files": files,
    }


def _import_run_config(path: Path, out: Path, config: str | None):
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
    continues from it with `--resume`. `out_dir` must be new, empty or a run dir without
    checkpoints; an import that fails removes the folder it created.
    """
    src = Path(path).expanduser().resolve()
    out = Path(out_dir).expanduser().resolve()
    if not src.is_dir():  # its config.json is read (and checked) as the run config is built
        raise ConfigError(f"{path} is not a directory (expected a local Hugging Face model dir)")
    _check_import_out(out, out_dir)
    cfg = _import_run_config(src, out, config)
    check_safetensors(src)  # a truncated file or a missing shard: said before --out is touched
    store = ArtifactStore(str(out))
    if load_index(store).get("latest") is not None:
        raise ConfigError(f"{out} already has checkpoints; import into a new directory")
    created = not out.exists()
    try:
        manifest = _write_import(cfg, store, src)
    except BaseException:
        if created:  # nothing was there: nothing is left
            shutil.rmtree(out, ignore_errors=True)
        raise
    return {"run_id": cfg.run.id, "out": store.uri(""), "step": 0, "from": str(src),
            "resumable": manifest is not None}  # fmt: skip


def _check_import_out(out: Path, out_dir: str) -> None:
    """--out must be new, empty or a jaxjob run dir: an import never writes its manifest.json
    and config/ over someone else's files."""
    if out.exists() and not out.is_dir():
        raise ConfigError(
            f"--out {out_dir} is an existing file; give a new folder for the run (its name is "
            "the run id)"
        )
    entries = sorted(os.listdir(out)) if out.is_dir() else []
    if entries and not _is_run_dir(out):
        shown = ", ".join(entries[:3]) + (", …" if len(entries) > 3 else "")
        raise ConfigError(
            f"--out {out_dir} already holds files that are not a jaxjob run ({shown}); import "
            "into a new or empty folder (its name becomes the run id)"
        )


def _is_run_dir(folder: Path) -> bool:
    try:
        doc = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and "run_id" in doc and "layout" in doc


def _write_import(cfg: RunConfig, store: ArtifactStore, src: Path) -> Manifest | Mixture | None:
    """Checkpoint 0 of the HF weights, the run's config and manifest.json; the data manifest
    the checkpoint's data position was taken from, if any."""
    store.check_writable()
    mesh = offline_mesh(cfg.mesh)
    parts = build_model(cfg.model, cfg.run.seed, mesh)
    decay_steps = cfg.optimizer.schedule.decay_steps or cfg.training.total_steps
    tx, _ = build_optimizer(cfg.optimizer, decay_steps)
    state = new_state(parts, tx, state_shardings(parts, tx, mesh), cfg.run.seed)
    manifest = _manifest_if_any(cfg)
    meta = CheckpointMeta(
        step=0,
        tokens=0,
        rng=np.asarray(jax.device_get(state.rng)).tolist(),
        decay_steps=decay_steps,
        config=resolved_dict(cfg),
        fingerprint=run_fingerprint(cfg, manifest) if manifest else {},
        data_state={"0": _start_data_state(cfg, manifest)} if manifest else None,
        # The model state as imported (deepseek_v3's router bias is an HF tensor).
        model_state=model_state_record(state) if jax.tree.leaves(state.model_state) else None,
        imported_from=str(src),
    )
    store.write_text(SOURCE_CONFIG, to_toml(cfg))
    store.write_json(RESOLVED_CONFIG, resolved_dict(cfg))
    ckpt = CheckpointService(store, keep=cfg.checkpoint.keep, async_save=False)
    try:
        ckpt.save(0, params=state.params, opt_state=state.opt_state, meta=meta)
        ckpt.wait()
    finally:
        ckpt.close()
    version = package_versions()["jaxjob"]
    store.write_json(
        MANIFEST,
        run_manifest(cfg, store.uri(""), status="imported", version=version, created=now(),
                     imported_from=str(src)),
    )  # fmt: skip
    return manifest


def _manifest_if_any(cfg: RunConfig) -> Manifest | Mixture | None:
    try:
        return open_data(cfg.data) if cfg.data.manifest or cfg.data.sources else None
    except JaxjobError:  # no data yet: the import still serves eval-less sampling and export
        return None


def _start_data_state(cfg: RunConfig, manifest: Manifest | Mixture) -> dict[str, Any]:
    batches = train_batches(manifest, cfg.data, cfg.training, cfg.run.seed)
    try:
        return batches.state_for(0)
    finally:
        batches.close()
