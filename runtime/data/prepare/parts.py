"""The parts of a prepare: the input files, in sorted order, grouped into parts of about
`part_bytes` each; every part is tokenized on its own (by any worker of any host) into its own
shard files, and the parts are merged, in order, into one dataset.

Public API:
    PART_BYTES                                   default input bytes per part
    InputFile, Plan, PartResult                  pydantic: an input as listed, plan.json, part.json
    list_inputs(inputs) -> list[InputFile]       the sorted files the globs select, with sizes
    make_plan(inputs, files, tokenizer, ...) -> Plan
    write_part(plan, index, out, folder, progress=None, max_bytes=None) -> PartResult
    read_part(out, folder, plan, index) -> PartResult | None   a committed part, or None
    merge_parts(plan, results, out, folder) -> Splits           the dataset's splits

Why parts. A dataset must be one thing however it was made: the shards, offsets and fingerprint
are the same for any worker count and any number of hosts. So the unit of work is fixed by the
inputs alone (sorted files, their sizes, part_bytes): a file is never cut between parts, each
part cuts its own shards every shard_tokens, and its validation documents are its kept documents
j with j % k == 1 (k = max(2, round(1 / val_fraction))). A dataset smaller than one part is
therefore laid out exactly as a single sequential pass over all its documents would lay it out.

Files under out/folder/part-00003/: train-00000.bin …, train-offsets.bin (the part's own offsets,
from 0), the same for validation (and per-token fields for rollouts), then part.json last: a part
with no part.json is incomplete and is written again from scratch.

This module does not import jax: it runs in the spawned worker processes of a prepare.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig
from array import array
from collections.abc import Iterator
from typing import Literal, Protocol

import numpy as np
from pydantic import BaseModel, ConfigDict

from jobspec.errors import DataError, JaxjobError, StorageFaultError
from jobspec.run_config import is_remote
from runfolder.storage import join, storage_fault, url_to_fs
from runtime.data.manifest import (
    OFFSET_DTYPE,
    FieldInfo,
    ShardInfo,
    SplitInfo,
    Splits,
    TokenizerInfo,
)
from runtime.data.prepare.readers import read_documents
from runtime.data.prepare.rollouts import Rollout, read_rollouts, rollout_fields
from runtime.data.samples import Sampler, sample_digest
from runtime.data.tokenizer import Tokenizer, load_tokenizer

PART_BYTES = 128 << 20  # input bytes per part: the unit of parallel work and of a host's share
ENCODE_BATCH = 256  # documents per tokenizer call (the HF tokenizer parallelises a batch)
TOKENS = "tokens"  # the token stream's key among a split writer's streams
SPLITS = ("train", "validation")
PART_JSON = "part.json"
PLAN_JSON = "plan.json"
_UNCHANGED = "(the dataset already there, if any, is unchanged)"


class Progress(Protocol):
    """Where a part reports what it has read and written (a bar, or a queue to one)."""

    def add(self, nbytes: int = 0, documents: int = 0, tokens: int = 0, files: int = 0) -> None: ...


class NoProgress:
    def add(self, nbytes: int = 0, documents: int = 0, tokens: int = 0, files: int = 0) -> None:
        pass


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class InputFile(_Model):
    uri: str
    size: int
    version: str = ""  # mtime (local) or generation (gs://): a changed file is another plan


class Plan(_Model):
    """Everything a part is made from; its id names the shares' folder, so every host that runs
    a share of the same prepare writes into the same place, and a changed input is a new plan."""

    format: Literal["text", "rollouts"]
    tokenizer: TokenizerInfo  # its source is the spec parts load (a path or URI, or "byte")
    token_dtype: Literal["uint16", "uint32"]
    text_field: str
    val_fraction: float
    max_bytes: int | None
    shard_tokens: int
    part_bytes: int
    inputs: list[str]
    parts: list[list[InputFile]]

    @property
    def id(self) -> str:
        # Not the tokenizer's spelling or the globs: the same files and tokenizer are one plan.
        what = self.model_dump(exclude={"tokenizer": {"source"}, "inputs": True})
        return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def files(self) -> list[InputFile]:
        return [f for part in self.parts for f in part]


class PartResult(_Model):
    plan: str  # the plan id it belongs to
    index: int
    bytes_read: int  # document bytes (max_bytes counts these)
    splits: Splits  # shard and offsets paths relative to the dataset's folder


def _stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def list_inputs(inputs: list[str]) -> list[InputFile]:
    """Sorted, de-duplicated files matched by the globs, with their sizes; a glob matching
    nothing is an error."""
    stdlib = _stdlib_dir()
    skip = tuple(os.path.join(stdlib, d) + os.sep for d in ("site-packages", "dist-packages"))
    found: dict[str, InputFile] = {}
    for pattern in inputs:
        expanded = pattern.replace("{stdlib}", stdlib)
        matches: list[InputFile] = []
        if is_remote(expanded):
            fs, path = url_to_fs(expanded)
            for name, info in fs.glob(path, detail=True).items():
                if info.get("type") == "file":
                    version = info.get("generation") or info.get("etag") or info.get("mtime")
                    matches.append(
                        InputFile(
                            uri=fs.unstrip_protocol(name),
                            size=int(info.get("size") or 0),
                            version=str(version or ""),
                        )
                    )
        else:
            # glob.glob is ~10x faster than fsspec's local glob on a large tree. A path naming a
            # file is that file, even with [ ] * ? in its name (as the shell's expansion gives).
            path = url_to_fs(expanded)[1]
            for p in [path] if os.path.isfile(path) else glob.glob(path, recursive=True):
                if not os.path.isfile(p) or ("{stdlib}" in pattern and p.startswith(skip)):
                    continue
                st = os.stat(p)
                matches.append(InputFile(uri=p, size=st.st_size, version=str(st.st_mtime_ns)))
        if not matches:
            raise DataError(
                f"input glob {pattern!r} matches no files; fix data.prepare.inputs (or the "
                "prepare command's inputs)"
            )
        found.update((m.uri, m) for m in matches)
    return [found[u] for u in sorted(found)]


def group_parts(files: list[InputFile], part_bytes: int) -> list[list[InputFile]]:
    """Consecutive files, a part closed once its files reach part_bytes (a file is never cut)."""
    parts: list[list[InputFile]] = []
    current: list[InputFile] = []
    size = 0
    for f in files:
        current.append(f)
        size += f.size
        if size >= part_bytes:
            parts.append(current)
            current, size = [], 0
    if current:
        parts.append(current)
    return parts


def make_plan(
    inputs: list[str],
    files: list[InputFile],
    tok: Tokenizer,
    tokenizer: str,
    token_dtype: Literal["uint16", "uint32"],
    *,
    format: Literal["text", "rollouts"],
    text_field: str,
    val_fraction: float,
    max_bytes: int | None,
    shard_tokens: int,
    part_bytes: int,
) -> Plan:
    # Rollout files are one part: the rollout kind (and so the fields) is read from all of them.
    parts = [files] if format == "rollouts" else group_parts(files, part_bytes)
    return Plan(
        format=format,
        tokenizer=TokenizerInfo(
            id=tok.id, kind=tok.kind, vocab_size=tok.vocab_size, eos_id=tok.eos_id, source=tokenizer
        ),
        token_dtype=token_dtype,
        text_field=text_field,
        val_fraction=val_fraction,
        max_bytes=max_bytes,
        shard_tokens=shard_tokens,
        part_bytes=part_bytes,
        inputs=list(inputs),
        parts=parts,
    )


def part_folder(folder: str, index: int) -> str:
    return f"{folder}/part-{index:05d}"


class _SplitWriter:
    """Appends documents to one split of one part: fixed-size shards (tokens and any per-token
    fields, cut at the same token counts), then the part's offsets file."""

    def __init__(
        self, out: str, folder: str, name: str, dtype: str, shard_tokens: int, fields: dict
    ):
        # Files go to out/folder/…; results name them relative to out.
        self.out, self.folder, self.name, self.shard_tokens = out, folder, name, shard_tokens
        self.fields = dict(fields)
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

    def add(self, ids: np.ndarray, values: dict[str, np.ndarray]) -> None:
        arrays = {TOKENS: ids, **values}
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
        write_bytes(join(self.out, rel), data)
        self.shards[kind].append(
            ShardInfo(
                path=rel,
                tokens=len(values),
                sha256=hashlib.sha256(data).hexdigest(),
                sample_sha256=sample_digest(data),
            )
        )

    def finish(self) -> SplitInfo:
        if self.buf_len:
            self._flush(final=True)
        self.buf, self.buf_len = {k: [] for k in self.dtypes}, 0
        rel = f"{self.folder}/{self.name}-offsets.bin"
        data = np.asarray(self.offsets, dtype=OFFSET_DTYPE).tobytes()
        write_bytes(join(self.out, rel), data)
        return SplitInfo(
            tokens=self.offsets[-1],
            documents=len(self.offsets) - 1,
            max_token_id=self.max_id,
            shards=self.shards[TOKENS],
            offsets=rel,
            offsets_sha256=hashlib.sha256(data).hexdigest(),
            offsets_sample_sha256=sample_digest(data),
            fields={
                f: FieldInfo(dtype=d, shards=self.shards[f])  # type: ignore[arg-type]
                for f, d in self.fields.items()
            },
            max_document_tokens=self.max_doc if self.fields else None,
        )


