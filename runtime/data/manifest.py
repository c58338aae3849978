"""manifest.json: what a prepared-token directory holds, and the checks before training reads it.

Public API:
    Manifest, TokenizerInfo, SplitInfo, Splits, ShardInfo, FieldInfo, SourceInfo
                                                      pydantic models of manifest.json (extra="forbid")
    FIELD_DTYPES, PG_FIELDS                           the per-token fields of a rollouts split
    load_manifest(uri: str) -> Manifest               parse + structural checks (files exist, sizes,
                                                      sampled checksums: samples.py)
    check_manifest(uri: str, deep: bool) -> dict      load_manifest and the offsets read whole; with
                                                      deep=True re-hash every file and re-scan token
                                                      ids; returns a summary
    write_manifest(manifest: Manifest, uri: str)      one atomic write (tmp + rename, or one put)
    MANIFEST_FILE = "manifest.json"                   the manifest's name in its dataset's folder
    manifest_uri(folder: str) -> str                  the manifest of the dataset in `folder`
    compute_fingerprint(manifest) -> str              hash over tokenizer id, dtype and file hashes
    token_dtype_for(vocab_size) -> str                "uint16" if every id fits, else "uint32"
    read_offsets(manifest, split) -> np.ndarray       the split's int64 document offsets, checked
                                                      against the manifest (sha256, 0 .. tokens)

Directory layout (all paths in the manifest are relative to its folder):
    manifest.json                 written last, so a half-prepared folder has none
    train-00000.bin …             raw little-endian token ids (token_dtype), split stream in order
    train-offsets.bin             little-endian int64, documents+1 entries: the start offset of
                                  every document in the split's concatenated stream, then its total
    validation-00000.bin …, validation-offsets.bin   the same for the validation split
Shards are cut by token count, not at document ends: a document may span two shards.
Every file has its sha256 (checked by `data check --deep`) and a checksum of sampled blocks
(`sample_sha256`, `offsets_sample_sha256`; checked at every load). Manifests made before the
sampled checksums lack them and load as before: their files are checked by size only (and the
offsets whole where they are read); they are not part of the fingerprint, so such a manifest
and its re-prepared twin are the same dataset.

Layouts. "stream" (text): documents are concatenated and rows are cut from the stream.
"rollouts" (RL / SFT data, see prepare/rollouts.py): every document is one rollout (prompt then
completion) and a row holds exactly one rollout. A rollouts split also carries per-token fields,
streams aligned one to one with the tokens and cut into shards at the same token counts:
    train-loss_mask-00000.bin      uint8, 1 where the token is a completion token (a trained target)
    train-advantages-00000.bin     float32, the token's advantage (0 outside the completion)
    train-old_logprobs-00000.bin   float32, log p(token) under the sampling policy (0 outside)
A field value at stream position k belongs to token k *as a target*: the prediction of token k
from the tokens before it in its rollout.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from jobspec.errors import DataError
from jobspec.run_config import is_remote
from runfolder.storage import join, url_to_fs, with_retries
from runtime.data.samples import read_digests

FORMAT = "jaxjob.tokens"
VERSION = 1
OFFSET_DTYPE = np.dtype("<i8")
HASH_CHUNK = 8 << 20
MANIFEST_FILE = "manifest.json"  # in the dataset's folder, beside (or above) its shards


def manifest_uri(folder: str) -> str:
    """The manifest of the dataset in `folder` (a local path or a URI)."""
    return join(folder, MANIFEST_FILE)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TokenizerInfo(_Model):
    id: str = Field(description="'byte' or 'hf:<sha256-16 of tokenizer.json>'.")
    kind: Literal["byte", "hf"]
    vocab_size: int = Field(gt=0)
    eos_id: int = Field(ge=0)
    source: str | None = Field(
        None, description="The tokenizer spec given to prepare (informational)."
    )


class ShardInfo(_Model):
    path: str = Field(description="File name relative to the manifest's folder.")
    tokens: int = Field(gt=0)
    sha256: str
    sample_sha256: str | None = Field(
        None, description="Checksum of sampled blocks (samples.py); absent in older manifests."
    )


# The per-token fields a rollouts split may carry (the one list; the Literal spells the same names).
FieldName = Literal["loss_mask", "advantages", "old_logprobs"]
FIELD_DTYPES: dict[str, str] = {
    "loss_mask": "uint8",
    "advantages": "float32",
    "old_logprobs": "float32",
}
PG_FIELDS = ("advantages", "old_logprobs")  # what a policy-gradient rollout adds to loss_mask


class FieldInfo(_Model):
    dtype: Literal["uint8", "float32"]
    shards: list[ShardInfo] = Field(description="Aligned with the split's token shards.")


class SplitInfo(_Model):
    tokens: int = Field(ge=0)
    documents: int = Field(ge=0)
    max_token_id: int = Field(ge=-1, description="-1 for an empty split.")
    shards: list[ShardInfo]
    offsets: str = Field(description="int64 document start offsets (documents+1 entries).")
    offsets_sha256: str
    offsets_sample_sha256: str | None = Field(
        None, description="Checksum of sampled blocks of the offsets file (samples.py)."
    )
    fields: dict[FieldName, FieldInfo] = Field(
        default_factory=dict, description="Per-token streams aligned with the tokens (rollouts)."
    )
    max_document_tokens: int | None = Field(
        None, ge=0, description="Tokens of the longest document (rollouts layout)."
    )


class Splits(_Model):
    train: SplitInfo
    validation: SplitInfo


class SourceInfo(_Model):
    inputs: list[str]
    files: int
    val_fraction: float
    max_bytes: int | None
    shard_tokens: int
    # Absent in manifests made before parquet inputs and parts.
    text_field: str | None = None
    part_bytes: int | None = Field(None, description="Input bytes per part (see prepare/parts.py).")
    parts: int | None = None


class Manifest(_Model):
    format: Literal["jaxjob.tokens"] = FORMAT
    version: Literal[1] = VERSION
    tokenizer: TokenizerInfo
    token_dtype: Literal["uint16", "uint32"]
    layout: Literal["stream", "rollouts"] = Field(
        "stream", description="stream: rows cut from the documents' stream; rollouts: one per row."
    )
    splits: Splits
    total_tokens: int = Field(ge=0)
    total_documents: int = Field(ge=0)
    max_token_id: int = Field(ge=-1)
    fingerprint: str
    source: SourceInfo | None = None

    # Folder the relative paths resolve against; set by load_manifest / prepare.
    _root: str | None = PrivateAttr(None)

    @property
    def root(self) -> str:
        if self._root is None:
            raise DataError("this manifest was not loaded from a folder; use load_manifest(uri)")
        return self._root

    def with_root(self, root: str) -> Manifest:
        self._root = root
        return self

    def split(self, name: str) -> SplitInfo:
        if name not in ("train", "validation"):
            raise DataError(f"data split {name!r} does not exist; use 'train' or 'validation'")
        return getattr(self.splits, name)

    def uri_of(self, rel: str) -> str:
        return join(self.root, rel)

    @property
    def field_names(self) -> tuple[str, ...]:
        """The per-token fields every split carries (empty for a text stream)."""
        return tuple(self.splits.train.fields)


def token_dtype_for(vocab_size: int) -> Literal["uint16", "uint32"]:
    return "uint16" if vocab_size <= 65536 else "uint32"


def compute_fingerprint(m: Manifest) -> str:
    h = hashlib.sha256(f"{FORMAT}/{VERSION}|{m.tokenizer.id}|{m.token_dtype}".encode())
    if m.layout != "stream":  # a text stream hashes as it did before layouts existed
        h.update(f"|layout:{m.layout}".encode())
    for name in ("train", "validation"):
        s = m.split(name)
        h.update(f"|{name}:{s.offsets_sha256}".encode())
        for sh in s.shards:
            h.update(f",{sh.tokens}:{sh.sha256}".encode())
        for field, info in sorted(s.fields.items()):
            h.update(f"|{field}:{info.dtype}".encode())
            for sh in info.shards:
                h.update(f",{sh.tokens}:{sh.sha256}".encode())
    return h.hexdigest()[:16]


def _root_of(uri: str) -> str:
    return uri.rsplit("/", 1)[0] if "/" in uri else "."


def write_manifest(manifest: Manifest, uri: str) -> None:
    """Write manifest.json so readers see the whole file or none (object put, or tmp + rename)."""
    data = (manifest.model_dump_json(indent=2) + "\n").encode()
    fs, path = url_to_fs(uri)
    if is_remote(uri):
        fs.pipe_file(path, data)  # one object upload: atomic on GCS
        return
    tmp = path + ".tmp"
    with fs.open(tmp, "wb") as f:
        f.write(data)
    fs.mv(tmp, path)


def _sizes(fs: Any, paths: list[str]) -> dict[str, int | None]:
    """Sizes of files by listing each parent folder once (one request per folder on GCS)."""
    out: dict[str, int | None] = {}
    by_dir: dict[str, list[str]] = {}
    for p in paths:
        by_dir.setdefault(posixpath.dirname(p.rstrip("/")), []).append(p)
    for d, ps in by_dir.items():
        fs.invalidate_cache(d)  # gcsfs caches listings; a prepare may have just written here
        try:
            found = with_retries(lambda d=d: fs.ls(d, detail=True), f"list {d}")
            listing = {e["name"].rstrip("/"): e for e in found}
        except FileNotFoundError:
            listing = {}
        for p in ps:
            e = listing.get(p.rstrip("/"))
            out[p] = int(e["size"]) if e is not None and e.get("type") == "file" else None
    return out


def _read_all(fs: Any, path: str, uri: str) -> bytes:
    """A small file's bytes, each try with a deadline (a missing file is an answer, raised)."""

    def read() -> bytes:
        with fs.open(path, "rb") as f:
            return f.read()

    return with_retries(read, f"read {uri}")


