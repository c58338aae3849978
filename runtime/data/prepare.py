"""`runtime data prepare`: text/JSONL files → token shards + document offsets + manifest.json.

Public API:
    prepare_dataset(inputs, tokenizer, out, val_fraction=0.05, max_bytes=None,
                    shard_tokens=DEFAULT_SHARD_TOKENS, format="text") -> Manifest
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
  * a prepare never touches the dataset already in `out` until the new one is complete: the new
    shards go into a fresh folder `out/shards-<time>-<id>/`, manifest.json (the commit point: one
    atomic write pointing at them) is written last, and only then are the previous shards
    deleted. A prepare that fails (empty input, a tokenizer error, a full disk, Ctrl-C) removes
    its own folder and leaves the previous dataset byte-identical; this works the same on gs://,
    which has no rename.
  * format "rollouts": every input is rollout JSONL (rollouts.py); each rollout is one document
    (prompt then completion, no eos added) with its per-token fields; max_bytes is refused, the
    split rule is the same.
  * progress: a bar on stderr (bytes read of the inputs' total, documents, tokens/s, ETA; see
    progress.py); None shows it only when stderr is a terminal. It is shown by whoever runs
    prepare_dataset: in a job that is the writer alone (ensure_manifest). It never changes the
    dataset.
"""

from __future__ import annotations

import datetime
import glob
import hashlib
import os
import re
import secrets
import sysconfig
from array import array
from collections.abc import Iterator
from typing import Literal

import jax
import numpy as np
from jax.experimental import multihost_utils

from jobspec.errors import DataError, JaxjobError, StorageError, StorageFaultError
from jobspec.run_config import DataConfig
from jobspec.storage import is_remote, join, storage_fault, url_to_fs
from runtime.data.jsonl import json_objects
from runtime.data.manifest import (
    FIELD_DTYPES,
    OFFSET_DTYPE,
    FieldInfo,
    Manifest,
    ShardInfo,
    SourceInfo,
    SplitInfo,
    Splits,
    TokenizerInfo,
    compute_fingerprint,
    load_manifest,
    token_dtype_for,
    write_manifest,
)
from runtime.data.progress import PrepareProgress
from runtime.data.rollouts import Rollout, read_rollouts, rollout_fields
from runtime.data.tokenizer import Tokenizer, load_tokenizer

DEFAULT_SHARD_TOKENS = 1 << 26  # 128 MiB of uint16 per shard: few files, cheap range reads
ENCODE_BATCH = 256  # documents per tokenizer call (the HF tokenizer parallelises a batch)
# Files an older prepare wrote directly into `out` (before shard folders), and shard folders.
_OWN_FILE = re.compile(
    rf"^(train|validation)(-({'|'.join(FIELD_DTYPES)}))?-\d{{5}}\.bin$"
    r"|^(train|validation)-offsets\.bin$|^manifest\.json\.tmp$"
)
_SHARD_DIR = re.compile(r"^shards-\d{8}T\d{6}-[0-9a-f]{8}$")
TOKENS = "tokens"  # the token stream's key among a split writer's streams


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


def _documents(
    files: list[str], max_bytes: int | None, progress: PrepareProgress | None = None
) -> Iterator[bytes]:
    """Raw UTF-8 bytes of each document in order, stopping once max_bytes have been yielded."""
    left = max_bytes
    for uri in files:
        fs, path = url_to_fs(uri)
        for doc in _file_documents(fs, path, uri):
            if left is not None:
                doc = doc[:left]
                left -= len(doc)
            if doc:
                if progress is not None:
                    progress.bytes += len(doc)
                yield doc
            if left is not None and left <= 0:
                return
        if progress is not None:
            progress.file_done()


def _file_documents(fs, path: str, uri: str) -> Iterator[bytes]:
    if not path.endswith(".jsonl"):
        with fs.open(path, "rb") as f:
            yield f.read()
        return
    for lineno, doc in json_objects(uri):
        text = doc.get("text")
        if not isinstance(text, str):
            rollout = any(k in doc for k in ("prompt", "prompt_ids", "completion_ids"))
            hint = (
                " (it looks like a rollout: prepare it with --format rollouts)" if rollout else ""
            )
            raise DataError(
                f'line {lineno} of {uri} has no string "text" field; give every line of a .jsonl '
                f'input a "text" string{hint}'
            )
        yield text.encode("utf-8")


