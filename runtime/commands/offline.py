"""`runtime eval checkpoint` and `runtime sample checkpoint`: inference from a finished or live run.

Only what inference needs is restored (parameters and meta), never optimizer or data state.
"""

from __future__ import annotations

import datetime as dt
from typing import Any, NamedTuple

from flax import nnx
from jax.sharding import Mesh

from jobspec.errors import ConfigError, JaxjobError
from jobspec.files.run_toml import parse_run_config
from jobspec.run_config import EvalConfig, RunConfig
from runfolder.layout import RESOLVED_CONFIG, now
from runfolder.store import ArtifactStore
from runfolder.view import open_run
from runtime.data.manifest import load_manifest
from runtime.data.mixture import open_data
from runtime.data.tokenizer import load_tokenizer
from runtime.model.build import ModelParts, build_model
from runtime.model.generate import generate
from runtime.model.sharding import offline_mesh, replicated
from runtime.run.checkpoint.service import CheckpointService
from runtime.train.evaluate import Evaluator
from runtime.train.state import model_state_from_meta


class Restored(NamedTuple):
    """A checkpoint restored for inference: the run's store and config, the step, the model."""

    store: ArtifactStore
    cfg: RunConfig
    step: int
    parts: ModelParts
    mesh: Mesh


def restore_checkpoint(run: str, selector: str) -> Restored:
    """Parameters and model state of RUN's checkpoint `selector`, on an offline mesh."""
    store = open_run(run)
    cfg = parse_run_config(store.read_json(RESOLVED_CONFIG), store.uri(RESOLVED_CONFIG))
    ckpt = CheckpointService(store, keep=cfg.checkpoint.keep, async_save=False, read_only=True)
    try:
        step = ckpt.resolve(selector)
        mesh = offline_mesh(cfg.mesh)
        abstract = build_model(cfg.model, cfg.run.seed, mesh, materialise=False)
        params, _, meta = ckpt.restore(step, params_target=abstract.params, fallback="select")
    finally:
        ckpt.close()
    # An MoE run's balancing biases: route as training left them.
    others = model_state_from_meta(abstract.others, meta, replicated(mesh))
    parts = ModelParts(abstract.graphdef, params, others, abstract.param_shardings)
    return Restored(store, cfg, step, parts, mesh)


def eval_checkpoint(run: str, selector: str) -> dict[str, Any]:
    store, cfg, step, parts, mesh = restore_checkpoint(run, selector)
    if not cfg.data.manifest and not cfg.data.sources:  # `import hf` without --config: no data
        raise ConfigError(
            f"run {cfg.run.id!r} has no data manifest (it was imported from Hugging Face without "
            "--config), so there is nothing to evaluate on; import it again with --config cfg.toml "
            "naming data.manifest, or sample from it with `runtime sample checkpoint`"
        )
    manifest = open_data(cfg.data)  # a mixture's evals read every source (docs/data.md, "Mixtures")
    evaluator = Evaluator(cfg, manifest, parts, mesh)
    evals = cfg.evals or [EvalConfig(name="validation")]
    results = [evaluator.evaluate(parts.params, e.name, e.split, e.batches) for e in evals]
    out = {
        "run_id": cfg.run.id,
        "step": step,
        "checkpoint": selector,
        "time": now(),
        "results": results,
    }
    rel = f"evals/step-{step}.json"
    store.write_json(rel, out)
    return {**out, "path": store.uri(rel)}


def sample_checkpoint(
    run: str,
    selector: str,
    prompt_ids: list[int],
    *,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    seed: int,
) -> dict[str, Any]:
    store, cfg, step, parts, _ = restore_checkpoint(run, selector)
    model = nnx.merge(parts.graphdef, parts.params, *parts.others)
    tokenizer = None
    try:
        # A mixture's sources share one tokenizer: the first says it.
        manifest = load_manifest(cfg.data.datasets[0].manifest)
        eos = manifest.tokenizer.eos_id
        tokenizer = load_tokenizer(manifest.tokenizer.source or manifest.tokenizer.id)
    except JaxjobError:  # sampling works without the data; only the text rendering is lost
        eos = None
    result = generate(
        model,
        prompt_ids,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        seed=seed,
        eos_id=eos,
    )
    out = {
        "run_id": cfg.run.id,
        "step": step,
        "checkpoint": selector,
        "time": now(),
        "prompt_ids": list(prompt_ids),
        "new_ids": result["tokens"],
        "stop_reason": result["stop_reason"],
        "settings": {
            "max_new_tokens": max_new_tokens,
            "temperature": temperature,
            "top_k": top_k,
            "seed": seed,
        },
        "text": tokenizer.decode(result["tokens"]) if tokenizer is not None else None,
    }
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%S%f")
    rel = f"samples/step-{step}-{stamp}.json"
    store.write_json(rel, out)
    return {**out, "path": store.uri(rel)}
