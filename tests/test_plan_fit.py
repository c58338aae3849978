"""`runtime plan --fit` and `launch plan --fit`: settings chosen by compiling candidates."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from jobspec.files.run_toml import load_run_config

from runs import ROOT, tiny_config, user_env, write_config

pytestmark = pytest.mark.slow


def runtime(
    *args: str, timeout: float = 900, env: dict | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runtime", *args], cwd=ROOT,
                          env=dict(os.environ) if env is None else env,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


@pytest.mark.parametrize(
    "accelerator, fsdp, kernel, jobs",
    # The TPU search compiles in 2 worker processes (the default where cores allow), the GPU one
    # in this process: both paths of the search, for the price of one more process start.
    [("tpu-v5p-8", 4, "splash", "2"), ("h100-80gb", 8, "cudnn", "1")],
)
def test_fit_picks_a_setting_that_fits_and_writes_an_overlay(
    tmp_path, accelerator, fsdp, kernel, jobs
):
    out = tmp_path / "pick.toml"
    # As a user runs it (JAX_PLATFORMS unset: `runtime` chooses the platform), with libtpu and
    # the CUDA plugin installed: no probing, no plugin traceback on stderr (test_quiet_start.py).
    # One layer: the search is the same, each compile a little shorter.
    res = runtime("plan", "configs/tiny_plan.toml", "--accelerator", accelerator,
                  "--set", f"mesh.fsdp={fsdp}", "--set", "model.num_layers=1", "--fit", "--json",
                  "--jobs", jobs, "-o", str(out), env=user_env())  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stderr == "", res.stderr
    rep = json.loads(res.stdout)
    tried = {tuple(r["candidate"].values()) for r in rep["tried"]}
    # Both kernels that apply, every remat (those keeping splash's outputs with splash only);
    # seq 128 leaves only the whole-sequence loss; more accumulation of a setting that fits is
    # not compiled.
    splash_only = {(kernel, r) for r in ("attention", "attention_host") if kernel == "splash"}
    assert {(a, r) for a, r, *_ in tried} == splash_only | {
        (a, r) for a in (kernel, "xla") for r in ("full", "block", "none")
    }
    more = {a for a in (2, 4, 8, 16) if 16 % a == 0 and (16 // a) % fsdp == 0}
    assert {c["accumulation"] for c in rep["not_compiled_slower"]} == more
    pick = rep["pick"]
    assert pick["fits"] and pick["headroom"] >= 0.05
    best = max(r["predicted_tokens_per_s"] for r in rep["tried"] if r["fits"])
    assert pick["predicted_tokens_per_s"] == best
    cfg, _ = load_run_config(str(out), {})
    c = pick["candidate"]
    assert (cfg.model.attention, cfg.model.remat) == (c["attention"], c["remat"])
    assert cfg.training.loss_chunk_size == c["loss_chunk_size"]
    assert cfg.training.gradient_accumulation_steps == c["accumulation"]
    assert cfg.training.tokens_per_step == 16 * 128  # the step's batch is the config's
    assert cfg.model.hidden_size == 64  # the rest comes from the included config


def test_the_picked_overlay_trains(tmp_path, prepared):
    cfg = write_config(tmp_path / "run.toml", tiny_config(prepared, str(tmp_path / "runs")))
    out = tmp_path / "pick.toml"
    # --jobs 2 all the same: on cpu only one candidate compiles at a time.
    res = runtime("plan", str(cfg), "--accelerator", "cpu", "--fit", "--jobs", "2", "-o", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "pick: attention xla, remat full" in res.stdout and f"wrote {out}" in res.stdout
    # No step time ranks cpu candidates, so the first that compiles is the pick; of the 12 (3
    # remat x 4 accumulations; seq 16 leaves only the whole-sequence loss) no other compiles.
    assert "; 1 compiled, " in res.stdout, res.stdout
    assert "11 not compiled (no step time on cpu to rank them by)" in res.stdout, res.stdout
    res = runtime("local", str(out), "--max-steps", "2")
    assert res.returncode == 0, res.stderr[-3000:]
    assert (tmp_path / "runs" / "t" / "checkpoints").is_dir()


def test_nothing_fits_is_one_sentence_naming_the_smallest_peak(tmp_path):
    big = tmp_path / "big.toml"
    big.write_text(
        (ROOT / "configs/tiny_plan.toml").read_text()
        .replace("vocab_size = 512", "vocab_size = 262144")
        .replace("hidden_size = 64", "hidden_size = 4096")
        .replace("intermediate_size = 128", "intermediate_size = 16384")
        .replace("num_heads = 4", "num_heads = 32")
        .replace("num_kv_heads = 2", "num_kv_heads = 8")
        .replace("global_batch_size = 16", "global_batch_size = 1")
    )  # fmt: skip
    res = runtime("plan", str(big), "--accelerator", "tpu-v5e-1", "--fit", "--jobs", "1")
    assert res.returncode == 1, res.stderr[-3000:]
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: nothing fits tpu-v5e-1"), lines
    assert "the smallest peak found was" in lines[0] and "GiB per chip of 15.75 GiB" in lines[0]


def test_launch_plan_fit_writes_the_run_beside_the_overlay(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"name": "fit", "accelerator": "cpu", "hosts": 1,
                                   "run": str(ROOT / "configs/tiny_plan.toml")}))  # fmt: skip
    out = tmp_path / "pick.toml"
    res = subprocess.run([sys.executable, "-m", "launch.cli", "plan", str(job), "--fit", "-o", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    # The job's run config, written beside the overlay, which includes it.
    assert "[model]" in (tmp_path / "pick.run.toml").read_text()
    assert 'include = ["pick.run.toml"]' in out.read_text()
    cfg, _ = load_run_config(str(out), {})
    assert cfg.model.attention == "xla" and cfg.model.hidden_size == 64


def test_fit_splits_the_sequence_only_when_nothing_fits_without(monkeypatch, tmp_path):
    # The search's logic with a stand-in compile: on 4 v5p chips (fsdp 4), only a sequence
    # split over 4 devices fits. Every context-1 candidate is tried or ruled out first; then
    # context 2, then 4; the pick's overlay sets mesh.context and mesh.fsdp.
    from runtime.plan import fit as fit_mod

    seen = []

    def fake_compile(payload):
        cand = payload[-1]
        seen.append(cand)
        fits = cand.context >= 4
        return {"candidate": cand, "compiled": True, "fits": fits, "peak_bytes": 2**30,
                "hbm_bytes": 2**36, "headroom": 0.5 if fits else -0.1,
                "step_seconds": 1.0 + (cand.remat != "full"), "bound": "compute",
                "compile_seconds": 0.0}  # fmt: skip

    monkeypatch.setattr(fit_mod, "_compile_one", fake_compile)
    cfg, _ = load_run_config(str(ROOT / "configs/tiny_plan.toml"), {"mesh": {"fsdp": 4}})
    result = fit_mod.fit(cfg, "tpu-v5p-8", None, 1, jobs=1)
    contexts = [c.context for c in seen]
    assert contexts == sorted(contexts) and set(contexts) == {1, 2, 4}, contexts
    pick = result["pick"]["candidate"]
    assert (pick.context, pick.fsdp) == (4, 1)
    text = fit_mod.overlay_toml(pick, 16, str(ROOT / "configs/tiny_plan.toml"),
                                str(tmp_path / "o.toml"), "tpu-v5p-8", (1, 4))  # fmt: skip
    (tmp_path / "o.toml").write_text(text)
    over, _ = load_run_config(str(tmp_path / "o.toml"), {})
    assert (over.mesh.context, over.mesh.fsdp) == (4, 1)