class _SplitWriter:
    """Appends documents to one split: fixed-size shards (tokens and any per-token fields, cut at
    the same token counts), then the offsets file."""

    def __init__(
        self,
        out: str,
        folder: str,
        name: str,
        dtype: str,
        shard_tokens: int,
        fields: dict[str, str] | None = None,
    ):
        # Files go to out/folder/…; the manifest records them relative to out.
        self.out, self.folder, self.name, self.shard_tokens = out, folder, name, shard_tokens
        self.fields = dict(fields or {})
        self.dtypes = {
            TOKENS: np.dtype(dtype).newbyteorder("<"),
            **{f: np.dtype(d).newbyteorder("<") for f, d in self.fields.items()},
        }
        self.buf: dict[str, list[np.ndarray]] = {k: [] for k in self.dtypes}
        self.buf_len = 0
        self.shards: dict[str, list[ShardInfo]] = {k: [] for k in self.dtypes}
        self.offsets = array("q", [0])
        self.max_id = -1
        self.max_doc = 0

    def add(self, ids: np.ndarray, values: dict[str, np.ndarray] | None = None) -> None:
        arrays = {TOKENS: ids, **(values or {})}
        for k, dt in self.dtypes.items():
            self.buf[k].append(arrays[k].astype(dt, copy=False))
        self.buf_len += len(ids)
        self.offsets.append(self.offsets[-1] + len(ids))
        self.max_id = max(self.max_id, int(ids.max()))
        self.max_doc = max(self.max_doc, len(ids))
        if self.buf_len >= self.shard_tokens:
            self._flush(final=False)

    def _flush(self, final: bool) -> None:
        flats = {k: np.concatenate(v) for k, v in self.buf.items()}
        n = len(flats[TOKENS])
        cut = n if final else (n // self.shard_tokens) * self.shard_tokens
        for i in range(0, cut, self.shard_tokens):
            for k, flat in flats.items():
                self._write_shard(k, flat[i : min(i + self.shard_tokens, cut)])
        self.buf = {k: [flat[cut:]] for k, flat in flats.items()}
        self.buf_len = n - cut

    def _write_shard(self, kind: str, values: np.ndarray) -> None:
        stem = self.name if kind == TOKENS else f"{self.name}-{kind}"
        rel = f"{self.folder}/{stem}-{len(self.shards[kind]):05d}.bin"
        data = values.tobytes()
        _write_bytes(join(self.out, rel), data)
        self.shards[kind].append(
            ShardInfo(path=rel, tokens=len(values), sha256=hashlib.sha256(data).hexdigest())
        )

    def finish(self) -> SplitInfo:
        if self.buf_len:
            self._flush(final=True)
        self.buf, self.buf_len = {k: [] for k in self.dtypes}, 0
        rel = f"{self.folder}/{self.name}-offsets.bin"
        data = np.asarray(self.offsets, dtype=OFFSET_DTYPE).tobytes()
        _write_bytes(join(self.out, rel), data)
        return SplitInfo(
            tokens=self.offsets[-1],
            documents=len(self.offsets) - 1,
            max_token_id=self.max_id,
            shards=self.shards[TOKENS],
            offsets=rel,
            offsets_sha256=hashlib.sha256(data).hexdigest(),
            fields={
                f: FieldInfo(dtype=d, shards=self.shards[f])  # type: ignore[arg-type]
                for f, d in self.fields.items()
            },
            max_document_tokens=self.max_doc if self.fields else None,
        )


def _write_bytes(uri: str, data: bytes) -> None:
    fs, path = url_to_fs(uri)
    with fs.open(path, "wb") as f:
        f.write(data)


def _new_folder() -> str:
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S")
    return f"shards-{stamp}-{secrets.token_hex(4)}"


def _entries(fs, path: str) -> list[str]:
    fs.invalidate_cache(path)  # gcsfs caches listings; this prepare has just written here
    try:
        return [e.rstrip("/") for e in fs.ls(path, detail=False)]
    except FileNotFoundError:  # a new gs:// prefix does not exist until its first object
        return []


_UNCHANGED = "(the dataset already there, if any, is unchanged)"


def _raise_write_error(out: str, e: Exception) -> None:
    """Writing the new dataset failed: a storage fault (a full disk, EIO, a failing bucket) is
    restartable (exit 45); another OSError is the output the user gave (exit 2); anything else
    is a bug and propagates as it is."""
    fault = storage_fault(e)
    if fault is not None:
        raise StorageFaultError(
            f"cannot write the dataset to {out}: {fault.reason}; free space or fix the storage "
            f"and run the prepare again {_UNCHANGED}"
        ) from e
    if isinstance(e, OSError):
        raise StorageError(
            f"cannot write the dataset to {out}: {e.strerror or e}; choose a writable --out "
            f"{_UNCHANGED}"
        ) from e


def _next_document(docs: Iterator[Rollout], inputs: list[str]) -> Rollout | None:
    """The next input document; the inputs are read lazily, so a failing read surfaces here
    and is said as one (not as a failed write of the output)."""
    try:
        return next(docs)
    except StopIteration:
        return None
    except (JaxjobError, KeyboardInterrupt):
        raise
    except Exception as e:
        fault = storage_fault(e)
        if fault is not None:
            raise StorageFaultError(
                f"cannot read the inputs {inputs}: {fault.reason}; run the prepare again once "
                f"the storage answers {_UNCHANGED}"
            ) from e
        if isinstance(e, OSError):
            raise DataError(
                f"cannot read the inputs {inputs}: {e.strerror or e}"
                f"{f' ({e.filename})' if e.filename else ''}; check that they exist and are "
                f"readable {_UNCHANGED}"
            ) from e
        raise


def _remove_folder(out: str, folder: str) -> None:
    """Delete one shard folder; a failure here must not hide the error that led to it."""
    fs, path = url_to_fs(join(out, folder))
    try:
        if fs.exists(path):
            fs.rm(path, recursive=True)
    except Exception:  # noqa: BLE001
        pass


def _remove_previous(out: str, keep: str) -> None:
    """After the new manifest is in place: delete the shard folders and loose shard files of
    earlier prepares (nothing else in `out` is ours to delete)."""
    fs, path = url_to_fs(out)
    for entry in _entries(fs, path):
        name = entry.rsplit("/", 1)[-1]
        if _SHARD_DIR.match(name) and name != keep:
            fs.rm(entry, recursive=True)
        elif _OWN_FILE.match(name):
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
    format: Literal["text", "rollouts"] = "text",
    progress: bool | None = None,
) -> Manifest:
    """Tokenize `inputs` into `out` (local folder or gs://…) and return the written manifest.

    format="rollouts" reads rollout JSONL (see rollouts.py) into the "rollouts" layout.
    progress: show the bar on stderr (True), never (False), or only on a terminal (None)."""
    if not 0 <= val_fraction < 1:
        raise DataError(f"val_fraction is {val_fraction}; use a value in [0, 1)")
    if shard_tokens <= 0:
        raise DataError(f"shard_tokens is {shard_tokens}; use a positive token count")
    if format not in ("text", "rollouts"):
        raise DataError(f"format is {format!r}; use 'text' or 'rollouts'")
    if format == "rollouts" and max_bytes is not None:
        raise DataError(
            "max_bytes cuts documents at a byte count, which would cut a rollout; leave max_bytes "
            "unset for format 'rollouts' (select fewer input files instead)"
        )
    tok = load_tokenizer(tokenizer)
    dtype = token_dtype_for(tok.vocab_size)
    files = expand_inputs(inputs)
    fields: dict[str, str] = {}
    if format == "rollouts":
        kind, docs = read_rollouts(files, tok)
        fields = rollout_fields(kind)
        bar = PrepareProgress(files, None, progress, every=ENCODE_BATCH, bytes_known=False)
    else:
        bar = PrepareProgress(files, max_bytes, progress, every=ENCODE_BATCH)
        eos = np.array([tok.eos_id], dtype=np.int64)
        docs = (
            Rollout(np.concatenate([ids, eos]), {})
            for ids in _encoded(tok, _documents(files, max_bytes, bar))
            if len(ids)
        )
    fs, root = url_to_fs(out)
    folder = _new_folder()
    try:
        fs.makedirs(join(root, folder), exist_ok=True)
        splits = _write_splits(
            out, folder, dtype, shard_tokens, fields, iter(docs), val_fraction, inputs, bar
        )
        if splits is None:
            raise DataError(
                f"the inputs {inputs} matched {len(files)} files but they hold no text; point the "
                "inputs at non-empty text or .jsonl files (the dataset already in "
                f"{out}, if any, is unchanged)"
            )
        source = SourceInfo(
            inputs=list(inputs),
            files=len(files),
            val_fraction=val_fraction,
            max_bytes=max_bytes,
            shard_tokens=shard_tokens,
        )
        manifest = _manifest(tok, tokenizer, dtype, format, splits, source)
        write_manifest(manifest, join(out, "manifest.json"))  # the commit point
    except BaseException as e:  # nothing was swapped in: the old dataset stays as it was
        bar.close(complete=False)
        _remove_folder(out, folder)
        if isinstance(e, Exception) and not isinstance(e, JaxjobError):
            _raise_write_error(out, e)
        raise
    bar.close(complete=True)
    _remove_previous(out, keep=folder)
    return manifest.with_root(out.rstrip("/") or out)