def write_bytes(uri: str, data: bytes) -> None:
    fs, path = url_to_fs(uri)
    if not is_remote(uri):  # object stores have no folders to make
        fs.makedirs(os.path.dirname(path), exist_ok=True)
    with fs.open(path, "wb") as f:
        f.write(data)


_TOKENIZERS: dict[str, Tokenizer] = {}


def _tokenizer(plan: Plan) -> Tokenizer:
    """The plan's tokenizer, loaded once per process; it must still be the one planned."""
    spec = plan.tokenizer.source or "byte"
    tok = _TOKENIZERS.get(spec)
    if tok is None:
        tok = _TOKENIZERS[spec] = load_tokenizer(spec)
    if tok.id != plan.tokenizer.id:
        raise DataError(
            f"tokenizer {spec} is {tok.id} but this prepare was planned with "
            f"{plan.tokenizer.id}; give every share the same tokenizer.json"
        )
    return tok


class _Budget:
    """max_bytes: documents are taken in order until their bytes reach it; the document that
    crosses it is cut at the limit."""

    def __init__(self, left: int | None):
        self.left = left
        self.used = 0

    def take(self, doc: bytes) -> bytes:
        if self.left is not None:
            doc = doc[: max(self.left, 0)]
            self.left -= len(doc)
        self.used += len(doc)
        return doc

    @property
    def spent(self) -> bool:
        return self.left is not None and self.left <= 0


