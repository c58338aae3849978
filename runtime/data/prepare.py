"""`runtime data prepare`: text/JSONL files → token shards + document offsets + manifest.json.

Public API:
    prepare_dataset(inputs, tokenizer, out, val_fraction=0.05, max_bytes=None,
                    shard_tokens=DEFAULT_SHARD_TOKENS) -> Manifest
    expand_inputs(inputs: list[str]) -> list[str]     the sorted files the globs select

Rules (the manifest format is described in manifest.py):
  * inputs are globs ('**' crosses folders) on a local path or gs://; '{stdlib}' expands to this
    Python's standard-library folder, minus its site-packages (which varies by install, so the
    same glob gives the same data everywhere). Files are read in sorted path order.
  * a `.jsonl` file holds one document per non-empty line, from its string field "text"; any other
    file is one document (its raw bytes; the byte tokenizer keeps them as they are).
  * max_bytes caps the input read: documents are taken in order until their bytes reach it, and
    the document that crosses it is cut at the limit.
  * eos is appended after every document; documents with no tokens are skipped.
  * split by document index i (over kept documents): with k = max(2, round(1 / val_fraction)),
    document i goes to validation when i % k == 1, so with two or more documents both splits
    are non-empty; val_fraction = 0 puts everything in train.
  * manifest.json is removed first and written last, so a folder mid-prepare has none.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import sysconfig
from array import array
from collections.abc import Iterator

import numpy as np

from jobspec.errors import DataError
from runtime.data.manifest import (
    OFFSET_DTYPE,
    Manifest,
    ShardInfo,
    SourceInfo,
    SplitInfo,
    Splits,
    TokenizerInfo,
    compute_fingerprint,
    token_dtype_for,
    write_manifest,
)
from runtime.data.tokenizer import Tokenizer, load_tokenizer
from runtime.storage import is_remote, join, url_to_fs

DEFAULT_SHARD_TOKENS = 1 << 26  # 128 MiB of uint16 per shard: few files, cheap range reads
ENCODE_BATCH = 256  # documents per tokenizer call (the HF tokenizer parallelises a batch)
_OWN_FILE = re.compile(r"^(train|validation)-(\d{5}|offsets)\.bin$|^manifest\.json(\.tmp)?$")


def _stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def expand_inputs(inputs: list[str]) -> list[str]:
    """Sorted, de-duplicated files matched by the globs; a glob matching nothing is an error."""
    stdlib = _stdlib_dir()
    skip = tuple(os.path.join(stdlib, d) + os.sep for d in ("site-packages", "dist-packages"))
    found: set[str] = set()
    for pattern in inputs:
        expanded = pattern.replace("{stdlib}", stdlib)
        if is_remote(expanded):
            fs, path = url_to_fs(expanded)
            matches = [
                fs.unstrip_protocol(name)
                for name, info in fs.glob(path, detail=True).items()
                if info.get("type") == "file"
            ]
        else:
            # glob.glob is ~10x faster than fsspec's local glob on a large tree.
            path = url_to_fs(expanded)[1]
            matches = [p for p in glob.glob(path, recursive=True) if os.path.isfile(p)]
            if "{stdlib}" in pattern:
                matches = [p for p in matches if not p.startswith(skip)]
        if not matches:
            raise DataError(
                f"input glob {pattern!r} matches no files; fix data.prepare.inputs (or the "
                "prepare command's inputs)"
            )
        found.update(matches)
    return sorted(found)


def _documents(files: list[str], max_bytes: int | None) -> Iterator[bytes]:
    """Raw UTF-8 bytes of each document in order, stopping once max_bytes have been yielded."""
    left = max_bytes
    for uri in files:
        fs, path = url_to_fs(uri)
        for doc in _file_documents(fs, path, uri):
            if left is not None:
                doc = doc[:left]
                left -= len(doc)
            if doc:
                yield doc
            if left is not None and left <= 0:
                return


def _file_documents(fs, path: str, uri: str) -> Iterator[bytes]:
    if not path.endswith(".jsonl"):
        with fs.open(path, "rb") as f:
            yield f.read()
        return
    with fs.open(path, "rb") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                text = json.loads(line).get("text")
            except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
                raise DataError(
                    f"line {lineno} of {uri} is not a JSON object ({e}); write one JSON object "
                    'with a "text" field per line'
                ) from e
            if not isinstance(text, str):
                raise DataError(
                    f'line {lineno} of {uri} has no string "text" field; give every line of a '
                    '.jsonl input a "text" string'
                )
            yield text.encode("utf-8")


class _SplitWriter:
    """Appends documents to one split: fixed-size shards, then the offsets file."""

    def __init__(self, out: str, name: str, dtype: str, shard_tokens: int):
        self.out, self.name, self.shard_tokens = out, name, shard_tokens
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.buf: list[np.ndarray] = []
        self.buf_len = 0
        self.shards: list[ShardInfo] = []
        self.offsets = array("q", [0])
        self.max_id = -1

    def add(self, ids: np.ndarray) -> None:
        self.buf.append(ids.astype(self.dtype, copy=False))
        self.buf_len += len(ids)
        self.offsets.append(self.offsets[-1] + len(ids))
        self.max_id = max(self.max_id, int(ids.max()))
        if self.buf_len >= self.shard_tokens:
            flat = np.concatenate(self.buf)
            cut = (len(flat) // self.shard_tokens) * self.shard_tokens
            for i in range(0, cut, self.shard_tokens):
                self._write_shard(flat[i : i + self.shard_tokens])
            self.buf, self.buf_len = [flat[cut:]], len(flat) - cut

    def _write_shard(self, tokens: np.ndarray) -> None:
        rel = f"{self.name}-{len(self.shards):05d}.bin"
        data = tokens.tobytes()
        _write_bytes(join(self.out, rel), data)
        self.shards.append(
            ShardInfo(path=rel, tokens=len(tokens), sha256=hashlib.sha256(data).hexdigest())
        )

    def finish(self) -> SplitInfo:
        if self.buf_len:
            self._write_shard(np.concatenate(self.buf))
        self.buf, self.buf_len = [], 0
        rel = f"{self.name}-offsets.bin"
        data = np.asarray(self.offsets, dtype=OFFSET_DTYPE).tobytes()
        _write_bytes(join(self.out, rel), data)
        return SplitInfo(
            tokens=self.offsets[-1],
            documents=len(self.offsets) - 1,
            max_token_id=self.max_id,
            shards=self.shards,
            offsets=rel,
            offsets_sha256=hashlib.sha256(data).hexdigest(),
        )


def _write_bytes(uri: str, data: bytes) -> None:
    fs, path = url_to_fs(uri)
    with fs.open(path, "wb") as f:
        f.write(data)


def _clear_previous(out: str) -> None:
    """Remove an earlier prepare's manifest (first, so it never points at new shards) and files."""
    fs, path = url_to_fs(out)
    fs.makedirs(path, exist_ok=True)
    man = join(path, "manifest.json")
    if fs.exists(man):
        fs.rm_file(man)
    try:
        entries = fs.ls(path, detail=False)
    except FileNotFoundError:  # a new gs:// prefix does not exist until its first object
        entries = []
    for entry in entries:
        if _OWN_FILE.match(entry.rstrip("/").rsplit("/", 1)[-1]):
            fs.rm_file(entry)


