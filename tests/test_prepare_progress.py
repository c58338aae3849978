"""The `data prepare` progress bar: its final state, its silence off a terminal, a clean --json
stdout, and a dataset that does not depend on it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from tqdm import tqdm

import runtime.data.prepare.progress as progress_mod
from runtime.data.manifest import load_manifest
from runtime.data.prepare.build import ENCODE_BATCH, prepare_dataset

from runs import write_text_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Text files plus a JSONL file (whose JSON framing is bytes read but not document text),
    with more documents than one tokenizer batch."""
    folder = write_text_corpus(tmp_path_factory.mktemp("corpus"), docs=24)
    lines = [json.dumps({"text": f"line {i} of the jsonl input"}) for i in range(ENCODE_BATCH + 9)]
    (folder / "lines.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def _inputs(folder: Path) -> list[str]:
    return [str(folder / "*.txt"), str(folder / "*.jsonl")]


def _input_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.suffix in (".txt", ".jsonl"))


@pytest.fixture
def bars(monkeypatch) -> list[tqdm]:
    """Every bar a prepare makes, kept for a look at its final counts."""
    made: list[tqdm] = []

    class Recorded(tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(progress_mod, "tqdm", Recorded)
    return made


def _final_line(stderr: str) -> str:
    return [s for s in stderr.replace("\n", "\r").split("\r") if s.strip()][-1]


def _shard_bytes(out: Path) -> list[bytes]:
    m = load_manifest(str(out / "manifest.json"))
    paths = [s.path for n in ("train", "validation") for s in m.split(n).shards]
    paths += [m.split(n).offsets for n in ("train", "validation")]
    return [(out / p).read_bytes() for p in paths]


def test_forced_bar_ends_at_every_byte_and_leaves_the_dataset_alone(corpus, tmp_path, capsys, bars):
    m = prepare_dataset(_inputs(corpus), "byte", str(tmp_path / "on"), progress=True)
    err = capsys.readouterr()
    assert err.out == ""
    (bar,) = bars
    total = _input_bytes(corpus)
    assert bar.total == total and bar.n == total
    line = _final_line(err.err)
    assert line.startswith("prepare: 100%"), line
    assert f"{tqdm.format_sizeof(total)}/{tqdm.format_sizeof(total)}" in line
    assert f"{m.total_documents} docs" in line and "tok/s" in line
    assert err.err.endswith("\n")  # the bar is closed: its last line stays

    plain = prepare_dataset(_inputs(corpus), "byte", str(tmp_path / "off"), progress=False)
    assert capsys.readouterr().err == ""
    assert plain.fingerprint == m.fingerprint
    assert _shard_bytes(tmp_path / "off") == _shard_bytes(tmp_path / "on")


def test_max_bytes_caps_the_total(corpus, tmp_path, capsys, bars):
    prepare_dataset(_inputs(corpus), "byte", str(tmp_path / "d"), max_bytes=3000, progress=True)
    (bar,) = bars
    assert bar.total == bar.n == 3000
    assert "100%" in _final_line(capsys.readouterr().err)


def test_auto_is_quiet_off_a_terminal(corpus, tmp_path, capsys, bars):
    prepare_dataset(_inputs(corpus), "byte", str(tmp_path / "d"))  # capsys' stderr: no tty
    assert capsys.readouterr().err == ""
    assert all(b.disable for b in bars)


def test_rollouts_bar_counts_documents(tmp_path, capsys):
    rows = [{"prompt_ids": [1, 2], "completion_ids": [3, 4, 5]}] * 7
    src = tmp_path / "r.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    m = prepare_dataset([str(src)], "byte", str(tmp_path / "d"), format="rollouts", progress=True)
    line = _final_line(capsys.readouterr().err)
    assert line.startswith("prepare: ") and f"{m.total_documents} docs" in line, line


@pytest.mark.parametrize("flag", [[], ["--progress"]])
def test_cli_json_stdout_stays_json(corpus, tmp_path, flag):
    from runtime.commands.cli import cli

    out = tmp_path / "d"
    args = ["data", "prepare", "--input", str(corpus / "*.txt"), "--out", str(out), "--json"]
    res = CliRunner().invoke(cli, args + flag)
    assert res.exit_code == 0, res.output
    assert (
        json.loads(res.stdout)["fingerprint"]
        == load_manifest(str(out / "manifest.json")).fingerprint
    )
    if flag:
        assert "prepare: 100%" in res.stderr
    else:
        assert res.stderr == ""  # auto: CliRunner's stderr is not a terminal
