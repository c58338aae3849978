"""The persistent compilation cache is on by default, per user on one host and in the run's
directory for a job of many hosts, and a user's own choice wins."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from runtime.host import compile_cache

from runs import ROOT, read_jsonl, tiny_config, write_config


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


def _ours(tmp_path, **env) -> dict:
    """The environment `configure` leaves for a user who set nothing, plus `env`."""
    out = {"XDG_CACHE_HOME": str(tmp_path), **env}
    compile_cache.configure(out)
    return out


def test_a_job_of_many_hosts_keeps_its_cache_in_the_run_and_the_choice_is_the_users(tmp_path):
    """Default: per user for one host, the run's directory for many (a restarted pod has an
    empty home but finds its run); `run`/`user` choose either; `0` and a folder the user set
    are left alone."""
    assert not compile_cache.run_dir_wanted(1, _ours(tmp_path))
    assert compile_cache.run_dir_wanted(2, _ours(tmp_path))
    assert compile_cache.run_dir_wanted(1, _ours(tmp_path, JAXJOB_COMPILATION_CACHE="run"))
    assert not compile_cache.run_dir_wanted(8, _ours(tmp_path, JAXJOB_COMPILATION_CACHE="user"))
    assert not compile_cache.run_dir_wanted(8, _ours(tmp_path, JAXJOB_COMPILATION_CACHE="0"))
    mine = _ours(tmp_path, JAX_COMPILATION_CACHE_DIR="/elsewhere", JAXJOB_COMPILATION_CACHE="run")
    assert not compile_cache.run_dir_wanted(8, mine)


def test_an_unknown_choice_is_one_sentence_where_a_run_starts(tmp_path):
    from jobspec.errors import ConfigError

    env = _ours(tmp_path, JAXJOB_COMPILATION_CACHE="shared")  # before jax: the default
    assert env["JAX_COMPILATION_CACHE_DIR"] == str(tmp_path / "jaxjob" / "xla")
    with pytest.raises(ConfigError) as caught:
        compile_cache.for_run(str(tmp_path / "run"), 2, env)
    assert str(caught.value) == (
        "JAXJOB_COMPILATION_CACHE='shared' is not one of 0 (off), 1 (the default), user (the "
        "per-user folder) or run (the run's directory); set one of them, or unset it"
    )


_PROBE = """
import sys
from runtime.host import compile_cache
compile_cache.configure()
import jax, jax.numpy as jnp
compile_cache.count_hits()
folder = compile_cache.for_run(sys.argv[1], int(sys.argv[2]))
jax.jit(lambda x: (x @ x).sum())(jnp.ones((64, 64))).block_until_ready()
print(folder, compile_cache.hits_on_this_thread())
"""


def _user_env(tmp_path) -> dict:
    """A user's environment: none of the suite's cache variables, JAX's defaults otherwise."""
    ours = ("JAX_COMPILATION_CACHE", "JAX_ENABLE_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE")
    env = {k: v for k, v in os.environ.items() if not k.startswith(ours)}
    env["XDG_CACHE_HOME"] = str(tmp_path / "home-cache")
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"  # the probe compiles fast
    return env


@pytest.mark.gcs
def test_a_gs_run_keeps_its_programs_in_the_bucket(tmp_path, gcs_emulator, gs_run_uri):
    """On gs:// the cache's entries are objects beside the run (JAX writes them through etils
    epath); a second process, as a restarted pod, loads its program from there. JAX's file lock
    is off there (it would lock a local `gs:/...` folder, nothing in the bucket)."""
    import fsspec

    env = {**_user_env(tmp_path), "PYTHONPATH": str(ROOT)}  # run from tmp_path: its cwd
    said = []
    for _ in range(2):
        res = subprocess.run(
            [sys.executable, "-c", _PROBE, gs_run_uri, "2"], cwd=tmp_path, env=env,
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert res.returncode == 0, res.stderr
        said.append(res.stdout.split())
    folder = f"{gs_run_uri}/compile-cache"
    assert said[0] == [folder, "0"] and said[1][0] == folder and int(said[1][1]) > 0, said
    fs = fsspec.filesystem("gcs", token="anon", endpoint_url=os.environ["STORAGE_EMULATOR_HOST"])
    assert any(p.endswith("-cache") for p in fs.ls(folder.removeprefix("gs://")))
    assert not (tmp_path / "gs:").exists()  # no local lock folder named after the bucket


@pytest.mark.slow
def test_a_restarted_attempt_finds_the_programs_in_its_run(tmp_path, prepared):
    """`JAXJOB_COMPILATION_CACHE=run` (a job of many hosts' default) as a user runs it: the
    first attempt writes its programs to `<run>/compile-cache`, a resume with an empty home
    (a new pod) loads its train step from there, and its first step says so."""
    env = _user_env(tmp_path)
    env["JAXJOB_COMPILATION_CACHE"] = "run"
    cfg = tiny_config(prepared, str(tmp_path / "runs"), run_id="pod",
                      training={"target_tokens": 16 * 8 * 4})  # fmt: skip
    path = write_config(tmp_path / "pod.toml", cfg)
    for attempt, extra in enumerate(([], ["--resume"])):
        env["XDG_CACHE_HOME"] = str(tmp_path / f"home-{attempt}")  # nothing kept at home
        res = subprocess.run(
            [sys.executable, "-m", "runtime", "local", str(path), "--max-steps", "2", *extra],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert res.returncode == 0, res.stderr
    run = tmp_path / "runs" / "pod"
    assert list((run / "compile-cache").glob("*-cache"))
    assert not (tmp_path / "home-0").exists() and not (tmp_path / "home-1").exists()
    firsts = [e for e in read_jsonl(run / "events.jsonl") if e["event"] == "first_step"]
    assert [e["compile_from_cache"] for e in firsts] == [False, True], firsts
