"""Hugging Face interop: logit parity with transformers' Qwen3, exact tensor round trips, and a
fine-tuning run that starts from an HF dir and exports back. CPU only, nothing downloaded."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from runs import LazyModule  # noqa: E402

torch = LazyModule("torch", "the HF parity tests need torch (CPU)")
transformers = LazyModule("transformers", "the HF parity tests need transformers")

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

from jobspec.errors import ConfigError  # noqa: E402
from jobspec.files.run_toml import parse_run_config  # noqa: E402
from runtime.commands.hf import import_to_run  # noqa: E402
from runtime.hf.convert import flat_params, model_config_from_hf  # noqa: E402
from runtime.hf.export_dir import MARKER  # noqa: E402
from runtime.hf.files import INDEX, SINGLE, read_safetensors  # noqa: E402
from runtime.model.build import build_model  # noqa: E402
from runtime.model.hf_weights import write_hf  # noqa: E402
from runtime.model.sharding import build_mesh  # noqa: E402

from runs import run_cli, stderr_lines, tiny_config, write_config  # noqa: E402

TOL = 1e-4
BATCH = np.array([[1, 5, 9, 77, 3, 120, 64, 2], [100, 0, 42, 42, 7, 19, 88, 127]], np.int32)


def _hf_model(tmp: Path, *, tied: bool, vocab: int = 128, seed: int = 0, **cfg) -> Path:
    """A tiny random Qwen3ForCausalLM saved to `tmp` (norm weights randomised too)."""
    torch.manual_seed(seed)
    config = transformers.Qwen3Config(
        vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=128, tie_word_embeddings=tied,
        max_position_embeddings=cfg.pop("max_position_embeddings", 128), **cfg,
    )  # fmt: skip
    model = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(tmp)
    return tmp


def _hf_logits(path: Path, batch: np.ndarray, cls=None) -> np.ndarray:
    """transformers' fp32 logits for `batch` from the model saved at `path` (eager attention:
    the reference math, not a fused kernel); `cls` defaults to Qwen3ForCausalLM."""
    cls = cls or transformers.Qwen3ForCausalLM
    model = cls.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.from_numpy(batch.astype(np.int64))).logits.numpy()


def _our_logits(model: nnx.Module, batch: np.ndarray) -> np.ndarray:
    positions = jnp.broadcast_to(jnp.arange(batch.shape[1]), batch.shape)
    return np.asarray(model(jnp.asarray(batch), positions))


def _import(path: Path, **overrides):
    cfg = model_config_from_hf(path, init_from=f"hf:{path}", **overrides)
    parts = build_model(cfg, 0, build_mesh(parse_mesh()))
    return cfg, parts, nnx.merge(parts.graphdef, parts.params, *parts.others)


def parse_mesh():
    from jobspec.run_config import MeshConfig

    return MeshConfig()


@pytest.mark.parametrize("scan", [True, False], ids=["scanned", "unrolled"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_logit_parity_import_and_export(tmp_path, tied, scan):
    src = _hf_model(tmp_path / "hf", tied=tied)
    ref = _hf_logits(src, BATCH)
    cfg, parts, model = _import(src, scan_layers=scan)
    assert cfg.tie_word_embeddings is tied and cfg.scan_layers is scan
    # Scanned: one stacked [layers, ...] parameter per HF name pattern; unrolled: one per layer.
    q = (
        ("layers", "self_attn", "q_proj", "kernel")
        if scan
        else ("layers", 0, "self_attn", "q_proj", "kernel")
    )
    assert q in flat_params(parts.params)
    ours = _our_logits(model, BATCH)
    diff = float(np.max(np.abs(ours - ref)))
    print(f"import max abs diff ({'tied' if tied else 'untied'}): {diff:.3g}")
    assert diff <= TOL

    out = tmp_path / "exported"
    write_hf(cfg, parts.params, out)
    back = _hf_logits(out, BATCH)
    diff_back = float(np.max(np.abs(back - ours)))
    print(f"export max abs diff ({'tied' if tied else 'untied'}): {diff_back:.3g}")
    assert diff_back <= TOL


def _same_tensors(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].shape == b[name].shape, name
        assert a[name].dtype == b[name].dtype, name
        assert a[name].tobytes() == b[name].tobytes(), name


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_round_trip_is_exact(tmp_path, tied):
    src = _hf_model(tmp_path / "hf", tied=tied)
    original = load_file(str(src / SINGLE))
    cfg, parts, _ = _import(src)

    single = tmp_path / "single"
    assert write_hf(cfg, parts.params, single) == ["config.json", SINGLE]
    _same_tensors(original, load_file(str(single / SINGLE)))

    # Sharded export (tiny shard limit), and import of the sharded dir, are exact too.
    sharded = tmp_path / "sharded"
    files = write_hf(cfg, parts.params, sharded, max_shard_bytes=64 * 1024)
    assert INDEX in files and len(files) > 3
    index = json.loads((sharded / INDEX).read_text())
    assert sorted(index["weight_map"]) == sorted(original)
    _same_tensors(original, read_safetensors(sharded))
    again = tmp_path / "again"
    _, parts2, _ = _import(sharded)
    write_hf(cfg, parts2.params, again)
    _same_tensors(original, load_file(str(again / SINGLE)))
    # transformers reads the sharded dir as well.
    np.testing.assert_array_equal(_hf_logits(sharded, BATCH), _hf_logits(src, BATCH))


def test_bf16_round_trip_keeps_dtype(tmp_path):
    src = tmp_path / "hf"
    _hf_model(src, tied=False)
    model = transformers.Qwen3ForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16")
    original = load_file(str(tmp_path / "bf16" / SINGLE))
    cfg, parts, _ = _import(tmp_path / "bf16")
    assert cfg.param_dtype == "bfloat16"
    write_hf(cfg, parts.params, tmp_path / "out")
    _same_tensors(original, load_file(str(tmp_path / "out" / SINGLE)))


def test_cli_import_then_export_and_sample(tmp_path):
    src = _hf_model(tmp_path / "hf", tied=False)
    run_dir = tmp_path / "runs" / "imported"
    r = run_cli("import", "hf", str(src), "--out", str(run_dir))
    assert r.returncode == 0, r.stderr
    assert (run_dir / "manifest.json").is_file()
    assert (run_dir / "config" / "resolved.json").is_file()
    r = run_cli(
        "export", "hf", str(run_dir), "--checkpoint", "latest", "--out", str(tmp_path / "o")
    )
    assert r.returncode == 0, r.stderr
    _same_tensors(load_file(str(src / SINGLE)), load_file(str(tmp_path / "o" / SINGLE)))
    # Every exported file (and the marker that lets a later export replace the folder) has the
    # mode a new file gets under this umask (the safetensors writer's temp file is 0600).
    (tmp_path / "probe").write_text("")
    plain = (tmp_path / "probe").stat().st_mode & 0o777
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "o").iterdir()}
    assert modes == {"config.json": plain, SINGLE: plain, MARKER: plain}
    r = run_cli("sample", "checkpoint", str(run_dir), "--prompt-ids", "1,2,3", "--top-k", "1")
    assert r.returncode == 0, r.stderr
    # Imported without --config there is no data to evaluate on: one sentence, not a bad path.
    r = run_cli("eval", "checkpoint", str(run_dir), "--checkpoint", "latest")
    assert r.returncode == 2 and "has no data manifest" in r.stderr, r.stderr
    assert len(stderr_lines(r.stderr)) == 1
    # A second import into the same run dir, or from a dir that is not there, is one sentence.
    r = run_cli("import", "hf", str(src), "--out", str(run_dir))
    assert r.returncode == 2 and "already has checkpoints" in r.stderr
    assert len(stderr_lines(r.stderr)) == 1
    r = run_cli("import", "hf", str(tmp_path / "missing"), "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and "is not a directory" in r.stderr
    assert len(stderr_lines(r.stderr)) == 1


def test_init_from_fills_model_keys_and_toml_wins(tmp_path):
    src = _hf_model(tmp_path / "hf", tied=False)
    base = tiny_config(str(tmp_path / "m.json"), str(tmp_path / "runs"))
    base["model"] = {"init_from": f"hf:{src}", "max_position_embeddings": 64}
    m = parse_run_config(base).model
    assert (m.vocab_size, m.hidden_size, m.num_layers, m.num_heads) == (128, 64, 2, 4)
    assert (m.num_kv_heads, m.head_dim, m.intermediate_size) == (2, 16, 128)
    assert m.max_position_embeddings == 64 and m.tie_word_embeddings is False

    for bad, why in [
        (tmp_path / "nowhere", "is not a directory"),
        (tmp_path, "has no config.json"),
    ]:
        base["model"] = {"init_from": f"hf:{bad}"}
        with pytest.raises(ConfigError, match=f"model.init_from.*{why}"):
            parse_run_config(base)
    base["model"] = {"init_from": "gs://bucket/model"}
    with pytest.raises(ConfigError, match="model.init_from: 'gs://bucket/model' is not 'hf:PATH'"):
        parse_run_config(base)
    other = tmp_path / "phi3"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "phi3"}))
    base["model"] = {"init_from": f"hf:{other}"}
    with pytest.raises(ConfigError, match="model.init_from: model_type 'phi3' is not supported"):
        parse_run_config(base)


def test_finetune_from_hf_then_export(tmp_path, prepared):
    """(The export runs in this process: `runtime export hf` as a user runs it is
    test_cli_import_then_export_and_sample's.)"""
    from runtime.commands.hf import export_checkpoint
    from runtime.commands.offline import restore_checkpoint
    from runtime.train.loop import train

    src = _hf_model(tmp_path / "hf", tied=False, vocab=260, max_position_embeddings=64)
    raw = tiny_config(
        prepared, str(tmp_path / "runs"), "ft", training={"target_tokens": 16 * 8 * 4}
    )
    raw["model"] = {"init_from": f"hf:{src}"}
    cfg = parse_run_config(raw)
    assert cfg.model.vocab_size == 260 and cfg.model.hidden_size == 64
    result = train(cfg, "", resume=False, emit=lambda _: None)
    assert result.status == "completed"
    run_dir = tmp_path / "runs" / "ft"
    rows = [json.loads(x) for x in (run_dir / "metrics" / "train.jsonl").read_text().splitlines()]
    # Training from the HF weights moves them (the loss falls, the exported tensors differ).
    assert len(rows) == 4 and rows[-1]["loss"] < rows[0]["loss"]

    out = tmp_path / "export"
    assert export_checkpoint(str(run_dir), "latest", str(out))["step"] == 4
    exported = load_file(str(out / SINGLE))
    start = load_file(str(src / SINGLE))
    assert not np.array_equal(exported["model.norm.weight"], start["model.norm.weight"])

    batch = BATCH % 257
    _, _, _, parts, _ = restore_checkpoint(str(run_dir), "latest")
    ours = _our_logits(nnx.merge(parts.graphdef, parts.params, *parts.others), batch)
    theirs = _hf_logits(out, batch)
    diff = float(np.max(np.abs(ours - theirs)))
    print(f"fine-tuned export max abs diff: {diff:.3g}")
    assert diff <= TOL


def test_import_with_config_then_resume(tmp_path, prepared):
    from jobspec.files.run_toml import load_run_config
    from runtime.train.loop import train

    src = _hf_model(tmp_path / "hf", tied=True, vocab=260, max_position_embeddings=64)
    raw = tiny_config(
        prepared, str(tmp_path / "runs"), "imp", training={"target_tokens": 16 * 8 * 3}
    )
    raw["model"] = {"init_from": f"hf:{src}"}
    toml = write_config(tmp_path / "cfg.toml", raw)
    out = import_to_run(str(src), str(tmp_path / "runs" / "imp"), config=str(toml))
    assert out["resumable"] is True
    cfg, source = load_run_config(toml)
    result = train(cfg, source, resume=True, emit=lambda _: None)
    assert result.status == "completed"
    rows = (tmp_path / "runs" / "imp" / "metrics" / "train.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in rows] == [1, 2, 3]


def _hf_moe_model(tmp: Path, *, tied: bool, norm_topk_prob: bool) -> Path:
    torch.manual_seed(1)
    config = transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=128, moe_intermediate_size=32,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=norm_topk_prob,
        tie_word_embeddings=tied, max_position_embeddings=128,
    )  # fmt: skip
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif "mlp.gate." in name:
                p.normal_(0.0, 0.5)  # a router that clearly prefers some experts
    model.save_pretrained(tmp)
    return tmp


@pytest.mark.parametrize(
    "tied,norm_topk_prob", [(True, True), (False, False)], ids=["tied-norm", "untied-nonorm"]
)
def test_moe_logit_parity_and_round_trip(tmp_path, tied, norm_topk_prob):
    src = _hf_moe_model(tmp_path / "hf", tied=tied, norm_topk_prob=norm_topk_prob)
    original = load_file(str(src / SINGLE))
    cfg, parts, model = _import(src)
    assert cfg.family == "qwen3_moe" and cfg.num_experts == 4
    assert cfg.norm_topk_prob is norm_topk_prob
    ref = _hf_logits(src, BATCH, cls=transformers.Qwen3MoeForCausalLM)
    ours = _our_logits(model, BATCH)
    diff = float(np.max(np.abs(ours - ref)))
    print(f"moe import max abs diff: {diff:.3g}")
    assert diff <= TOL

    out = tmp_path / "out"
    write_hf(cfg, parts.params, out)
    _same_tensors(original, load_file(str(out / SINGLE)))
    again = _hf_logits(out, BATCH, cls=transformers.Qwen3MoeForCausalLM)
    np.testing.assert_array_equal(again, ref)
