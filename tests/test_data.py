"""Data: tokenizers, prepare, manifest checks and the Grain loader (CPU, small files)."""

from __future__ import annotations

import json
import os
import sysconfig
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from jobspec.errors import ConfigError, DataError
from runtime.data.loader import (
    TokenBatches,
    check_for_run,
    check_tokenizer,
    check_vocab,
    eval_batches,
    train_batches,
)
from runtime.data.manifest import check_manifest, load_manifest, read_offsets
from runtime.data.prepare.build import expand_inputs, prepare_dataset
from runtime.data.sources import TokenStream
from runtime.data.tokenizer import ByteTokenizer, load_tokenizer, tokenizer_id_for

EOS = 256
KEYS = ("inputs", "targets", "loss_mask", "segment_ids", "positions")


def _write(dir_: Path, name: str, text: str) -> Path:
    p = dir_ / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    return p


def _stream(m, split: str) -> np.ndarray:
    s = TokenStream(m, split)
    return np.asarray(s.read(0, s.length)).astype(np.int64)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """~40 letter-coded documents of varied length, several shards per split; returns manifest uri."""
    src = tmp_path_factory.mktemp("src")
    rng = np.random.default_rng(0)
    for i in range(40):
        letter = chr(ord("a") + i % 26)
        _write(src, f"d{i:02d}.txt", letter * int(rng.integers(5, 90)))
    out = tmp_path_factory.mktemp("ds")
    prepare_dataset([f"{src}/*.txt"], "byte", str(out), val_fraction=0.1, shard_tokens=300)
    return str(out / "manifest.json")


# --- tokenizers --------------------------------------------------------------------------------


def test_byte_tokenizer_round_trip():
    tok = load_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer)
    assert (tok.id, tok.vocab_size, tok.eos_id) == ("byte", 257, 256)
    ids = tok.encode("héllo")
    assert ids.tolist() == list("héllo".encode())
    assert tok.decode([*ids.tolist(), EOS]) == "héllo"
    assert tokenizer_id_for("byte") == "byte"


def _hf_tokenizer(path: Path, specials: list[str]) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["def hello(): return 'world'\n"] * 20, trainer)
    tok.save(str(path))
    return path


def test_tokenizer_json_prepare(tmp_path):
    tj = _hf_tokenizer(tmp_path / "tokenizer.json", ["<pad>", "<|endoftext|>"])
    tok = load_tokenizer(str(tj))
    assert tok.id.startswith("hf:") and tok.id == tokenizer_id_for(str(tj))
    assert tok.eos_id == 1  # the end-of-text name wins over the other special token
    src = tmp_path / "src"
    _write(src, "a.txt", "def hello(): return 'world'\n")
    _write(src, "b.txt", "hello world\n")
    m = prepare_dataset([f"{src}/*.txt"], str(tj), str(tmp_path / "ds"), val_fraction=0.5)
    assert m.tokenizer.id == tok.id and m.tokenizer.kind == "hf"
    assert m.tokenizer.eos_id == 1 and m.token_dtype == "uint16"
    train = _stream(m, "train")
    assert train[-1] == 1 and tok.decode(train[:-1]) == "def hello(): return 'world'\n"
    check_tokenizer(m, str(tj))
    with pytest.raises(
        DataError, match="data.tokenizer is 'byte' but the manifest was made with 'hf:"
    ):
        check_tokenizer(m, "byte")


def test_tokenizer_json_without_eos_is_rejected(tmp_path):
    tj = _hf_tokenizer(tmp_path / "tokenizer.json", [])
    with pytest.raises(DataError, match="no end-of-document special token"):
        load_tokenizer(str(tj))
    with pytest.raises(DataError, match="does not exist"):
        load_tokenizer(str(tmp_path / "missing.json"))


# --- prepare -----------------------------------------------------------------------------------


