"""The run-config contract: shipped configs, the config reference, overrides, FLOPs and peaks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import jax
import pytest
import tomli_w
import yaml
from flax import nnx

from jobspec.docs import PAGE, reference_block
from jobspec.errors import ConfigError
from jobspec.families.model_config import ModelConfig
from jobspec.files.job_yaml import load_job
from jobspec.files.run_toml import (
    load_run_config,
    parse_run_config,
    read_toml,
    resolved_dict,
    to_toml,
)
from jobspec.hardware.catalogue import lookup
from jobspec.hardware.peaks import peak_bf16_flops
from jobspec.hf_config import hf_config_from_model, model_fields_from_hf
from jobspec.job_spec import check_mesh_fits
from runtime.commands.common import overrides
from runtime.model.flops import flops_per_token, parameter_counts
from runtime.model.qwen3.decoder import Qwen3Decoder
from runtime.run.compat import fingerprint
from runtime.train.loop import train

from runs import ROOT, tiny_config


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_shipped_configs_validate(path: Path):
    cfg, _ = load_run_config(path)
    assert cfg.training.total_steps > 0
    assert parse_run_config(tomllib.loads(to_toml(cfg))) == cfg  # serialise round trip


def test_config_reference_is_current():
    assert PAGE == ROOT / "docs" / "config.md"
    assert reference_block() in PAGE.read_text(), (
        "docs/config.md's config reference is stale: run `python -m jobspec.docs --write`"
    )


def test_smoke_resume_continues_smoke():
    smoke, _ = load_run_config(ROOT / "configs/smoke.toml")
    more, _ = load_run_config(ROOT / "configs/smoke_resume.toml")
    fp = dict(manifest_fingerprint="m", tokenizer_id="byte")
    assert fingerprint(smoke, **fp) == fingerprint(more, **fp)
    assert more.run.id == smoke.run.id
    assert more.training.target_tokens > smoke.training.target_tokens


def test_overrides_parse_toml_literals():
    assert overrides(
        ("training.target_tokens=2000", "data.order=sequential", "model.tie_word_embeddings=false")
    ) == {
        "training": {"target_tokens": 2000},
        "data": {"order": "sequential"},
        "model": {"tie_word_embeddings": False},
    }


@pytest.mark.parametrize(
    "kind,name,peak",
    [  # the vendors' dense (no sparsity) bf16 FLOP/s per chip
        ("TPU v4", "tpu-v4", 275e12),
        ("TPU v5 lite", "tpu-v5e", 197e12),
        ("TPU v5p", "tpu-v5p", 459e12),
        ("TPU v6 lite", "tpu-v6e", 918e12),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb", 312e12),
        ("NVIDIA A100-SXM4-80GB", "a100-80gb", 312e12),
        ("NVIDIA H100 80GB HBM3", "h100-80gb", 989e12),
        ("NVIDIA H100 PCIe", "h100-pcie", 756e12),
        ("NVIDIA H200", "h200", 989e12),
    ],
)
def test_known_peaks(kind, name, peak):
    assert peak_bf16_flops(kind) == (name, peak)


@pytest.mark.parametrize(
    "kind", ["cpu", "TFRT_CPU_0", "NVIDIA GeForce RTX 4090", "Some Future Chip"]
)
def test_unknown_devices_get_no_peak(kind):
    assert peak_bf16_flops(kind) is None


@pytest.mark.parametrize("tied", [True, False])
def test_parameter_counts_match_the_model(tied):
    cfg = ModelConfig(vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      intermediate_size=64, tie_word_embeddings=tied)  # fmt: skip
    model = Qwen3Decoder(cfg, rngs=nnx.Rngs(params=0))
    actual = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    counts = parameter_counts(cfg)
    assert counts["total"] == actual
    f = flops_per_token(cfg, seq_len=16)
    # The head matmul counts once either way; the input embedding is a lookup, never counted.
    assert f["params_counted"] == actual - 97 * 32 + (97 * 32 if tied else 0)
    assert f["attention"] == 12 * 2 * 16 * 4 * 8
    assert f["total"] == 6 * f["params_counted"] + f["attention"]


# ---- include: a run config takes sections (e.g. its [model]) from shared files ----------------


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _tiny_run(tmp_path: Path, model_file: str = "models/tiny.toml") -> Path:
    """run.toml including a [model] file (which includes a dtype preset), overriding one key."""
    model = {k: v for k, v in tiny_config("m.json", "out")["model"].items()}
    _write(tmp_path / "presets/bf16.toml", '[model]\ncompute_dtype = "bfloat16"\nremat = "full"\n')
    _write(
        tmp_path / model_file,
        'include = ["../presets/bf16.toml"]\n' + tomli_w.dumps({"model": model}),
    )
    run = {k: v for k, v in tiny_config("m.json", str(tmp_path / "runs"), run_id="inc").items()}
    del run["model"]
    run["model"] = {"num_layers": 3}
    return _write(tmp_path / "run.toml", f'include = ["{model_file}"]\n' + tomli_w.dumps(run))


def test_include_merges_in_order_with_the_including_file_last(tmp_path):
    _write(tmp_path / "a.toml", '[model]\nhidden_size = 1\nnum_heads = 1\n[[evals]]\nname = "a"\n')
    _write(tmp_path / "b.toml", "[model]\nhidden_size = 2\nnum_layers = 2\n")
    top = _write(
        tmp_path / "top.toml",
        'include = ["a.toml", "b.toml"]\n[model]\nnum_layers = 3\n[[evals]]\nname = "top"\n',
    )
    data = read_toml(top)
    assert "include" not in data
    # Later files override earlier ones key by key; the including file's own keys win.
    assert data["model"] == {"hidden_size": 2, "num_heads": 1, "num_layers": 3}
    assert data["evals"] == [{"name": "top"}]  # arrays (of tables) replace, never concatenate


def test_included_paths_are_relative_to_the_including_file(tmp_path, monkeypatch):
    run = _tiny_run(tmp_path)
    monkeypatch.chdir(tmp_path / "presets")  # the working directory plays no part
    cfg, _ = load_run_config(run)
    assert cfg.model.num_layers == 3  # the run's own key
    assert cfg.model.hidden_size == 32  # from models/tiny.toml
    assert cfg.model.compute_dtype == "bfloat16"  # from presets/bf16.toml, two levels down


def test_resolved_config_and_source_carry_no_include(tmp_path):
    run = _tiny_run(tmp_path)
    cfg, source = load_run_config(run)
    assert "include" not in resolved_dict(cfg)
    parsed = tomllib.loads(source)
    assert "include" not in parsed
    # The source text a run records is self-contained: it loads alone, anywhere, to the same config.
    alone = _write(tmp_path / "elsewhere/source.toml", source)
    assert load_run_config(alone)[0] == cfg
    assert parse_run_config(tomllib.loads(to_toml(cfg))) == cfg


def test_a_config_without_include_keeps_its_text(tmp_path):
    path = _write(
        tmp_path / "plain.toml", "# comment kept\n" + tomli_w.dumps(tiny_config("m", "o"))
    )
    assert load_run_config(path)[1] == path.read_text()


@pytest.mark.parametrize(
    "files,words",
    [
        ({"top.toml": 'include = ["nope.toml"]\n'}, ["top.toml", "include", "'nope.toml' not found"]),
        (
            {"top.toml": 'include = ["a.toml"]\n', "a.toml": 'include = ["sub/b.toml"]\n',
             "sub/b.toml": 'include = ["../a.toml"]\n'},
            ["b.toml: include", "'../a.toml'", "cycle", "a.toml -> "],
        ),
        ({"top.toml": 'include = ["top.toml"]\n'}, ["top.toml: include", "cycle"]),
        ({"top.toml": 'include = "a.toml"\n'}, ["top.toml: include", "expected a list"]),
        ({"top.toml": 'include = ["a.toml"]\n', "a.toml": "[model\n"}, ["a.toml: TOML syntax error"]),
    ],
    ids=["missing", "cycle", "self", "not-a-list", "syntax-in-included"],
)  # fmt: skip
def test_bad_includes_are_one_sentence_naming_the_path(tmp_path, files, words):
    for name, text in files.items():
        _write(tmp_path / name, text)
    with pytest.raises(ConfigError) as e:
        load_run_config(tmp_path / "top.toml")
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, (w, msg)


def test_the_same_file_twice_is_no_cycle(tmp_path):
    _write(tmp_path / "base.toml", "[model]\nnum_heads = 4\n")
    _write(tmp_path / "a.toml", 'include = ["base.toml"]\n[model]\nhidden_size = 32\n')
    top = _write(tmp_path / "top.toml", 'include = ["a.toml", "base.toml"]\n')
    assert read_toml(top) == {"model": {"num_heads": 4, "hidden_size": 32}}


def test_a_table_with_include_is_not_parsed_blindly():
    with pytest.raises(ConfigError, match="include: only a run-config file can include"):
        parse_run_config({"include": ["x.toml"], **tiny_config("m", "o")})


def _render(job: Path, backend: str, tmp_path: Path) -> Path:
    out = tmp_path / f"render-{backend}"
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state")}
    r = subprocess.run(
        [sys.executable, "-m", "launch.cli", "render", str(job), "--backend", backend, "-o", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    return out


def test_hosts_receive_the_merged_run_config_on_every_backend(tmp_path):
    _tiny_run(tmp_path / "cfg")
    job = _write(
        tmp_path / "jobs/job.yaml",
        "name: inc\nimage: example.com/jaxjob:1\nrun: ../cfg/run.toml\nhosts: 1\n",
    )
    loaded = load_job(job)
    assert "include" not in tomllib.loads(loaded.run_toml)
    assert loaded.run.model.compute_dtype == "bfloat16" and loaded.run.model.num_layers == 3
    for backend in ("local", "slurm", "k8s"):
        out = _render(job, backend, tmp_path)
        if backend == "k8s":
            cm = yaml.safe_load((out / "configmap.yaml").read_text())
            text = cm["data"]["cfg.toml"]
        else:
            text = (out / "cfg.toml").read_text()
        hosts_read = tomllib.loads(text)
        assert "include" not in hosts_read, backend
        assert parse_run_config(hosts_read).model == loaded.run.model, backend


def test_an_inline_run_includes_relative_to_the_job_spec(tmp_path):
    _tiny_run(tmp_path)
    job = _write(
        tmp_path / "job.yaml",
        yaml.safe_dump(
            {"name": "inl", "run": {"include": ["run.toml"], "training": {"log_every": 7}}}
        ),
    )
    loaded = load_job(job)
    assert loaded.run.training.log_every == 7 and loaded.run.model.num_layers == 3
    assert "include" not in tomllib.loads(loaded.run_toml)


def test_a_run_records_the_merged_config(tmp_path, prepared):
    run = _tiny_run(tmp_path)
    text = run.read_text().replace('manifest = "m.json"', f"manifest = {json.dumps(prepared)}")
    run.write_text(text)
    cfg, source = load_run_config(run, {"training": {"target_tokens": 16 * 8 * 2}})
    train(cfg, source, resume=False, emit=lambda _line: None)
    run_dir = tmp_path / "runs" / "inc"
    recorded = tomllib.loads((run_dir / "config/source.toml").read_text())
    resolved = json.loads((run_dir / "config/resolved.json").read_text())
    assert "include" not in recorded and "include" not in resolved
    assert recorded["model"]["compute_dtype"] == "bfloat16"
    assert resolved["model"]["num_layers"] == 3


# ---- real model sizes: configs/models, configs/plan, configs/jobs ------------------------------

MODELS = ROOT / "configs/models"
# file: (total, without embeddings, active per token), the parameter counts published on the
# Hugging Face model cards of Qwen/Qwen3-* (the non-embedding count excludes the LM head too).
PUBLISHED = {
    "qwen3-0.6b.toml": (0.6e9, 0.44e9, None),
    "qwen3-1.7b.toml": (1.7e9, 1.4e9, None),
    "qwen3-4b.toml": (4.0e9, 3.6e9, None),
    "qwen3-8b.toml": (8.2e9, 6.95e9, None),
    "qwen3-14b.toml": (14.8e9, 13.2e9, None),
    "qwen3-32b.toml": (32.8e9, 31.2e9, None),
    "qwen3-30b-a3b.toml": (30.5e9, 29.9e9, 3.3e9),
}
TIED = {"qwen3-0.6b.toml", "qwen3-1.7b.toml", "qwen3-4b.toml"}


#: Gemma 4 files: total parameters on the model card (google/gemma-4-31B: 30.7B).
GEMMA4_PUBLISHED = {"gemma4-31b.toml": 30.7e9}
#: Qwen3-Next files: (total, active per token) on the model card (Qwen/Qwen3-Next-80B-A3B:
#: 80B, 3B activated; the active count here is without the embedding table and head).
QWEN3_NEXT_PUBLISHED = {"qwen3-next-80b-a3b.toml": (80e9, 3e9)}
#: Llama files: total parameters on the model cards (checked exactly in tests/test_llama.py).
LLAMA_PUBLISHED = {"llama-3.2-1b.toml": 1.24e9, "llama-3.1-8b.toml": 8.03e9,
                   "llama-3.1-70b.toml": 70.6e9}  # fmt: skip
#: gpt-oss files: total parameters on the model cards (checked in tests/test_gpt_oss.py).
GPT_OSS_PUBLISHED = {"gpt-oss-20b.toml": 21e9, "gpt-oss-120b.toml": 117e9}
#: DeepSeek-V3 files: total parameters (the model card's 671B; the 16B cut is not released, the
#: count is its file's own; checked in tests/test_deepseek_v3.py).
DEEPSEEK_V3_PUBLISHED = {"deepseek-v3-671b.toml": 671e9, "deepseek-v3-16b-cut.toml": 16.7e9}
#: Qwen3.5 files: total parameters on the model cards (Qwen/Qwen3.5-27B: 27B;
#: Qwen/Qwen3.5-397B-A17B: 397B; checked in tests/test_qwen3_5.py).
QWEN3_5_PUBLISHED = {"qwen3.5-27b.toml": 27e9, "qwen3.5-397b-a17b.toml": 397e9}


def test_every_model_file_has_a_published_count():
    names = sorted(p.name for p in MODELS.glob("*.toml"))
    published = {**PUBLISHED, **GEMMA4_PUBLISHED, **QWEN3_NEXT_PUBLISHED, **LLAMA_PUBLISHED}
    published |= {**GPT_OSS_PUBLISHED, **DEEPSEEK_V3_PUBLISHED, **QWEN3_5_PUBLISHED}
    assert names == sorted(published)


@pytest.mark.parametrize("name", sorted(QWEN3_NEXT_PUBLISHED))
def test_qwen3_next_model_files_match_the_published_count_and_an_hf_import(name):
    m = ModelConfig.model_validate(read_toml(MODELS / name)["model"])
    assert m.family == "qwen3_next" and m.scan_layers is True  # in periods of 4
    total, active = QWEN3_NEXT_PUBLISHED[name]
    counts = parameter_counts(m)
    assert counts["total"] == pytest.approx(total, rel=0.01)
    assert counts["active_non_embedding"] == pytest.approx(active, rel=0.1)
    # Export a config.json, import it: the same model (the layer pattern the file leaves out
    # comes back spelled out), so a second export is the first.
    hf = hf_config_from_model(m.model_dump())
    back = ModelConfig.model_validate({**m.model_dump(), **model_fields_from_hf(hf)})
    assert back.qwen3_next.resolved_layer_types(48) == m.qwen3_next.resolved_layer_types(48)
    assert back.model_copy(update={"qwen3_next": m.qwen3_next}) == m
    assert hf_config_from_model(back.model_dump()) == hf


@pytest.mark.parametrize("name", sorted(GEMMA4_PUBLISHED))
def test_gemma4_model_files_match_the_published_count_and_an_hf_import(name):
    m = ModelConfig.model_validate(read_toml(MODELS / name)["model"])
    assert m.family == "gemma4_text" and m.scan_layers is False
    assert parameter_counts(m)["total"] == pytest.approx(GEMMA4_PUBLISHED[name], rel=0.01)
    # Export a config.json, import it: the same model (defaults the file leaves out, such as the
    # 5:1 layer pattern, come back spelled out), so a second export is the first.
    hf = hf_config_from_model(m.model_dump())
    back = ModelConfig.model_validate({**m.model_dump(), **model_fields_from_hf(hf)})
    assert back.gemma4.resolved_layer_types(60) == m.gemma4.resolved_layer_types(60)
    assert parameter_counts(back) == parameter_counts(m)
    assert hf_config_from_model(back.model_dump()) == hf


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_model_files_match_the_published_parameter_counts(name):  # Qwen3
    data = read_toml(MODELS / name)
    assert list(data) == ["model"], "a model file holds only a [model] section"
    m = ModelConfig.model_validate(data["model"])
    assert (m.vocab_size, m.head_dim, m.max_position_embeddings) == (151936, 128, 40960)
    assert m.tie_word_embeddings == (name in TIED)
    # remat "auto" where the preset was measured on a chip (docs/performance.md).
    remat = "auto" if name == "qwen3-0.6b.toml" else "full"
    assert (m.param_dtype, m.compute_dtype, m.remat) == ("float32", "bfloat16", remat)
    counts = parameter_counts(m)
    total, non_embedding, active = PUBLISHED[name]
    assert counts["total"] == pytest.approx(total, rel=0.03)
    assert counts["non_embedding"] == pytest.approx(non_embedding, rel=0.03)
    if active is not None:
        assert m.family == "qwen3_moe"
        assert (m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size) == (128, 8, 768)
        used = counts["active_non_embedding"] + counts["embedding"] + counts["lm_head"]
        assert used == pytest.approx(active, rel=0.03)
    else:
        assert m.family == "qwen3"


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_model_files_agree_with_an_hf_import(name):
    # The same shapes through hf_config: export a config.json, import it, get the file back.
    m = ModelConfig.model_validate(read_toml(MODELS / name)["model"])
    fields = model_fields_from_hf(hf_config_from_model(m.model_dump()))
    assert {k: getattr(m, k) for k in fields} == fields


PLANS = sorted((ROOT / "configs/plan").glob("*.toml"))


@pytest.mark.parametrize("path", PLANS, ids=lambda p: p.name)
def test_plan_configs_resolve(path: Path):
    assert "include" in tomllib.loads(path.read_text()), "plan configs share their model file"
    cfg, source = load_run_config(path)
    assert "include" not in tomllib.loads(source) and "include" not in resolved_dict(cfg)
    assert parse_run_config(tomllib.loads(to_toml(cfg))) == cfg
    assert cfg.data.manifest.startswith("gs://YOUR-BUCKET/")  # a placeholder: plan reads no data
    # 4,096 tokens, or the long-context plans' 131,072 over mesh.context
    assert cfg.training.seq_len == (131_072 if "128k" in path.name else 4096)
    assert "128k" not in path.name or cfg.mesh.context > 1
    batch_axes = cfg.mesh.slices * cfg.mesh.data * cfg.mesh.fsdp
    assert cfg.training.global_batch_size % batch_axes == 0


def test_the_planned_jobs_are_the_issues():
    got = {}
    for p in PLANS:
        cfg, _ = load_run_config(p)
        got[p.stem] = (cfg.model.num_layers, cfg.training.global_batch_size, cfg.mesh.size)
    assert got["qwen3-8b-v5p-256"] == (36, 256, 128)  # 2 sequences a chip on 128 chips
    assert got["qwen3-8b-h100x32"] == (36, 32, 32)  # 1 sequence a GPU on 4 x 8 H100
    assert got["qwen3-32b-v5p-256"][0] == 64 and got["qwen3-1.7b-v6e-256"][2] == 256
    assert any(load_run_config(p)[0].model.family == "qwen3_moe" for p in PLANS)
    assert got["gemma4-31b-v5p-128"] == (60, 64, 64) and got["gemma4-31b-h100x32"] == (60, 32, 32)
    # Issue 39: Qwen3-8B, one sequence of 131,072 tokens over a v5p-8's 4 chips, 8 H100s
    assert got["qwen3-8b-128k-v5p-8"] == (36, 1, 4) and got["qwen3-8b-128k-h100x8"] == (36, 1, 8)


JOBS = sorted((ROOT / "configs/jobs").glob("*.yaml"))


@pytest.mark.parametrize("path", JOBS, ids=lambda p: p.name)
def test_job_specs_fit_their_accelerators(path: Path):
    job = load_job(path)
    acc = lookup(job.spec.accelerator)
    hosts = acc.hosts_per_slice if acc.hosts_per_slice is not None else job.spec.hosts
    assert hosts is not None
    devices = acc.chips_per_host * hosts * job.spec.slices
    assert job.run.mesh.size == devices
    assert job.run.mesh.slices == job.spec.slices
    for backend in ("k8s", "slurm") if acc.kind == "gpu" else ("k8s",):
        check_mesh_fits(job.spec, job.run, backend)
    assert "include" not in tomllib.loads(job.run_toml)
    assert parse_run_config(tomllib.loads(job.run_toml)) == job.run


def test_the_job_specs_cover_the_targets():
    targets = set()
    for p in JOBS:
        spec = load_job(p).spec
        targets.add((spec.accelerator, spec.slices, spec.total_hosts))
    assert targets >= {
        ("tpu-v5p-256", 1, 32), ("tpu-v5p-256", 2, 64), ("tpu-v6e-256", 1, 64),
        ("h100-80gb", 1, 4), ("h200", 1, 2),
    }  # fmt: skip