def _write_splits(
    out: str,
    folder: str,
    dtype: str,
    shard_tokens: int,
    fields: dict[str, str],
    docs: Iterator[Rollout],
    val_fraction: float,
    inputs: list[str],
    progress: PrepareProgress,
) -> Splits | None:
    """The splits' shards and offsets under out/folder; None when the input held no document."""
    writers = {
        n: _SplitWriter(out, folder, n, dtype, shard_tokens, fields)
        for n in ("train", "validation")
    }
    every = max(2, round(1 / val_fraction)) if val_fraction > 0 else 0
    kept = 0
    while (doc := _next_document(docs, inputs)) is not None:
        split = "validation" if every and kept % every == 1 else "train"
        writers[split].add(doc.tokens, doc.values)
        progress.wrote(len(doc.tokens))
        kept += 1
    if kept == 0:
        return None
    return Splits(train=writers["train"].finish(), validation=writers["validation"].finish())


def _manifest(
    tok: Tokenizer,
    tokenizer: str,
    dtype: str,
    format: str,
    splits: Splits,
    source: SourceInfo,
) -> Manifest:
    draft = Manifest(
        tokenizer=TokenizerInfo(
            id=tok.id, kind=tok.kind, vocab_size=tok.vocab_size, eos_id=tok.eos_id, source=tokenizer
        ),
        token_dtype=dtype,
        layout="rollouts" if format == "rollouts" else "stream",
        splits=splits,
        total_tokens=splits.train.tokens + splits.validation.tokens,
        total_documents=splits.train.documents + splits.validation.documents,
        max_token_id=max(splits.train.max_token_id, splits.validation.max_token_id),
        fingerprint="",
        source=source,
    )
    return draft.model_copy(update={"fingerprint": compute_fingerprint(draft)})


def ensure_manifest(cfg: DataConfig, *, is_writer: bool = True) -> Manifest:
    """Load the manifest; make it first when it is absent and `[data.prepare]` says how.

    Only the writer prepares; the other hosts wait for it at a barrier, so a multi-host job
    prepares once (on storage every host reads: a shared path or gs://).
    """
    if cfg.prepare is not None:
        fs, path = url_to_fs(cfg.manifest)
        if is_writer and not fs.exists(path):
            out_dir = os.path.dirname(cfg.manifest.rstrip("/")) or "."
            prepare_dataset(
                cfg.prepare.inputs,
                cfg.prepare.tokenizer,
                out_dir,
                val_fraction=cfg.prepare.val_fraction,
                max_bytes=cfg.prepare.max_bytes,
                format=cfg.prepare.format,
            )
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("jaxjob:data-prepared")
    return load_manifest(cfg.manifest)