def test_prepare_text_files(tmp_path):
    src = tmp_path / "src"
    _write(src, "a.txt", "aaaa")
    _write(src, "sub/deep/b.txt", "bb")
    _write(src, "c.txt", "ccccccc")
    _write(src, "sub/skip.md", "not matched")
    m = prepare_dataset(
        [f"{src}/**/*.txt"], "byte", str(tmp_path / "ds"), val_fraction=0.5, shard_tokens=4
    )
    # sorted paths: a.txt, c.txt, sub/deep/b.txt; every 2nd document (index 1) is validation
    assert _stream(m, "train").tolist() == [*b"aaaa", EOS, *b"bb", EOS]
    assert _stream(m, "validation").tolist() == [*b"ccccccc", EOS]
    assert read_offsets(m, "train").tolist() == [0, 5, 8]
    assert [s.tokens for s in m.splits.train.shards] == [4, 4]
    assert (m.total_tokens, m.total_documents, m.max_token_id) == (16, 3, EOS)
    loaded = load_manifest(str(tmp_path / "ds" / "manifest.json"))
    assert loaded == m
    summary = check_manifest(str(tmp_path / "ds" / "manifest.json"), deep=True)
    assert summary["ok"] and summary["splits"]["validation"]["documents"] == 1
    assert json.loads(json.dumps(summary)) == summary
    assert not list((tmp_path / "ds").glob("*.tmp"))


def test_prepare_jsonl_and_max_bytes(tmp_path):
    lines = [{"text": "first doc"}, {"text": "second"}, {"text": "third one"}, {"text": "x" * 50}]
    p = tmp_path / "in.jsonl"
    p.write_text(
        "\n".join(json.dumps(x) for x in lines[:2])
        + "\n\n"
        + "\n".join(json.dumps(x) for x in lines[2:])
    )
    m = prepare_dataset([str(p)], "byte", str(tmp_path / "ds"), val_fraction=0.5)
    assert _stream(m, "train").tolist() == [*b"first doc", EOS, *b"third one", EOS]
    assert m.splits.validation.documents == 2
    capped = prepare_dataset(
        [str(p)], "byte", str(tmp_path / "ds2"), val_fraction=0.0, max_bytes=20
    )
    assert capped.total_tokens - capped.total_documents == 20  # "first doc" + "second" + "third"
    assert _stream(capped, "train").tolist()[-6:] == [*b"third", EOS]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(DataError, match='line 2 of .*bad.jsonl has no string "text" field'):
        prepare_dataset([str(bad)], "byte", str(tmp_path / "ds3"))


def test_inputs_globs(tmp_path):
    with pytest.raises(DataError, match=r"input glob '.*nothing-\*\.txt' matches no files"):
        prepare_dataset([str(tmp_path / "nothing-*.txt")], "byte", str(tmp_path / "ds"))
    stdlib = sysconfig.get_paths()["stdlib"]
    files = expand_inputs(["{stdlib}/json/**/*.py"])
    assert files == sorted(files) and os.path.join(stdlib, "json", "__init__.py") in files
    assert not any("site-packages" in f for f in files)


def test_reprepare_replaces_old_files(tmp_path):
    src = tmp_path / "src"
    _write(src, "a.txt", "a" * 40)
    out = tmp_path / "ds"
    prepare_dataset([str(src / "a.txt")], "byte", str(out), val_fraction=0, shard_tokens=8)
    prepare_dataset([str(src / "a.txt")], "byte", str(out), val_fraction=0, shard_tokens=64)
    top = sorted(p.name for p in out.iterdir())
    assert len(top) == 2 and top[0] == "manifest.json" and top[1].startswith("shards-"), top
    # The merged offsets, and the one part's own files (the 8-token shards of the first are gone).
    assert sorted(p.name for p in (out / top[1]).iterdir()) == [
        "part-00000",
        "train-offsets.bin",
        "validation-offsets.bin",
    ]
    assert sorted(p.name for p in (out / top[1] / "part-00000").iterdir()) == [
        "part.json",
        "train-00000.bin",
        "train-offsets.bin",
        "validation-offsets.bin",
    ]


