"""`runtime plot`: curves of real tiny runs, as JSON series and as PNGs (one run and two)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from jobspec.files.run_toml import parse_run_config
from runtime.commands.cli import main
from runtime.observe.plot import DPI, FIGSIZE
from runtime.train.loop import train

from runs import read_jsonl, stderr_lines, tiny_config

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
STEPS = 8


def _train(cfg_dict: dict, **kw):
    return train(parse_run_config(cfg_dict), "# test\n", emit=lambda _line: None, **kw)


@contextlib.contextmanager
def _shared_compiles(folder: Path) -> Iterator[None]:
    """The three trainings below compile the same programs, and XLA's CPU compile is most of their
    time: they share a persistent compilation cache, and the session's settings come back after."""
    import jax
    from jax._src import compilation_cache

    keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    old = {k: jax.config.values[k] for k in keys}
    jax.config.update(keys[0], str(folder))
    jax.config.update(keys[1], 0)
    compilation_cache.reset_cache()  # the cache reads its settings once
    try:
        yield
    finally:
        for k, v in old.items():
            jax.config.update(k, v)
        compilation_cache.reset_cache()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, prepared) -> tuple[Path, Path]:
    """Two 8-step runs with an eval every 4 steps; the second (another seed) stops at step 4 and
    resumes."""
    out = tmp_path_factory.mktemp("plot-runs")
    over = {
        "model": {"num_layers": 1},  # the curves are the subject here: the least to compile
        "training": {"target_tokens": 16 * 8 * STEPS, "eval_every": 4, "loss_chunk_size": 0},
        "evals": [{"name": "val", "batches": 1}],
    }
    with _shared_compiles(tmp_path_factory.mktemp("jax-cache")):
        _train(tiny_config(prepared, str(out), run_id="plain", **over), resume=False)
        resumed = tiny_config(prepared, str(out), run_id="resumed", run={"seed": 1}, **over)
        assert _train(resumed, resume=False, max_steps=4).status == "stopped"
        assert _train(resumed, resume=True).status == "completed"
    return out / "plain", out / "resumed"


def _plot(capsys, *args: str) -> str:
    main(["plot", *args])  # the console script's entry: returns on success
    return capsys.readouterr().out


def _check_png(path: Path) -> None:
    from matplotlib.image import imread

    assert path.read_bytes()[:8] == PNG_MAGIC
    image = imread(path)
    assert image.shape[:2] == (FIGSIZE[1] * DPI, FIGSIZE[0] * DPI)
    assert image.std() > 0  # something was drawn


def test_json_series_are_the_runs_records(capsys, runs):
    plain, resumed = runs
    got = json.loads(_plot(capsys, str(plain), str(resumed), "--json"))
    assert got["x"] == "step" and [r["run_id"] for r in got["runs"]] == ["plain", "resumed"]
    for run_dir, series in zip(runs, got["runs"], strict=True):
        rows = read_jsonl(run_dir / "metrics/train.jsonl")
        assert series["run"] == str(run_dir)
        assert series["train"] == {
            "x": [r["step"] for r in rows],
            "loss": [r["loss"] for r in rows],
            "lr": [r["lr"] for r in rows],
        }
        assert series["train"]["x"] == list(range(1, STEPS + 1))
        timed = [r for r in rows if "tokens_per_s" in r]
        assert timed, "the trainer times some rows"
        assert series["throughput"] == {
            "x": [r["step"] for r in timed],
            "tokens_per_s": [r["tokens_per_s"] for r in timed],
        }
        evals = read_jsonl(run_dir / "metrics/eval.jsonl")
        assert series["eval"] == {
            "val": {"x": [e["step"] for e in evals], "loss": [e["loss"] for e in evals]}
        }
        assert series["eval"]["val"]["x"] == [4, 8]
    assert got["runs"][0]["restarts"] == []
    assert got["runs"][1]["restarts"] == [4]


def test_x_tokens(capsys, runs):
    _, resumed = runs
    got = json.loads(_plot(capsys, str(resumed), "--json", "--x", "tokens"))["runs"][0]
    per_step = 16 * 8
    rows = read_jsonl(resumed / "metrics/train.jsonl")
    assert got["train"]["x"] == [r["tokens"] for r in rows]
    assert got["train"]["x"] == [s * per_step for s in range(1, STEPS + 1)]
    assert got["eval"]["val"]["x"] == [4 * per_step, 8 * per_step]
    assert got["restarts"] == [4 * per_step]


def test_png_for_one_run_and_for_two(capsys, runs, tmp_path):
    plain, resumed = runs
    one = tmp_path / "new" / "folder" / "one.png"  # parents are created
    assert _plot(capsys, str(resumed), "-o", str(one)).strip() == str(one)
    _check_png(one)
    two = tmp_path / "two.png"
    assert _plot(capsys, str(plain), str(resumed), "--out", str(two), "--x", "tokens").strip() == (
        str(two)
    )
    _check_png(two)


def test_the_default_png_goes_into_the_first_runs_folder(capsys, runs, tmp_path, monkeypatch):
    plain, resumed = runs
    monkeypatch.chdir(tmp_path)  # not into the folder the command was run from
    printed = _plot(capsys, str(plain), str(resumed)).strip()
    assert printed == f"{plain}/plots/curves.png"
    _check_png(plain / "plots" / "curves.png")
    assert list(tmp_path.iterdir()) == []


def test_not_a_run_is_one_sentence(capsys, runs, tmp_path):
    plain, _ = runs
    out = tmp_path / "never.png"
    with pytest.raises(SystemExit) as exc:
        main(["plot", str(plain), str(tmp_path / "nowhere"), "-o", str(out)])
    assert exc.value.code == 2
    err = stderr_lines(capsys.readouterr().err)
    assert err == [
        f"error: {tmp_path / 'nowhere'} is not a jaxjob run directory (no manifest.json there)"
    ]
    assert not out.exists()


@pytest.mark.gcs
def test_gs_run_to_gs_png(capsys, runs, gs_run_uri):
    from runfolder.storage import url_to_fs

    plain, _ = runs
    fs, root = url_to_fs(gs_run_uri)
    for rel in ("manifest.json", "events.jsonl", "metrics/train.jsonl", "metrics/eval.jsonl"):
        fs.pipe_file(f"{root}/plain/{rel}", (plain / rel).read_bytes())
    local = json.loads(_plot(capsys, str(plain), "--json"))["runs"][0]
    remote = json.loads(_plot(capsys, f"{gs_run_uri}/plain", "--json"))["runs"][0]
    assert remote.pop("run") == f"{gs_run_uri}/plain" and local.pop("run") == str(plain)
    assert remote == local
    out = f"{gs_run_uri}/plots/curves.png"
    assert _plot(capsys, f"{gs_run_uri}/plain", "-o", out).strip() == out
    assert fs.cat_file(f"{root}/plots/curves.png")[:8] == PNG_MAGIC
