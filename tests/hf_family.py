"""What every model family's Hugging Face parity tests share: our logits of a batch, a model
imported from an HF folder, and the exact-resume check of a fine-tune from that folder."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jobspec.run_config import MeshConfig
from runtime.hf.convert import model_config_from_hf
from runtime.model.build import build_model
from runtime.model.sharding import build_mesh

from runs import read_jsonl, tiny_config


def positions_of(batch: np.ndarray) -> jax.Array:
    return jnp.broadcast_to(jnp.arange(batch.shape[1]), batch.shape)


@nnx.jit
def forward(model, ids, positions, segment_ids=None):
    return model(ids, positions, segment_ids)


def logits_of(model, batch: np.ndarray) -> np.ndarray:
    """fp32 logits [B, T, V] of `model` on int token ids [B, T] (positions 0..T-1)."""
    return np.asarray(forward(model, jnp.asarray(batch), positions_of(batch)))


def hf_logits_of(cls, path: Path, batch: np.ndarray, **kw) -> np.ndarray:
    """transformers' fp32 logits (eager attention) of the model class `cls` saved at `path`, on
    int token ids [B, T]; `kw`: more `from_pretrained` arguments."""
    import torch

    model = cls.from_pretrained(path, attn_implementation="eager", dtype=torch.float32, **kw)
    with torch.no_grad():
        return model.eval()(torch.from_numpy(batch.astype(np.int64))).logits.numpy()


def imported(path: Path, **over):
    """(model config, our model) of the HF folder `path`, as `model.init_from = "hf:PATH"`
    builds it on one device; `over`: ModelConfig fields to set."""
    cfg = model_config_from_hf(path, init_from=f"hf:{path}", **over)
    parts = build_model(cfg, 0, build_mesh(MeshConfig()))
    return cfg, nnx.merge(parts.graphdef, parts.params, *parts.others)


def resume_is_exact(
    prepared: str,
    runs: Path,
    src: Path,
    *,
    model: dict | None = None,
    steps: int = 4,
    split: int = 2,
):
    """Fine-tune from the HF folder `src` for `steps` steps on packed documents, then the same run
    stopped after `split` steps (its checkpoint) and resumed: one program, one schedule, so every
    loss must be the same bits. `model`: more [model] keys. -> (the run config, the whole run's
    losses; its folder is runs / "whole")."""
    from jobspec.files.run_toml import parse_run_config
    from runtime.train.loop import train

    losses = {}
    for name in ("whole", "split"):
        raw = tiny_config(prepared, str(runs), name, training={"target_tokens": 16 * 8 * steps})
        raw["model"] = {"init_from": f"hf:{src}", **(model or {})}
        raw["data"]["order"] = "document_buffer"
        raw["checkpoint"] = {"every": split, "keep": 3, "async": False}
        cfg = parse_run_config(raw)
        if name == "split":
            stopped = train(cfg, "", resume=False, max_steps=split, emit=lambda _: None)
            assert stopped.status == "stopped", stopped.status
        result = train(cfg, "", resume=name == "split", emit=lambda _: None)
        assert result.status == "completed", result.status
        losses[name] = [r["loss"] for r in read_jsonl(runs / name / "metrics" / "train.jsonl")]
    assert len(losses["whole"]) == steps and losses["whole"] == losses["split"], losses
    assert losses["whole"][-1] < losses["whole"][0]
    return cfg, losses["whole"]