def test_reprepare_removes_an_older_layouts_loose_files(tmp_path):
    """Datasets prepared before shard folders kept their shards beside manifest.json; a new
    prepare removes those (and only those) once its own manifest is in place."""
    src = tmp_path / "src"
    _write(src, "a.txt", "a" * 40)
    out = tmp_path / "ds"
    out.mkdir()
    for name in ("train-00000.bin", "train-offsets.bin", "validation-offsets.bin", "notes.txt"):
        (out / name).write_bytes(b"old")
    # Its manifest (the old layout named the loose files): the folder is a jaxjob dataset's.
    (out / "manifest.json").write_text('{"format": "jaxjob.tokens", "version": 1}')
    prepare_dataset([str(src / "a.txt")], "byte", str(out), val_fraction=0)
    top = sorted(p.name for p in out.iterdir())
    assert top[:2] == ["manifest.json", "notes.txt"] and top[2].startswith("shards-"), top
    assert load_manifest(str(out / "manifest.json")).splits.train.tokens == 41


@pytest.mark.parametrize(
    "bad", ["../outside.bin", "/etc/passwd", "gs://other/x.bin", "a/../../x.bin"]
)
def test_manifest_paths_must_stay_inside_its_folder(tmp_path, bad):
    src = tmp_path / "src"
    _write(src, "a.txt", "a" * 40)
    out = tmp_path / "ds"
    prepare_dataset([str(src / "a.txt")], "byte", str(out), val_fraction=0)
    doc = json.loads((out / "manifest.json").read_text())
    doc["splits"]["train"]["shards"][0]["path"] = bad
    (out / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(DataError, match=r"splits\.train\.shards\[0\]\.path is .*not a path inside"):
        load_manifest(str(out / "manifest.json"))


# --- manifest errors ---------------------------------------------------------------------------


def _small_ds(tmp_path) -> Path:
    src = tmp_path / "src"
    for i in range(4):
        _write(src, f"{i}.txt", "abc" * (i + 3))
    prepare_dataset(
        [f"{src}/*.txt"], "byte", str(tmp_path / "ds"), val_fraction=0.5, shard_tokens=10
    )
    return tmp_path / "ds"


def test_manifest_errors(tmp_path):
    ds = _small_ds(tmp_path)
    man = ds / "manifest.json"
    with pytest.raises(DataError, match="does not exist; run `runtime data prepare`"):
        load_manifest(str(tmp_path / "nope" / "manifest.json"))
    good = man.read_text()
    man.write_text(good[:40])
    with pytest.raises(DataError, match="is not valid JSON"):
        load_manifest(str(man))
    doc = json.loads(good)
    doc["extra"] = 1
    man.write_text(json.dumps(doc))
    with pytest.raises(DataError, match="does not match the manifest schema at extra"):
        load_manifest(str(man))
    doc = json.loads(good)
    doc["splits"]["train"]["shards"][0]["tokens"] += 1
    doc["splits"]["train"]["tokens"] += 1
    man.write_text(json.dumps(doc))
    with pytest.raises(DataError, match="fingerprint .* does not match"):
        load_manifest(str(man))
    man.write_text(good)
    shard = next(ds.glob("shards-*")) / "part-00000" / "train-00001.bin"
    data = shard.read_bytes()
    shard.write_bytes(data[:-2])
    with pytest.raises(
        DataError,
        match=r"shard shards-\S+/part-00000/train-00001.bin is 18 bytes but the manifest records 20",
    ):
        load_manifest(str(man))
    shard.write_bytes(data[::-1])  # same size, other bytes: the sampled checksum sees it
    with pytest.raises(DataError, match=r"train-00001.bin does not hold what the prepare wrote"):
        load_manifest(str(man))
    shard.unlink()
    with pytest.raises(
        DataError, match=r"lists shard shards-\S+/train-00001.bin but .* does not exist"
    ):
        load_manifest(str(man))


def test_vocab_and_tokenizer_checks(corpus):
    m = load_manifest(corpus)
    check_vocab(m, 257)
    with pytest.raises(
        DataError,
        match=r"token ids up to 256 but model.vocab_size is 200; raise model.vocab_size to at least 257",
    ):
        check_vocab(m, 200)
    check_tokenizer(m, None)
    check_tokenizer(m, "byte")
    with pytest.raises(
        DataError, match="data.tokenizer is 'hf:0123' but the manifest was made with 'byte'"
    ):
        check_tokenizer(m, "hf:0123")


# --- loader ------------------------------------------------------------------------------------


def _steps(tb: TokenBatches, n: int, start: int = 0):
    with tb.iterate(start) as it:
        return [next(it) for _ in range(n)]


def test_sequential_records_and_layout(corpus):
    m = load_manifest(corpus)
    T = 16
    stream = _stream(m, "train")
    tb = TokenBatches(m, "train", T, 4, accum=2, order="sequential", prefetch=0)
    assert tb.records_per_epoch == (len(stream) - 1) // T
    (s0, b0, p0), (s1, b1, _) = _steps(tb, 2)
    assert (s0, s1) == (0, 1) and b0["inputs"].shape == (2, 4, T)
    assert p0["record_ids"] == list(range(8))
    for m_ in range(2):
        for r in range(4):
            j = m_ * 4 + r
            row = stream[j * T : j * T + T + 1]
            assert b0["inputs"][m_, r].tolist() == row[:-1].tolist()
            assert b0["targets"][m_, r].tolist() == row[1:].tolist()
    assert {k: b0[k].dtype.name for k in KEYS} == {
        "inputs": "int32",
        "targets": "int32",
        "loss_mask": "float32",
        "segment_ids": "int32",
        "positions": "int32",
    }
    assert (b0["segment_ids"] == 1).all() and (b0["loss_mask"] == 1).all()
    assert (b0["positions"] == np.arange(T)).all()


def test_determinism_and_epochs(corpus):
    m = load_manifest(corpus)
    a = _steps(TokenBatches(m, "train", 16, 4, order="shuffle", seed=1), 3)
    b = _steps(TokenBatches(m, "train", 16, 4, order="shuffle", seed=1), 3)
    c = _steps(TokenBatches(m, "train", 16, 4, order="shuffle", seed=2), 3)
    for x, y in zip(a, b, strict=True):
        assert x.provenance == y.provenance
        assert all((x.batch[k] == y.batch[k]).all() for k in KEYS)
    assert [x.provenance["batch_hash"] for x in a] != [x.provenance["batch_hash"] for x in c]
    assert not (a[0].batch["inputs"] == c[0].batch["inputs"]).all()
    # each epoch of shuffle is a fresh permutation of all records
    tb = TokenBatches(m, "train", 16, 1, order="shuffle", seed=1)
    n = tb.records_per_epoch
    ids = np.concatenate([tb.record_ids(s) for s in range(2 * n)])
    e0, e1 = ids[:n], ids[n:]
    assert sorted(e0) == sorted(e1) == list(range(n)) and (e0 != e1).any()


@pytest.mark.parametrize("order", ["sequential", "shuffle", "document_buffer"])
def test_process_count_independence(tmp_path, order):
    # one shard file, read by 1, 2 and 4 processes
    src = tmp_path / "src"
    for i in range(12):
        _write(src, f"{i:02d}.txt", chr(ord("a") + i) * (7 + 3 * i))
    m = prepare_dataset([f"{src}/*.txt"], "byte", str(tmp_path / "ds"), val_fraction=0.0)
    assert len(m.splits.train.shards) == 1
    gbs, accum, T, steps = 8, 2, 8, 5

    def global_batches(P: int):
        per_proc = [
            _steps(TokenBatches(m, "train", T, gbs, accum, order, 3, p, P), steps) for p in range(P)
        ]
        out = []
        for s in range(steps):
            hashes = {per_proc[p][s].provenance["batch_hash"] for p in range(P)}
            assert len(hashes) == 1
            batch = {
                k: np.concatenate([per_proc[p][s].batch[k] for p in range(P)], axis=1) for k in KEYS
            }
            out.append((hashes.pop(), per_proc[0][s].provenance["record_ids"], batch))
        return out

    ref = global_batches(1)
    for P in (2, 4):
        for (h1, ids1, b1), (h2, ids2, b2) in zip(ref, global_batches(P), strict=True):
            assert h1 == h2 and ids1 == ids2
            assert all((b1[k] == b2[k]).all() for k in KEYS)
            assert b2["inputs"].shape == (accum, gbs, T)
    with pytest.raises(
        ConfigError, match=r"global_batch_size \(8\) is not divisible by the 3 processes"
    ):
        TokenBatches(m, "train", T, gbs, accum, order, 3, 0, 3)


@pytest.mark.parametrize("order", ["shuffle", "document_buffer"])
def test_state_restore_resumes_exactly(corpus, order):
    m = load_manifest(corpus)
    tb = TokenBatches(m, "train", 16, 4, accum=2, order=order, seed=7, prefetch=2)
    it = tb.iterate()
    for _ in range(3):
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    assert state["next_step"] == 3 and state == tb.state_for(3)
    expected = [next(it) for _ in range(4)]
    it.close()
    # restore in a fresh loader, here read by process 1 of 2, and by a start step
    for p, P in ((0, 1), (1, 2)):
        fresh = TokenBatches(
            m, "train", 16, 4, accum=2, order=order, seed=7, process_index=p, process_count=P
        )
        with fresh.iterate() as it2:
            it2.set_state(state)
            got = [next(it2) for _ in range(4)]
        for e, g in zip(expected, got, strict=True):
            assert e.step == g.step and e.provenance == g.provenance
            lo = p * (4 // P)
            assert (e.batch["inputs"][:, lo : lo + 4 // P] == g.batch["inputs"]).all()
    started = _steps(TokenBatches(m, "train", 16, 4, accum=2, order=order, seed=7), 1, start=3)
    assert started[0].provenance == expected[0].provenance
    other = TokenBatches(m, "train", 16, 4, accum=2, order=order, seed=8)
    with other.iterate() as it3, pytest.raises(DataError, match="has seed 7 but this run has 8"):
        it3.set_state(state)


def test_document_buffer_boundary(tmp_path):
    src = tmp_path / "src"
    _write(src, "0.txt", "ab")  # → a b EOS
    _write(src, "1.txt", "cde")  # → c d e EOS
    m = prepare_dataset([f"{src}/*.txt"], "byte", str(tmp_path / "ds"), val_fraction=0.0)
    tb = TokenBatches(m, "train", 6, 1, order="document_buffer", seed=0, prefetch=0)
    assert tb.records_per_epoch == 1
    seen = set()
    for step in range(8):  # one row per epoch; both document orders occur across epochs
        b = tb.read_step(step)
        row = [int(x) for x in b["inputs"][0, 0]] + [int(b["targets"][0, 0, -1])]
        layout = [b[k][0, 0].tolist() for k in ("segment_ids", "positions", "loss_mask")]
        if row[0] == ord("a"):
            assert row == [*b"ab", EOS, *b"cde", EOS]
            assert layout == [[1, 1, 1, 2, 2, 2], [0, 1, 2, 0, 1, 2], [1, 1, 0, 1, 1, 1]]
        else:
            assert row == [*b"cde", EOS, *b"ab", EOS]
            assert layout == [[1, 1, 1, 1, 2, 2], [0, 1, 2, 3, 0, 1], [1, 1, 1, 0, 1, 1]]
        seen.add(row[0])
    assert seen == {ord("a"), ord("c")}


def test_document_buffer_invariants(corpus):
    m = load_manifest(corpus)
    T = 24
    tb = TokenBatches(m, "train", T, 4, accum=1, order="document_buffer", seed=5)
    stream = _stream(m, "train")
    offsets = read_offsets(m, "train")
    docs = [tuple(stream[a:b].tolist()) for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
    epoch_stream = []
    for step in range(tb.records_per_epoch // 4):
        b = tb.read_step(step)
        for r in range(4):
            inp, seg, pos, mask = (
                b[k][0, r] for k in ("inputs", "segment_ids", "positions", "loss_mask")
            )
            starts = np.flatnonzero(pos == 0)
            assert starts[0] == 0 and (seg == np.searchsorted(starts, np.arange(T), "right")).all()
            assert (np.diff(pos)[np.diff(seg) == 0] == 1).all()
            assert ((mask == 0) == (inp == EOS)).all()  # only a doc's eos → next doc is masked
            assert (np.flatnonzero(inp[:-1] == EOS) + 1 == starts[1:]).all()
            for sid in np.unique(seg):
                assert len({int(x) for x in inp[seg == sid] if x != EOS}) <= 1
            epoch_stream.extend(inp.tolist())
    # the rows of epoch 0, laid end to end, are whole documents in a permuted order
    pieces, cur = [], []
    for t in epoch_stream:
        cur.append(t)
        if t == EOS:
            pieces.append(tuple(cur))
            cur = []
    assert len(pieces) > 5 and not Counter(pieces) - Counter(docs)
    assert pieces != docs[: len(pieces)]


def test_eval_batches_fixed(corpus):
    m = load_manifest(corpus)
    runs = [list(eval_batches(m, "validation", 8, 2, 3)) for _ in range(2)]
    assert [s.step for s in runs[0]] == [0, 1, 2]
    for a, b in zip(*runs, strict=True):
        assert a.provenance == b.provenance and (a.batch["inputs"] == b.batch["inputs"]).all()
        assert a.batch["inputs"].shape == (1, 2, 8)
    with pytest.raises(DataError, match="validation split .* has 0 tokens"):
        empty = prepare_dataset([m.source.inputs[0]], "byte", m.root + "-noval", val_fraction=0.0)
        eval_batches(empty, "validation", 8, 2, 1)


def test_remote_style_read_path():
    """memory:// goes through the same fsspec range-read path as gs://."""
    import fsspec

    mem = fsspec.filesystem("memory")
    mem.pipe("/jaxjob-src/a.txt", b"hello remote world")
    mem.pipe("/jaxjob-src/b.txt", b"second")
    m = prepare_dataset(
        ["memory://jaxjob-src/*.txt"], "byte", "memory://jaxjob-ds", val_fraction=0.5
    )
    loaded = load_manifest("memory://jaxjob-ds/manifest.json")
    assert loaded.fingerprint == m.fingerprint
    assert check_manifest("memory://jaxjob-ds/manifest.json", deep=True)["ok"]
    b = TokenBatches(loaded, "train", 4, 2, order="sequential", prefetch=0).read_step(0)
    assert b["inputs"][0, 0].tolist() == list(b"hell") and b["inputs"][0, 1].tolist() == list(
        b"o re"
    )


def test_builders_from_run_config(corpus):
    from jobspec.run_config import DataConfig, TrainingConfig

    m = load_manifest(corpus)
    data = DataConfig(manifest=corpus, tokenizer="byte", order="document_buffer", prefetch=0)
    training = TrainingConfig(
        seq_len=16, global_batch_size=4, gradient_accumulation_steps=2, target_tokens=1000
    )
    tb = train_batches(m, data, training, seed=3, process_index=1, process_count=2)
    assert (tb.order, tb.seed, tb.accum, tb.local_rows) == ("document_buffer", 3, 2, 2)
    assert tb.local_record_ids(0).tolist() == [[2, 3], [6, 7]]
    assert json.loads(json.dumps(tb.describe()))["records_per_epoch"] == tb.records_per_epoch
    it = tb.iterate(2)
    assert next(it).step == 2
    tb.close()
    tb.close()  # idempotent, as the train loop's finally may run after an iterator closed
    check_for_run(m, data, vocab_size=257)
    with pytest.raises(DataError, match="raise model.vocab_size to at least 257"):
        check_for_run(m, data, vocab_size=256)


def test_a_failing_input_read_is_said_as_a_read_not_a_write():
    """Inputs are read lazily while the shards are written: a read that fails is the input's
    problem (exit 2) or a storage fault (45), never "cannot write the dataset"."""
    from jobspec.errors import StorageFaultError
    from runtime.data.prepare.parts import next_document as _next_document

    def failing(exc: Exception):
        raise exc
        yield  # a generator, like the documents of a prepare

    with pytest.raises(DataError, match=r"cannot read the inputs \['x/\*'\]: gone \(x/a\.txt\)"):
        _next_document(failing(FileNotFoundError(2, "gone", "x/a.txt")), ["x/*"])
    with pytest.raises(StorageFaultError, match=r"cannot read the inputs .*Input/output error"):
        _next_document(failing(OSError(5, "Input/output error")), ["x/*"])
    with pytest.raises(ZeroDivisionError):  # a bug is not dressed up as a storage problem
        _next_document(failing(ZeroDivisionError()), ["x/*"])


def test_an_output_under_a_file_is_one_sentence(tmp_path):
    from jobspec.errors import StorageError

    src = tmp_path / "src"
    _write(src, "a.txt", "a" * 40)
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(
        StorageError,
        match=r"cannot write the dataset to .*: Not a directory; choose a writable --out",
    ):
        prepare_dataset([str(src / "a.txt")], "byte", str(blocker / "ds"))


# --- inputs on the command line ----------------------------------------------------------------


def _invoke(*args: str):
    from click.testing import CliRunner

    from runtime.commands.cli import cli

    return CliRunner().invoke(cli, list(args))


def test_prepare_takes_every_path_an_unquoted_glob_expands_into(tmp_path):
    """`--input src/*.txt` unquoted reaches the command as `--input src/a.txt src/b.txt …`: every
    path is an input, a name with glob characters is that file, and the dataset is the one the
    quoted glob makes."""
    src = tmp_path / "src"
    files = [str(_write(src, f"d{i}.txt", chr(ord("a") + i) * (20 + i))) for i in range(3)]
    files.append(str(_write(src, "x[1].txt", "z" * 25)))  # a glob would read it as x1.txt
    res = _invoke("data", "prepare", "--input", *files, "--out", str(tmp_path / "paths"),
                  "--val-fraction", "0", "--progress", "--no-progress")  # fmt: skip
    assert res.exit_code == 0, res.output
    by_paths = load_manifest(str(tmp_path / "paths" / "manifest.json"))
    assert by_paths.source.files == 4 and by_paths.total_documents == 4
    assert by_paths.source.inputs == files
    res = _invoke("data", "prepare", "--input", f"{src}/*.txt", "--out", str(tmp_path / "glob"),
                  "--val-fraction", "0", "--no-progress")  # fmt: skip
    assert res.exit_code == 0, res.output
    by_glob = load_manifest(str(tmp_path / "glob" / "manifest.json"))
    assert by_paths.fingerprint == by_glob.fingerprint
    # --input stays repeatable, and paths before, between and after the options all count.
    res = _invoke("data", "prepare", files[0], "--input", files[1], "--out",
                  str(tmp_path / "mixed"), files[2], "--input", files[3], "--val-fraction", "0",
                  "--no-progress")  # fmt: skip
    assert res.exit_code == 0, res.output
    assert load_manifest(str(tmp_path / "mixed" / "manifest.json")).fingerprint == (
        by_glob.fingerprint
    )


def test_prepare_in_a_shell_with_an_unquoted_glob(tmp_path):
    """Exactly the failing report: the shell expands the glob, the command takes every file."""
    import subprocess
    import sys

    from runs import ROOT

    src = tmp_path / "pq"
    for i in range(3):
        _write(src, f"p{i}.jsonl", json.dumps({"text": f"document number {i}"}) + "\n")
    out = tmp_path / "ds"
    r = subprocess.run(f"{sys.executable} -m runtime data prepare --input {src}/*.jsonl "
                       f"--out {out} --val-fraction 0 --json", shell=True, cwd=ROOT,
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["total_documents"] == 3


def test_tokenizer_takes_every_path_too(tmp_path):
    src = tmp_path / "src"
    files = [
        str(_write(src, f"{word}.txt", f"{word} " * 200)) for word in ("alpha", "omega", "kappa")
    ]
    res = _invoke("data", "tokenizer", "--input", *files, "--vocab-size", "300", "--out",
                  str(tmp_path / "paths.json"))  # fmt: skip
    assert res.exit_code == 0, res.output
    res = _invoke("data", "tokenizer", "--input", f"{src}/*.txt", "--vocab-size", "300", "--out",
                  str(tmp_path / "glob.json"))  # fmt: skip
    assert res.exit_code == 0, res.output
    res = _invoke("data", "tokenizer", "--input", files[0], "--vocab-size", "300", "--out",
                  str(tmp_path / "first.json"))  # fmt: skip
    assert res.exit_code == 0, res.output
    paths = (tmp_path / "paths.json").read_text()
    assert paths == (tmp_path / "glob.json").read_text()
    assert paths != (tmp_path / "first.json").read_text()  # the other files were read too


@pytest.mark.parametrize("command", [["prepare"], ["tokenizer"]])
def test_no_input_at_all_is_one_sentence(tmp_path, command):
    res = _invoke("data", *command, "--out", str(tmp_path / "o"))
    assert res.exit_code == 2
    errors = [ln for ln in res.output.splitlines() if ln.startswith("Error:")]
    assert errors == [
        "Error: no input given; pass files or globs with --input, e.g. --input 'data/*.jsonl'"
    ]
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("command", ["prepare", "tokenizer"])
def test_help_says_paths_after_input_are_inputs(command):
    res = _invoke("data", command, "--help")
    assert res.exit_code == 0
    text = " ".join(res.output.split())
    assert "[OPTIONS] [PATH]..." in text
    assert "the paths that follow it are inputs too" in text


# --- a failed prepare leaves no --out folder it created -----------------------------------------


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _fail_with(kind: str, tmp_path: Path, monkeypatch) -> tuple[list[str], type]:
    """Inputs (and a patch) that make a prepare fail after it has made its folders."""
    src = tmp_path / "src"
    if kind == "no text":
        return [str(_write(src, "blank.txt", ""))], DataError
    if kind == "bad input":
        return [str(_write(src, "a.jsonl", '{"body": "no text field"}\n'))], DataError
    import runtime.data.prepare.build as prepare_mod

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(prepare_mod, "run_parts", interrupted)
    return [str(_write(src, "a.txt", "a" * 40))], KeyboardInterrupt


FAILURES = ["no text", "bad input", "ctrl-c"]


@pytest.mark.parametrize("kind", FAILURES)
def test_a_failed_prepare_removes_the_out_folders_it_made(tmp_path, monkeypatch, kind):
    inputs, error = _fail_with(kind, tmp_path, monkeypatch)
    made = tmp_path / "new"
    with pytest.raises(error):
        prepare_dataset(inputs, "byte", str(made / "deeper" / "ds"))
    assert not made.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@pytest.mark.parametrize("kind", FAILURES)
def test_a_failed_prepare_keeps_the_folders_it_found(tmp_path, monkeypatch, kind):
    good = str(_write(tmp_path / "good", "g.txt", "g" * 50))
    inputs, error = _fail_with(kind, tmp_path, monkeypatch)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(error):
        prepare_dataset(inputs, "byte", str(empty))
    assert empty.is_dir() and list(empty.iterdir()) == []
    if kind != "ctrl-c":  # the patched prepare cannot make the first dataset
        prepare_dataset([good], "byte", str(tmp_path / "old"))
        before = _tree(tmp_path / "old")
        with pytest.raises(error):
            prepare_dataset(inputs, "byte", str(tmp_path / "old"))
        assert _tree(tmp_path / "old") == before


def test_a_failed_prepare_keeps_what_others_put_in_its_new_folder(tmp_path, monkeypatch):
    import runtime.data.prepare.build as prepare_mod

    out = tmp_path / "new" / "ds"

    def someone_writes(*args, **kwargs):
        (out / "notes.txt").write_text("not the prepare's")
        raise KeyboardInterrupt

    monkeypatch.setattr(prepare_mod, "run_parts", someone_writes)
    with pytest.raises(KeyboardInterrupt):
        prepare_dataset([str(_write(tmp_path / "src", "a.txt", "a" * 40))], "byte", str(out))
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_a_failed_prepare_on_fsspec_removes_its_new_folder(tmp_path):
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.pipe_file("/jaxjob-fail/blank.txt", b"")
    with pytest.raises(DataError, match="hold no text"):
        prepare_dataset(["memory://jaxjob-fail/blank.txt"], "byte", "memory://jaxjob-fail/new/ds")
    assert fs.ls("/jaxjob-fail", detail=False) == ["/jaxjob-fail/blank.txt"]


@pytest.mark.gcs
def test_a_failed_prepare_on_gcs_leaves_no_objects(tmp_path, gs_run_uri):
    from runfolder.storage import url_to_fs

    blank = str(_write(tmp_path, "blank.txt", ""))
    with pytest.raises(DataError, match="hold no text"):
        prepare_dataset([blank], "byte", f"{gs_run_uri}/ds")
    fs, path = url_to_fs(gs_run_uri)
    fs.invalidate_cache()
    assert not fs.exists(path) and fs.find(path) == []