def load_manifest(uri: str) -> Manifest:
    """Parse manifest.json at `uri` and check every listed file exists with the recorded size."""
    fs, path = url_to_fs(uri)
    try:
        raw = _read_all(fs, path, uri)
    except FileNotFoundError as e:
        raise DataError(
            f"data manifest {uri} does not exist; run `runtime data prepare` to make it or fix "
            "data.manifest"
        ) from e
    except IsADirectoryError as e:
        raise DataError(
            f"data manifest {uri} is a folder; point data.manifest at its manifest.json"
        ) from e
    try:
        doc = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(
            f"data manifest {uri} is not valid JSON ({e}); re-run `runtime data prepare` for it"
        ) from e
    try:
        m = Manifest.model_validate(doc)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"]) or "(top level)"
        raise DataError(
            f"data manifest {uri} does not match the manifest schema at {loc}: {err['msg']}; "
            "re-run `runtime data prepare` with this jaxjob version"
        ) from e
    m.with_root(_root_of(uri))
    _check_consistency(m, uri)
    _check_files(m, uri)
    return m


def _check_consistency(m: Manifest, uri: str) -> None:
    names = set(m.splits.train.fields)
    for name in ("train", "validation"):
        s = m.split(name)
        _check_relative(uri, f"splits.{name}.offsets", s.offsets)
        for i, sh in enumerate(s.shards):
            _check_relative(uri, f"splits.{name}.shards[{i}].path", sh.path)
        for field, info in s.fields.items():
            for i, sh in enumerate(info.shards):
                _check_relative(uri, f"splits.{name}.fields.{field}.shards[{i}].path", sh.path)
        if sum(sh.tokens for sh in s.shards) != s.tokens:
            raise DataError(
                f"data manifest {uri}: splits.{name}.tokens ({s.tokens}) is not the sum of its shard "
                "token counts; re-run `runtime data prepare`"
            )
        if set(s.fields) != names or (names and m.layout != "rollouts"):
            raise DataError(
                f"data manifest {uri}: splits.{name}.fields {sorted(s.fields)} do not match the "
                f"manifest's layout {m.layout!r} and train fields {sorted(names)}; re-run "
                "`runtime data prepare`"
            )
        want = [sh.tokens for sh in s.shards]
        for field, info in s.fields.items():
            if info.dtype != FIELD_DTYPES[field] or [sh.tokens for sh in info.shards] != want:
                raise DataError(
                    f"data manifest {uri}: field {field} of split {name} is not a "
                    f"{FIELD_DTYPES[field]} stream cut like its tokens; re-run `runtime data prepare`"
                )
    if m.fingerprint != compute_fingerprint(m):
        raise DataError(
            f"data manifest {uri}: fingerprint {m.fingerprint} does not match its contents; the file "
            "was edited by hand, re-run `runtime data prepare`"
        )