def _encoded(tok: Tokenizer, docs: Iterator[bytes]) -> Iterator[np.ndarray]:
    batch: list[bytes] = []
    for doc in docs:
        batch.append(doc)
        if len(batch) >= ENCODE_BATCH:
            yield from tok.encode_many(list(batch))
            batch.clear()
    if batch:
        yield from tok.encode_many(batch)


def prepare_dataset(
    inputs: list[str],
    tokenizer: str,
    out: str,
    val_fraction: float = 0.05,
    max_bytes: int | None = None,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
) -> Manifest:
    """Tokenize `inputs` into `out` (local folder or gs://…) and return the written manifest."""
    if not 0 <= val_fraction < 1:
        raise DataError(f"val_fraction is {val_fraction}; use a value in [0, 1)")
    if shard_tokens <= 0:
        raise DataError(f"shard_tokens is {shard_tokens}; use a positive token count")
    tok = load_tokenizer(tokenizer)
    dtype = token_dtype_for(tok.vocab_size)
    files = expand_inputs(inputs)
    _clear_previous(out)
    writers = {n: _SplitWriter(out, n, dtype, shard_tokens) for n in ("train", "validation")}
    every = max(2, round(1 / val_fraction)) if val_fraction > 0 else 0
    eos = np.array([tok.eos_id], dtype=np.int64)
    kept = 0
    for ids in _encoded(tok, _documents(files, max_bytes)):
        if len(ids) == 0:
            continue
        split = "validation" if every and kept % every == 1 else "train"
        writers[split].add(np.concatenate([ids, eos]))
        kept += 1
    if kept == 0:
        raise DataError(
            f"the inputs {inputs} matched {len(files)} files but they hold no text; point the "
            "inputs at non-empty text or .jsonl files"
        )
    splits = Splits(train=writers["train"].finish(), validation=writers["validation"].finish())
    draft = Manifest(
        tokenizer=TokenizerInfo(
            id=tok.id, kind=tok.kind, vocab_size=tok.vocab_size, eos_id=tok.eos_id, source=tokenizer
        ),
        token_dtype=dtype,
        splits=splits,
        total_tokens=splits.train.tokens + splits.validation.tokens,
        total_documents=splits.train.documents + splits.validation.documents,
        max_token_id=max(splits.train.max_token_id, splits.validation.max_token_id),
        fingerprint="",
        source=SourceInfo(
            inputs=list(inputs),
            files=len(files),
            val_fraction=val_fraction,
            max_bytes=max_bytes,
            shard_tokens=shard_tokens,
        ),
    )
    manifest = draft.model_copy(update={"fingerprint": compute_fingerprint(draft)})
    write_manifest(manifest, join(out, "manifest.json"))
    return manifest.with_root(out.rstrip("/") or out)