def _text_documents(
    files: list[InputFile], text_field: str, budget: _Budget, progress: Progress
) -> Iterator[bytes]:
    for f in files:
        shown = 0  # of the file's size: a compressed file's text outgrows its size, so capped
        for doc in read_documents(f.uri, text_field):
            doc = budget.take(doc)
            if doc:
                step = min(len(doc), f.size - shown)
                shown += step
                progress.add(nbytes=step)
                yield doc
            if budget.spent:
                return
        progress.add(nbytes=f.size - shown, files=1)


def _encoded(tok: Tokenizer, docs: Iterator[bytes], progress: Progress) -> Iterator[np.ndarray]:
    """eos-terminated ids of every document with tokens, tokenized ENCODE_BATCH at a time."""
    batch: list[bytes] = []
    eos = np.array([tok.eos_id], dtype=np.int64)

    def encode() -> list[np.ndarray]:
        done = [np.concatenate([ids, eos]) for ids in tok.encode_many(list(batch)) if len(ids)]
        progress.add(documents=len(done), tokens=sum(map(len, done)))
        batch.clear()
        return done

    for doc in docs:
        batch.append(doc)
        if len(batch) >= ENCODE_BATCH:
            yield from encode()
    if batch:
        yield from encode()


def next_document(docs: Iterator[Rollout], inputs: list[str]) -> Rollout | None:
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


