"""bench/accel_step.py runs on a CPU with the tiny shape and prints one JSON row per shape."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from runs import ROOT


def test_accel_step_rows_on_cpu(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "TMPDIR": str(tmp_path)}
    res = subprocess.run(
        [sys.executable, "bench/accel_step.py", "--model", "tiny", "--shapes", "64x4,32x2",
         "--steps", "2", "--set", "training.loss_chunk_size=16", "--profile-top", "3"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert [(r["seq_len"], r["batch"]) for r in rows] == [(64, 4), (32, 2)]
    for r in rows:
        assert "error" not in r, r
        assert r["sets"] == {"training": {"loss_chunk_size": 16}}
        assert r["tokens_per_s"] > 0 and r["step_s"] > 0
        m = r["compiled"]
        total = m["arguments_gib"] + m["temporaries_gib"] + m["outputs_gib"] - m["aliased_gib"]
        assert abs(m["bound_gib"] - total) < 0.002
        assert 0 < m["peak_gib"] <= m["bound_gib"] + 0.001
        # No causal halving on CPU's count either: the halved count is smaller by half the
        # attention term, and no MFU without a catalogued peak (never a guess).
        assert r["flops_per_token_causal"] < r["flops_per_token"]
        assert r["mfu"] is None and r["mfu_causal"] is None
        assert isinstance(r["top_ops"], list)
    assert list(tmp_path.iterdir()) == [], "the profile's trace folders are removed"
