"""Tiny run configs and helpers for the training suites (fast on 2 CPU cores)."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import tomli_w

from jobspec.files.run_toml import merge

ROOT = Path(__file__).resolve().parents[1]


def write_text_corpus(folder: Path, docs: int = 24) -> Path:
    """Real-looking text, deterministic: a few documents of varied length."""
    folder.mkdir(parents=True, exist_ok=True)
    base = Path(sysconfig.get_paths()["stdlib"]).glob("json/*.py")
    sources = [p.read_text(errors="replace") for p in sorted(base)] or ["lorem ipsum " * 200]
    text = "\n".join(sources)
    step = max(len(text) // docs, 200)
    for i in range(docs):
        (folder / f"doc-{i:03d}.txt").write_text(
            text[i * step : (i + 1) * step] or "empty document"
        )
    return folder


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory) -> Path:
    return write_text_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="session")
def prepared(tmp_path_factory, corpus_dir) -> str:
    """A prepared byte-tokenizer manifest shared by the session's runs."""
    from runtime.data.prepare.build import prepare_dataset

    out = tmp_path_factory.mktemp("data")
    prepare_dataset([str(corpus_dir / "*.txt")], "byte", str(out), val_fraction=0.1)
    return str(out / "manifest.json")


def tiny_config(manifest: str, output_uri: str, run_id: str = "t", **over) -> dict:
    cfg = {
        "run": {"id": run_id, "seed": 0, "output_uri": output_uri},
        "model": {
            "vocab_size": 260, "hidden_size": 32, "num_layers": 2, "num_heads": 4,
            "num_kv_heads": 2, "intermediate_size": 64, "max_position_embeddings": 64,
        },
        "optimizer": {"lr": 3e-3, "schedule": {"kind": "cosine", "warmup_steps": 2}},
        "data": {"manifest": manifest, "order": "shuffle"},
        "training": {"seq_len": 16, "global_batch_size": 8, "target_tokens": 16 * 8 * 20, "log_every": 1,
                     # Chunks of 6, 6 and 4: every tiny run takes the chunked loss path.
                     "loss_chunk_size": 6},
        "checkpoint": {"every": 0, "keep": 3, "async": True},
    }  # fmt: skip
    return merge(cfg, over)


def batch_of(ids) -> dict:
    """A train-step batch from token ids [accum, rows, seq + 1]: inputs and next-token
    targets [accum, rows, seq], every position counted, one document per row."""
    import jax.numpy as jnp

    a, r, t = ids.shape[0], ids.shape[1], ids.shape[2] - 1
    return {
        "inputs": jnp.asarray(ids[..., :-1], jnp.int32),
        "targets": jnp.asarray(ids[..., 1:], jnp.int32),
        "loss_mask": jnp.ones((a, r, t), jnp.float32),
        "segment_ids": jnp.ones((a, r, t), jnp.int32),
        "positions": jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (a, r, t)),
    }


class LazyModule:
    """Module `name`, imported on first use; where it is not installed, the test using it is
    skipped with `reason`. The HF parity files use it for torch and transformers: every xdist
    worker collects every file, and importing both cost ~4 s of each worker's collection."""

    def __init__(self, name: str, reason: str) -> None:
        self._name, self._reason, self._module = name, reason, None

    def __getattr__(self, attr: str):
        if attr.startswith("_"):  # what pytest's collection asks of every module global
            raise AttributeError(attr)
        if self._module is None:
            self._module = pytest.importorskip(self._name, reason=self._reason)
        return getattr(self._module, attr)


def xla_flags(devices: int) -> str:
    """XLA_FLAGS for a child process with `devices` CPU devices, keeping the suite's own flags
    (tests/conftest.py: the fast compile)."""
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device" not in f]
    return " ".join([*kept, f"--xla_force_host_platform_device_count={devices}"])


def write_config(path: Path, cfg: dict) -> Path:
    path.write_text(tomli_w.dumps(cfg))
    return path


def run_cli(
    *args: str, env: dict | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """The `runtime` CLI in a subprocess, exactly as a user runs it."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "runtime", *args],
        cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def read_jsonl(path: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def stderr_lines(text: str) -> list[str]:
    """The non-empty lines of a command's stderr (all of them: no accelerator probing is
    tolerated, see tests/test_quiet_start.py)."""
    return [ln for ln in text.splitlines() if ln.strip()]


def user_env() -> dict[str, str]:
    """This process's environment less what the suite sets for itself (JAX_PLATFORMS, a device
    count in XLA_FLAGS, and the TPU_* values an in-process plan sets for libtpu's compile-only
    topologies). The suite's fast XLA compile (tests/conftest.py) stays: it prints nothing and
    plays no part in the platform choice, and it lets the run's compile hit the suite's cache."""
    own = ("JAX_PLATFORMS", "XLA_FLAGS", "ALLOW_MULTIPLE_LIBTPU_LOAD")
    env = {k: v for k, v in os.environ.items() if k not in own and not k.startswith("TPU_")}
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    return env | ({"XLA_FLAGS": " ".join(flags)} if flags else {})