def write_part(
    plan: Plan,
    index: int,
    out: str,
    folder: str,
    progress: Progress | None = None,
    max_bytes: int | None = None,
) -> PartResult:
    """Tokenize part `index` of the plan into out/folder/part-NNNNN/ and commit it (part.json).
    max_bytes: what is left of the prepare's byte budget (parts then run one after another)."""
    tok = _tokenizer(plan)
    progress = progress or NoProgress()
    files = plan.parts[index]
    budget = _Budget(max_bytes)
    fields: dict[str, str] = {}
    if plan.format == "rollouts":
        kind, rollouts = read_rollouts([f.uri for f in files], tok)
        fields = rollout_fields(kind)
        docs: Iterator[Rollout] = iter(rollouts)
    else:
        texts = _text_documents(files, plan.text_field, budget, progress)
        docs = (Rollout(ids, {}) for ids in _encoded(tok, texts, progress))
    rel = part_folder(folder, index)
    writers = {
        n: _SplitWriter(out, rel, n, plan.token_dtype, plan.shard_tokens, fields) for n in SPLITS
    }
    every = max(2, round(1 / plan.val_fraction)) if plan.val_fraction > 0 else 0
    kept = 0
    while (doc := next_document(docs, plan.inputs)) is not None:
        split = "validation" if every and kept % every == 1 else "train"
        writers[split].add(doc.tokens, doc.values)
        if plan.format == "rollouts":
            progress.add(documents=1, tokens=len(doc.tokens))
        kept += 1
    result = PartResult(
        plan=plan.id,
        index=index,
        bytes_read=budget.used,
        splits=Splits(train=writers["train"].finish(), validation=writers["validation"].finish()),
    )
    write_bytes(join(out, rel, PART_JSON), result.model_dump_json(indent=1).encode())
    return result


def read_part(out: str, folder: str, plan: Plan, index: int) -> PartResult | None:
    """The committed part `index` of the plan under out/folder, or None when it is absent,
    unfinished or of another plan."""
    fs, path = url_to_fs(join(out, part_folder(folder, index), PART_JSON))
    try:
        with fs.open(path, "rb") as f:
            result = PartResult.model_validate_json(f.read())
    except FileNotFoundError:
        return None
    except ValueError:  # a torn or foreign part.json: the part is written again
        return None
    return result if result.plan == plan.id and result.index == index else None


def merge_parts(plan: Plan, results: list[PartResult], out: str, folder: str) -> Splits:
    """The dataset's splits from its parts in order: the shard lists end to end, and one
    offsets file per split (out/folder/<split>-offsets.bin) with each part's offsets moved up
    by the tokens before it."""
    merged = {}
    for name in SPLITS:
        parts = [getattr(r.splits, name) for r in results]
        rel = f"{folder}/{name}-offsets.bin"
        digest = hashlib.sha256()
        sampler = Sampler((1 + sum(s.documents for s in parts)) * OFFSET_DTYPE.itemsize)
        base = 0
        fs, path = url_to_fs(join(out, rel))
        with fs.open(path, "wb") as f:
            head = np.zeros(1, OFFSET_DTYPE).tobytes()
            f.write(head)
            digest.update(head)
            sampler.update(head)
            for s in parts:
                offsets = _read_offsets(join(out, s.offsets), s.documents)
                chunk = (offsets[1:] + base).astype(OFFSET_DTYPE).tobytes()
                f.write(chunk)
                digest.update(chunk)
                sampler.update(chunk)
                base += s.tokens
        field_names = parts[0].fields.keys() if parts else {}
        merged[name] = SplitInfo(
            tokens=base,
            documents=sum(s.documents for s in parts),
            max_token_id=max((s.max_token_id for s in parts), default=-1),
            shards=[sh for s in parts for sh in s.shards],
            offsets=rel,
            offsets_sha256=digest.hexdigest(),
            offsets_sample_sha256=sampler.hexdigest(),
            fields={
                k: FieldInfo(
                    dtype=parts[0].fields[k].dtype,
                    shards=[sh for s in parts for sh in s.fields[k].shards],
                )  # fmt: skip
                for k in field_names
            },
            max_document_tokens=(
                max(s.max_document_tokens or 0 for s in parts) if field_names else None
            ),
        )
    return Splits(**merged)


def _read_offsets(uri: str, documents: int) -> np.ndarray:
    fs, path = url_to_fs(uri)
    with fs.open(path, "rb") as f:
        offsets = np.frombuffer(f.read(), dtype=OFFSET_DTYPE)
    if len(offsets) != documents + 1:
        raise DataError(
            f"{uri} holds {len(offsets)} offsets but its part.json says {documents} documents; "
            "the part is damaged: delete its folder and run its share again"
        )
    return offsets
