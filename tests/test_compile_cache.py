"""The persistent compilation cache is on by default, per user, and a user's own choice wins."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from runtime.host import compile_cache

from runs import ROOT, tiny_config, write_config


def test_on_by_default_under_the_users_cache_folder(tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    assert compile_cache.configure(env) == str(tmp_path / "jaxjob" / "xla")
    assert env["JAX_COMPILATION_CACHE_DIR"] == str(tmp_path / "jaxjob" / "xla")
    assert env["JAX_COMPILATION_CACHE_MAX_SIZE"] == str(compile_cache.CACHE_BYTES)


def test_the_users_folder_wins_and_zero_turns_it_off(tmp_path):
    mine = {"XDG_CACHE_HOME": str(tmp_path), "JAX_COMPILATION_CACHE_DIR": "/elsewhere"}
    assert compile_cache.configure(mine) == "/elsewhere"
    assert "JAX_COMPILATION_CACHE_MAX_SIZE" not in mine
    off = {"XDG_CACHE_HOME": str(tmp_path), "JAXJOB_COMPILATION_CACHE": "0"}
    assert compile_cache.configure(off) is None and "JAX_COMPILATION_CACHE_DIR" not in off


@pytest.mark.slow
def test_a_run_fills_the_cache_and_a_second_run_reads_it(tmp_path, prepared):
    """Two `runtime local` runs as a user starts them (no cache variable of the suite's): the
    first writes its programs to ~/.cache/jaxjob/xla, the second finds them there."""
    ours = ("JAX_COMPILATION_CACHE", "JAX_ENABLE_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE")
    env = {k: v for k, v in os.environ.items() if not k.startswith(ours)}
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"  # the tiny programs compile fast
    cache = tmp_path / "cache" / "jaxjob" / "xla"
    for run_id in ("first", "second"):
        cfg = tiny_config(prepared, str(tmp_path / "runs"), run_id=run_id)
        path = write_config(tmp_path / f"{run_id}.toml", cfg)
        res = subprocess.run(
            [sys.executable, "-m", "runtime", "local", str(path), "--max-steps", "2"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert res.returncode == 0, res.stderr
        if run_id == "first":
            entries = sorted(p.name for p in cache.glob("*-cache"))
            assert entries, list(cache.parent.rglob("*"))
            atimes = {p.name: p.read_bytes() for p in cache.glob("*-atime")}
    # The second run read its programs: their last-access stamps moved on.
    after = {p.name: p.read_bytes() for p in cache.glob("*-atime")}
    assert any(after.get(k) != v for k, v in atimes.items()), "no entry was read"
    lines = res.stderr.splitlines()  # the closing line alone: the cache says nothing
    assert len(lines) == 1 and lines[0].startswith("run second stopped: "), res.stderr