def _check_relative(uri: str, where: str, rel: str) -> None:
    """A manifest names files inside its own folder only: a path that climbs out (`..`), is
    absolute or is a URL would read (and verify, and train on) files the dataset does not own."""
    parts = rel.replace("\\", "/").split("/")
    if not rel or rel.startswith("/") or "://" in rel or ".." in parts or ":" in parts[0]:
        raise DataError(
            f"data manifest {uri}: {where} is {rel!r}, which is not a path inside the manifest's "
            "folder; shard and offsets paths must be relative without '..' (re-run "
            "`runtime data prepare` to rewrite the manifest)"
        )


def _files(m: Manifest) -> dict[str, tuple[str, int, str | None]]:
    """Every file the manifest lists: uri -> (what it is, its size in bytes, sampled checksum)."""
    itemsize = np.dtype(m.token_dtype).itemsize
    files: dict[str, tuple[str, int, str | None]] = {}
    for name in ("train", "validation"):
        s = m.split(name)
        for sh in s.shards:
            files[m.uri_of(sh.path)] = (f"shard {sh.path}", sh.tokens * itemsize, sh.sample_sha256)
        files[m.uri_of(s.offsets)] = (
            f"document offsets file {s.offsets}",
            (s.documents + 1) * OFFSET_DTYPE.itemsize,
            s.offsets_sample_sha256,
        )
        for field, info in s.fields.items():
            size = np.dtype(info.dtype).itemsize
            for sh in info.shards:
                files[m.uri_of(sh.path)] = (
                    f"{field} shard {sh.path}",
                    sh.tokens * size,
                    sh.sample_sha256,
                )
    return files


