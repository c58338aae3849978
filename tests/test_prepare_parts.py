"""A dataset is one thing however it was made: parquet, JSONL.zst and text inputs tokenized with
a BPE tokenizer give the same shards, offsets and fingerprint for 1, 2 and 3 workers and for one
host or three shares + merge; shares resume, and a merge with a part missing is refused."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from click.testing import CliRunner

from jobspec.errors import DataError
from runtime.data.manifest import load_manifest, read_offsets
from runtime.data.prepare.bpe import train_bpe
from runtime.data.prepare.build import merge_shares, prepare_dataset, prepare_share
from runtime.data.tokenizer import load_tokenizer

PART = 300  # input bytes per part: the corpus below makes five parts


def _doc(i: int) -> str:
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    return " ".join(words[(i * 7 + k) % len(words)] + str(k % 5) for k in range(20 + i % 13))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    """Parquet (two files, several row groups, a null), JSONL.zst and plain text; the documents
    in the order a prepare reads them (sorted paths, file order)."""
    root = tmp_path_factory.mktemp("corpus")
    docs: list[str] = []
    n = 0
    for name in ("a.parquet", "b.parquet"):
        texts = [_doc(n + i) for i in range(40)]
        column = texts[:7] + [None] + texts[7:]  # a null row is no document
        pq.write_table(pa.table({"body": column, "id": list(range(41))}), root / name,
                       row_group_size=9)  # fmt: skip
        docs += texts
        n += 40
    lines = [_doc(n + i) for i in range(30)]
    raw = "".join(json.dumps({"body": t}) + "\n" for t in lines).encode()
    (root / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    docs += lines
    for k in range(3):
        text = _doc(100 + k) + "\n"
        (root / f"d{k}.txt").write_text(text)
        docs.append(text)
    tok = train_bpe([_doc(i) for i in range(200)], 400, str(root / "tokenizer.json"))
    return {"root": root, "docs": docs, "tokenizer": tok,
            "inputs": [str(root / "*.parquet"), str(root / "*.jsonl.zst"), str(root / "*.txt")]}  # fmt: skip


def _identity(out: Path) -> dict:
    """What a dataset is: its fingerprint and the bytes of every shard and offsets file."""
    m = load_manifest(str(out / "manifest.json"))
    files = {}
    for name in ("train", "validation"):
        s = m.split(name)
        files[name] = [hashlib.sha256((out / p).read_bytes()).hexdigest()
                       for p in [sh.path for sh in s.shards] + [s.offsets]]  # fmt: skip
    return {"fingerprint": m.fingerprint, "files": files, "source": m.source.parts}


def _prepare(corpus: dict, out: Path, **kw) -> None:
    prepare_dataset(corpus["inputs"], corpus["tokenizer"], str(out), text_field="body",
                    part_bytes=PART, **kw)  # fmt: skip


def test_the_documents_are_the_inputs_in_order(corpus, tmp_path):
    out = tmp_path / "ds"
    _prepare(corpus, out, val_fraction=0, workers=1)
    m = load_manifest(str(out / "manifest.json"))
    assert m.source.parts > 3 and m.tokenizer.kind == "hf"
    tok = load_tokenizer(corpus["tokenizer"])
    offsets = read_offsets(m, "train")
    stream = np.concatenate([np.fromfile(out / sh.path, dtype=m.token_dtype)
                             for sh in m.split("train").shards])  # fmt: skip
    got = [stream[a:b] for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
    assert all(doc[-1] == tok.eos_id for doc in got)
    assert [tok.decode(doc[:-1]) for doc in got] == corpus["docs"]


def test_workers_and_shares_make_the_same_dataset(corpus, tmp_path):
    _prepare(corpus, tmp_path / "one", workers=1)
    want = _identity(tmp_path / "one")
    assert want["source"] > 3 and want["files"]["validation"]
    for workers in (2, 3):
        _prepare(corpus, tmp_path / f"w{workers}", workers=workers)
        assert _identity(tmp_path / f"w{workers}") == want, workers
    shared = tmp_path / "shared"
    reports = [
        prepare_share(
            corpus["inputs"],
            corpus["tokenizer"],
            str(shared),
            (i, 3),
            text_field="body",
            part_bytes=PART,
            workers=1,
        )  # fmt: skip
        for i in (2, 0, 1)  # hosts finish in any order
    ]
    assert sorted(p for r in reports for p in r.written) == list(range(want["source"]))
    assert not (shared / "manifest.json").exists()  # no dataset until the merge
    merge_shares(str(shared))
    assert _identity(shared) == want


def test_a_share_run_again_skips_its_parts_and_merge_names_what_is_missing(corpus, tmp_path):
    out = str(tmp_path / "ds")
    kw = dict(text_field="body", part_bytes=PART, workers=1)
    first = prepare_share(corpus["inputs"], corpus["tokenizer"], out, (0, 2), **kw)
    again = prepare_share(corpus["inputs"], corpus["tokenizer"], out, (0, 2), **kw)
    assert again.written == [] and again.skipped == first.written
    with pytest.raises(DataError, match=r"do not cover the input: \d+ of \d+ parts are missing "
                                        r"\(1, 3.*share p % N"):  # fmt: skip
        merge_shares(out)
    prepare_share(corpus["inputs"], corpus["tokenizer"], out, (1, 2), **kw)
    # A part lost after the fact (its commit gone) is the only thing a re-run writes.
    folder = tmp_path / "ds" / f"shares-{first.plan}"
    (folder / "part-00002" / "part.json").unlink()
    rerun = prepare_share(corpus["inputs"], corpus["tokenizer"], out, (0, 2), **kw)
    assert rerun.written == [2]
    merged = merge_shares(out)
    _prepare(corpus, tmp_path / "whole", workers=1)
    assert merged.fingerprint == _identity(tmp_path / "whole")["fingerprint"]


def test_shares_of_two_different_prepares_are_not_merged_blindly(corpus, tmp_path):
    out = str(tmp_path / "ds")
    a = prepare_share(corpus["inputs"], corpus["tokenizer"], out, (0, 1), text_field="body",
                      part_bytes=PART, workers=1)  # fmt: skip
    b = prepare_share(corpus["inputs"], corpus["tokenizer"], out, (0, 1), text_field="body",
                      part_bytes=PART, workers=1, val_fraction=0.5)  # fmt: skip
    assert a.plan != b.plan
    with pytest.raises(DataError, match="the shares of 2 different prepares .* pass --plan"):
        merge_shares(out)
    assert merge_shares(out, plan=b.plan).source.val_fraction == 0.5


def test_a_failing_part_in_a_worker_is_one_sentence_and_leaves_nothing(corpus, tmp_path):
    bad = tmp_path / "in"
    bad.mkdir()
    for k in range(4):
        (bad / f"ok{k}.txt").write_text(_doc(k) * 20)
    (bad / "z.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(b'{"text": "x"}\n')[:-6])
    out = tmp_path / "ds"
    with pytest.raises(DataError, match=r"z\.jsonl\.zst"):
        prepare_dataset([str(bad / "*")], "byte", str(out), part_bytes=PART, workers=2)
    assert not out.exists() or list(out.iterdir()) == []


def test_cli_shares_and_merge(corpus, tmp_path):
    from runtime.commands.cli import cli

    out = str(tmp_path / "ds")
    base = ["data", "prepare", "--input", str(corpus["root"] / "*.txt"), "--out", out,
            "--part-size", "1K", "--workers", "1"]  # fmt: skip
    for share in ("0/2", "1/2"):
        res = CliRunner().invoke(cli, [*base, "--shard", share, "--json"])
        assert res.exit_code == 0, res.output
        assert json.loads(res.output)["share"] == share
    res = CliRunner().invoke(cli, ["data", "merge", out])
    assert res.exit_code == 0 and "manifest.json" in res.output, res.output
    bad = CliRunner().invoke(cli, [*base, "--shard", "2/2"])
    assert bad.exit_code == 2 and "0 <= I < N" in bad.output
    bad = CliRunner().invoke(cli, [*base, "--shard", "0/2", "--max-bytes", "10"])
    assert bad.exit_code == 2 and "--max-bytes" in bad.output
    bad = CliRunner().invoke(cli, [*base, "--part-size", "lots"])
    assert bad.exit_code == 2 and "not a size" in bad.output
