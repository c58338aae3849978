"""Bad input: each case exits non-zero with one sentence naming the problem, and no traceback.

Cases run the real CLI entry point in-process (the same `main` the console script calls); two
run as subprocesses as well, to prove nothing else prints a traceback around it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.commands.cli import main

from runs import run_cli, stderr_lines, tiny_config, write_config


def make_tokenizer_json(path: Path, corpus: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["[UNK]", "</s>"])
    tok.train([str(p) for p in sorted(corpus.glob("*.txt"))], trainer)
    tok.save(str(path))
    return path


def cli(capsys, *args: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(args))
    err = capsys.readouterr().err
    return int(exc.value.code or 0), err


@pytest.fixture(scope="module")
def world(tmp_path_factory, prepared, corpus_dir):
    """A finished 2-step run to resume from, a second data set, and a tokenizer.json data set."""
    from jobspec.files.run_toml import parse_run_config
    from runtime.data.prepare.build import prepare_dataset
    from runtime.train.loop import train

    root = tmp_path_factory.mktemp("bad")
    base = tiny_config(
        prepared, str(root / "runs"), run_id="base", training={"target_tokens": 16 * 8 * 2}
    )
    train(parse_run_config(base), "", resume=False, emit=lambda _l: None)
    other = root / "other"
    (other / "in").mkdir(parents=True)
    (other / "in/a.txt").write_text("a different corpus entirely. " * 300)
    (other / "in/b.txt").write_text("with two documents in it. " * 300)
    prepare_dataset([str(other / "in/*.txt")], "byte", str(other / "data"), val_fraction=0.5)
    tok = make_tokenizer_json(root / "tokenizer.json", corpus_dir)
    prepare_dataset([str(corpus_dir / "*.txt")], str(tok), str(root / "hfdata"), val_fraction=0.1)
    corrupt = root / "corrupt"
    corrupt.mkdir()
    (corrupt / "manifest.json").write_text("{not json")
    blocker = root / "a-file"
    blocker.write_text("")
    return {
        "root": root, "base": base, "prepared": prepared,
        "other_manifest": str(other / "data/manifest.json"),
        "hf_manifest": str(root / "hfdata/manifest.json"), "tokenizer": str(tok),
        "corrupt": str(corrupt / "manifest.json"), "blocker": str(blocker),
    }  # fmt: skip


def _cfg(world, tmp_path, name="x", **over) -> str:
    cfg = tiny_config(world["prepared"], str(tmp_path / "runs"), run_id=name, **over)
    return str(write_config(tmp_path / f"{name}.toml", cfg))


# (case, how to build the command, a phrase the one sentence must contain)
FRESH_CASES = {
    "toml syntax": (
        lambda w, t: ["config", "check", _toml(t, "[run\nid = 1")],
        "TOML syntax error",
    ),
    "unknown key": (
        lambda w, t: ["local", _cfg(w, t, training={"sq_len": 4})],
        "training.sq_len: unknown key",
    ),
    "wrong type": (
        lambda w, t: ["local", _cfg(w, t, model={"hidden_size": "big"})],
        "model.hidden_size",
    ),
    "zero size": (lambda w, t: ["local", _cfg(w, t, model={"num_layers": 0})], "model.num_layers"),
    "negative size": (
        lambda w, t: ["local", _cfg(w, t, training={"global_batch_size": -8})],
        "training.global_batch_size",
    ),
    "seq_len too long": (
        lambda w, t: ["local", _cfg(w, t, training={"seq_len": 128})],
        "max_position_embeddings",
    ),
    "mesh misfit": (
        lambda w, t: ["local", _cfg(w, t, mesh={"data": 2})],
        "mesh.data x mesh.expert x mesh.fsdp x mesh.context x mesh.tensor",
    ),
    "manifest missing": (
        lambda w, t: ["local", _cfg(w, t, data={"manifest": str(t / "none/manifest.json")})],
        "does not exist",
    ),
    "manifest corrupt": (
        lambda w, t: ["local", _cfg(w, t, data={"manifest": w["corrupt"]})],
        "manifest",
    ),
    "tokenizer mismatch": (
        lambda w, t: ["local", _cfg(w, t, data={"tokenizer": w["tokenizer"]})],
        "data.tokenizer",
    ),
    "vocab too small": (
        lambda w, t: ["local", _cfg(w, t, model={"vocab_size": 100})],
        "model.vocab_size",
    ),
    "output not writable": (
        lambda w, t: ["local", _cfg(w, t, run={"output_uri": w["blocker"] + "/runs"})],
        "writ",
    ),
    "resume without checkpoint": (
        lambda w, t: ["local", "--resume", _cfg(w, t, name="fresh")],
        "no committed checkpoint",
    ),
    "no such config": (lambda w, t: ["local", str(t / "missing.toml")], "no such config file"),
    "export onto a file": (
        lambda w, t: ["export", "hf", str(w["root"] / "runs/base"), "--out", w["blocker"]],
        "is an existing file, not a directory",
    ),
    "bad --set": (lambda w, t: ["config", "check", _cfg(w, t), "--set", "training"], "--set"),
}


def _toml(tmp_path: Path, text: str) -> str:
    p = tmp_path / "broken.toml"
    p.write_text(text)
    return str(p)


def _one_sentence(err: str) -> str:
    lines = stderr_lines(err)
    assert len(lines) == 1, f"expected one line, got:\n{err}"
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize("case", sorted(FRESH_CASES))
def test_bad_input_fails_clearly(case, world, tmp_path, capsys):
    build, phrase = FRESH_CASES[case]
    code, err = cli(capsys, *build(world, tmp_path))
    assert code != 0
    line = _one_sentence(err)
    assert phrase in line, line


# Resume with an incompatible change: (override, the field the error must name)
RESUME_CASES = {
    "model shape": ({"model": {"hidden_size": 64}}, "compatibility.model.hidden_size"),
    "optimizer": ({"optimizer": {"lr": 1e-4}}, "compatibility.optimizer.lr"),
    "schedule": (
        {"optimizer": {"schedule": {"kind": "linear"}}},
        "compatibility.optimizer.schedule.kind",
    ),
    "data manifest": ("other", "compatibility.data.manifest"),
    "tokenizer": ("hf", "compatibility.data.tokenizer"),
    "seed": ({"run": {"seed": 7}}, "compatibility.run.seed"),
    "seq_len": ({"training": {"seq_len": 8}}, "compatibility.training.seq_len"),
    "batch size": (
        {"training": {"global_batch_size": 4}},
        "compatibility.training.global_batch_size",
    ),
    "accumulation": (
        {"training": {"gradient_accumulation_steps": 2}},
        "compatibility.training.gradient_accumulation_steps",
    ),
}


@pytest.mark.parametrize("case", sorted(RESUME_CASES))
def test_incompatible_resume_names_the_field(case, world, tmp_path, capsys):
    change, field = RESUME_CASES[case]
    if change == "other":
        change = {"data": {"manifest": world["other_manifest"]}}
    elif change == "hf":
        change = {"data": {"manifest": world["hf_manifest"], "tokenizer": world["tokenizer"]}}
    from jobspec.files.run_toml import merge

    cfg = merge(world["base"], change)
    cfg["training"]["target_tokens"] = 16 * 8 * 50
    path = write_config(tmp_path / "resume.toml", cfg)
    index = Path(world["base"]["run"]["output_uri"]) / "base/checkpoints/index.json"
    before = index.read_text()
    code, err = cli(capsys, "local", "--resume", str(path))
    assert code == 2
    line = _one_sentence(err)
    assert field in line and "cannot resume" in line, line
    assert index.read_text() == before  # nothing touched


@pytest.mark.gcs
def test_missing_bucket(world, tmp_path, capsys, gcs_bucket):
    code, err = cli(
        capsys, "local", _cfg(world, tmp_path, run={"output_uri": "gs://no-such-bucket-xyz/runs"})
    )
    assert code != 0
    line = _one_sentence(err)
    assert "no-such-bucket-xyz" in line and "does not exist" in line, line


def test_subprocess_errors_have_no_traceback(world, tmp_path):
    bad = _cfg(world, tmp_path, name="sub", model={"vocab_size": 100})
    for args in (["local", bad], ["config", "check", _toml(tmp_path, "x = [")]):
        res = run_cli(*args)
        assert res.returncode == 2
        _one_sentence(res.stderr)
        assert res.stdout == ""


def test_worker_with_an_unwritable_output_is_one_sentence(world, tmp_path):
    """The run's claim is the worker's first write there: an output under a file is one
    sentence naming it, exit 2 (not a traceback from the host log or the claim)."""
    cfg = _cfg(world, tmp_path, name="w")
    env = {
        "JAXJOB_RUN_ID": "w", "JAXJOB_NUM_PROCESSES": "1", "JAXJOB_PROCESS_ID": "0",
        "JAXJOB_ATTEMPT": "0", "JAXJOB_OUTPUT_URI": world["blocker"] + "/runs",
    }  # fmt: skip
    res = subprocess.run(
        [sys.executable, "-m", "runtime", "worker", cfg],
        capture_output=True, text=True, env={**os.environ, **env}, timeout=300,
    )  # fmt: skip
    assert res.returncode == 2, res.stderr
    line = _one_sentence(res.stderr)
    assert line.startswith("error: cannot claim the run at") and world["blocker"] in line, line
    assert "Not a directory; choose a writable run.output_uri" in line, line


def test_schema_lists_every_section():
    res = run_cli("config", "schema")
    assert res.returncode == 0
    schema = json.loads(res.stdout)
    assert set(schema["properties"]) == {
        "run", "model", "optimizer", "data", "training", "mesh", "evals", "checkpoint", "artifacts", "runtime",
        "metrics", "profile",
    }  # fmt: skip