def _check_files(m: Manifest, uri: str) -> None:
    expected = _files(m)
    fs, _ = url_to_fs(m.root)
    paths = {url_to_fs(u)[1]: u for u in expected}
    sizes = _sizes(fs, list(paths))
    for p, u in paths.items():
        what, want, _ = expected[u]
        got = sizes[p]
        if got is None:
            raise DataError(
                f"data manifest {uri} lists {what} but {u} does not exist; re-run `runtime data "
                "prepare` or restore the file"
            )
        if got != want:
            raise DataError(
                f"data manifest {uri}: {what} is {got} bytes but the manifest records {want}; the "
                "file is truncated or from another prepare, re-run `runtime data prepare`"
            )
    # Same sizes: compare sampled blocks, so a file overwritten in place is refused here.
    sampled = {p: expected[u][1] for p, u in paths.items() if expected[u][2] is not None}
    digests = with_retries(lambda: read_digests(fs, sampled), f"read the files of {uri}")
    for p, digest in digests.items():
        what, _, want_digest = expected[paths[p]]
        if digest != want_digest:
            raise DataError(
                f"data manifest {uri}: {what} does not hold what the prepare wrote (its sampled "
                "blocks differ); the file was overwritten or damaged, re-run `runtime data "
                "prepare` or restore the file"
            )


def _hash_file(fs: Any, path: str, dtype: np.dtype | None) -> tuple[str, float]:
    """(sha256, largest value) of a file read in chunks: -1 when dtype is None or the file is
    empty, nan when a float file holds a non-finite value."""
    h = hashlib.sha256()
    mx = -1.0
    with fs.open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
            if dtype is not None and len(chunk) >= dtype.itemsize:
                v = np.frombuffer(chunk, dtype=dtype)
                if v.dtype.kind == "f" and not np.all(np.isfinite(v)):
                    mx = float("nan")
                elif mx == mx:  # not nan yet
                    mx = max(mx, float(v.max()))
    return h.hexdigest(), mx


def _check_fields_deep(m: Manifest, uri: str, name: str) -> int:
    """Re-hash and scan every field shard of a split; returns the number of files checked."""
    checked = 0
    for field, info in m.split(name).fields.items():
        for sh in info.shards:
            fs, path = url_to_fs(m.uri_of(sh.path))
            digest, mx = _hash_file(fs, path, np.dtype(info.dtype).newbyteorder("<"))
            bad = mx > 1 if info.dtype == "uint8" else mx != mx  # a mask is 0/1; floats finite
            if digest != sh.sha256:
                raise DataError(
                    f"data manifest {uri}: {field} shard {sh.path} does not match its recorded "
                    "sha256; the file changed, re-run `runtime data prepare`"
                )
            if bad:
                what = "values other than 0 and 1" if info.dtype == "uint8" else "non-finite values"
                raise DataError(
                    f"data manifest {uri}: {field} shard {sh.path} holds {what}; re-run "
                    "`runtime data prepare`"
                )
            checked += 1
    return checked


def read_offsets(m: Manifest, split: str) -> np.ndarray:
    """The split's int64 document offsets (documents+1 entries, first 0, last = tokens); a file
    that does not match the manifest is a DataError naming it."""
    s = m.split(split)
    uri = m.uri_of(s.offsets)
    fs, path = url_to_fs(uri)
    raw = _read_all(fs, path, uri)  # small: hashed and parsed from one read
    off = np.frombuffer(raw, dtype=OFFSET_DTYPE).astype(np.int64)
    if hashlib.sha256(raw).hexdigest() != s.offsets_sha256:
        why = "its recorded sha256"
    elif len(off) != s.documents + 1 or off[0] != 0 or off[-1] != s.tokens:
        why = f"the manifest's {s.documents} documents of {s.tokens} tokens"
    elif np.any(np.diff(off) <= 0):
        why = "increasing document starts"
    else:
        return off
    raise DataError(
        f"document offsets file {uri} does not match {why}; the file changed or is damaged, "
        "re-run `runtime data prepare` or restore it"
    )


def check_manifest(uri: str, deep: bool = False) -> dict[str, Any]:
    """Summary of a manifest for `runtime data check`; deep=True also re-hashes every file."""
    m = load_manifest(uri)
    dtype = np.dtype(m.token_dtype).newbyteorder("<")
    for name in ("train", "validation"):  # small, and what a bad file breaks is far from here
        read_offsets(m, name)
    checked = 0
    if deep:
        for name in ("train", "validation"):
            s = m.split(name)
            mx = -1
            for sh in s.shards:
                fs, path = url_to_fs(m.uri_of(sh.path))
                digest, smax = _hash_file(fs, path, dtype)
                smax = int(smax)
                if digest != sh.sha256:
                    raise DataError(
                        f"data manifest {uri}: shard {sh.path} has sha256 {digest[:16]}… but the "
                        "manifest records another; the file changed, re-run `runtime data prepare`"
                    )
                mx = max(mx, smax)
                checked += 1
            if mx != s.max_token_id:
                raise DataError(
                    f"data manifest {uri}: split {name} has token ids up to {mx} but the manifest "
                    f"records {s.max_token_id}; re-run `runtime data prepare`"
                )
            checked += 1 + _check_fields_deep(m, uri, name)
    return {
        "manifest": uri,
        "ok": True,
        "deep": deep,
        "files_hashed": checked,
        "files_sampled": sum(digest is not None for _, _, digest in _files(m).values()),
        "fingerprint": m.fingerprint,
        "tokenizer": m.tokenizer.model_dump(),
        "token_dtype": m.token_dtype,
        "layout": m.layout,
        "fields": list(m.field_names),
        "max_token_id": m.max_token_id,
        "total_tokens": m.total_tokens,
        "total_documents": m.total_documents,
        "splits": {
            name: {
                "tokens": m.split(name).tokens,
                "documents": m.split(name).documents,
                "shards": len(m.split(name).shards),
                "max_token_id": m.split(name).max_token_id,
            }
            for name in ("train", "validation")
        },
    }
