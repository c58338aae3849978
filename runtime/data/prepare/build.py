"""`runtime data prepare` and `runtime data merge`: text, JSONL or parquet files (plain or
compressed, local or gs://) → token shards + document offsets + manifest.json.

Public API:
    prepare_dataset(inputs, tokenizer, out, val_fraction=0.05, max_bytes=None,
                    shard_tokens=DEFAULT_SHARD_TOKENS, format="text", progress=None, *,
                    text_field="text", workers=None, part_bytes=PART_BYTES) -> Manifest
    prepare_share(inputs, tokenizer, out, share=(i, n), ...) -> ShareReport
                                                  one host's share of the parts; no manifest
    merge_shares(out, plan=None) -> Manifest        the manifest once every part is written
    expand_inputs(inputs: list[str]) -> list[str]   the sorted files the globs select
    prepare_for_run(cfg: DataConfig) -> Manifest     a run's `[data.prepare]`, when its manifest is
                                                  absent (runtime/data/mixture.py ensure_manifest)

Rules (the manifest format is described in runtime/data/manifest.py, the parts in parts.py):
  * inputs are globs ('**' crosses folders) on a local path or any fsspec URL (gs:// included;
    a local path naming a file is that file, whatever glob characters its name holds);
    '{stdlib}' expands to this Python's standard-library folder, minus its site-packages (which
    varies by install, so the same glob gives the same data everywhere). Files are taken in
    sorted path order. What a file holds depends on its name (readers.py): *.parquet rows (the
    `text_field` column, one row group at a time), *.jsonl[.gz|.zst] lines (their `text_field`
    string), any other file one document (decompressed when .gz/.zst).
  * the files are grouped, in order, into parts of about `part_bytes` of input (a file is never
    cut); each part is tokenized on its own, over `workers` processes, and the parts are merged
    in order. The dataset (shards, offsets, fingerprint) depends on the inputs and settings
    only, never on the worker count or on how many hosts shared the work.
  * max_bytes caps the input read: documents are taken in order until their bytes reach it, and
    the document that crosses it is cut at the limit (the parts then run one after another).
  * eos is appended after every document; documents with no tokens are skipped.
  * split by document index j within its part (over kept documents): with
    k = max(2, round(1 / val_fraction)), document j goes to validation when j % k == 1, so with
    two or more documents in a part both splits are non-empty; val_fraction = 0 puts everything
    in train.
  * a prepare never touches the dataset already in `out` until the new one is complete: the new
    shards go into a fresh folder `out/shards-<time>-<id>/`, manifest.json (the commit point: one
    atomic write pointing at them) is written last, and only then are the previous shards
    deleted. A prepare that fails (empty input, a tokenizer error, a full disk, Ctrl-C) removes
    its own folder (and `out` itself, with any parent folders, when it created them and they
    are empty) and leaves the previous dataset byte-identical; this works the same on gs://,
    which has no rename.
  * `out` must be new, empty or a jaxjob dataset's folder (its manifest.json says so; shard
    folders and files an earlier prepare left count as its own): anything else is refused unless
    `overwrite`, and even then only manifest.json is replaced there (the files beside it are
    kept). The shard folder of a prepare that was killed (SIGKILL, a lost node) stays until the
    next prepare commits, which deletes it and says so in one line on stderr.
  * shares (several hosts): `share=(i, n)` writes the parts p with p % n == i into
    `out/shares-<plan id>/` (the same folder on every host: the plan id is a hash of the input
    files and settings), each part committed by its own part.json; a part already committed is
    skipped, so a failed share is run again alone. `merge_shares` writes the manifest once
    every part is there (and then deletes earlier datasets' shards, as a prepare does).
  * format "rollouts": every input is rollout JSONL (rollouts.py); each rollout is one document
    (prompt then completion, no eos added) with its per-token fields; the inputs are one part;
    max_bytes is refused; the split rule is the same.
  * progress: a bar on stderr (bytes read of the inputs' total, documents, tokens/s, ETA; see
    progress.py); None shows it only when stderr is a terminal. It never changes the dataset.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import secrets
import sys
from typing import Literal, NamedTuple

from jobspec.errors import DataError, JaxjobError, StorageError, StorageFaultError
from jobspec.run_config import DataConfig
from runfolder.storage import join, storage_fault, url_to_fs
from runtime.data.manifest import (
    FIELD_DTYPES,
    FORMAT,
    MANIFEST_FILE,
    Manifest,
    SourceInfo,
    Splits,
    compute_fingerprint,
    manifest_uri,
    token_dtype_for,
    write_manifest,
)
from runtime.data.prepare.parts import (
    ENCODE_BATCH,
    PART_BYTES,
    PLAN_JSON,
    Plan,
    list_inputs,
    make_plan,
    part_folder,
    read_part,
    write_bytes,
)
from runtime.data.prepare.parts import merge_parts as _merge_parts
from runtime.data.prepare.progress import PrepareProgress
from runtime.data.prepare.readers import TEXT_FIELD
from runtime.data.prepare.workers import default_workers, run_parts
from runtime.data.tokenizer import load_tokenizer

__all__ = [
    "DEFAULT_SHARD_TOKENS",
    "ENCODE_BATCH",
    "PART_BYTES",
    "ShareReport",
    "expand_inputs",
    "merge_shares",
    "prepare_dataset",
    "prepare_for_run",
    "prepare_share",
]

DEFAULT_SHARD_TOKENS = 1 << 26  # 128 MiB of uint16 per shard: few files, cheap range reads
# Files an older prepare wrote directly into `out` (before shard folders), and shard folders.
_OWN_FILE = re.compile(
    rf"^(train|validation)(-({'|'.join(FIELD_DTYPES)}))?-\d{{5}}\.bin$"
    rf"|^(train|validation)-offsets\.bin$|^{re.escape(MANIFEST_FILE)}\.tmp$"
)
_SHARD_DIR = re.compile(r"^shards-\d{8}T\d{6}-[0-9a-f]{8}$|^shares-[0-9a-f]{16}$")
_UNCHANGED = "(the dataset already there, if any, is unchanged)"


def expand_inputs(inputs: list[str]) -> list[str]:
    """Sorted, de-duplicated files matched by the globs; a glob matching nothing is an error."""
    return [f.uri for f in list_inputs(inputs)]


class ShareReport(NamedTuple):
    plan: str  # the plan id: the folder shares-<plan> under out
    share: tuple[int, int]
    written: list[int]  # parts this run wrote
    skipped: list[int]  # parts of this share already committed by an earlier run
    parts: int  # parts in the whole prepare


def _new_folder() -> str:
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S")
    return f"shards-{stamp}-{secrets.token_hex(4)}"


def _entries(fs, path: str) -> list[str]:
    fs.invalidate_cache(path)  # gcsfs caches listings; this prepare has just written here
    try:
        return [e.rstrip("/") for e in fs.ls(path, detail=False)]
    except FileNotFoundError:  # a new gs:// prefix does not exist until its first object
        return []


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


def _remove_folder(out: str, folder: str) -> None:
    """Delete one shard folder; a failure here must not hide the error that led to it."""
    fs, path = url_to_fs(join(out, folder))
    try:
        if fs.exists(path):
            fs.rm(path, recursive=True)
    except Exception:  # noqa: BLE001
        pass


def _missing_folders(fs, path: str) -> list[str]:
    """The folders a write under `path` creates: `path` and its missing parents, deepest first.
    Never the filesystem root or a bucket (an object store's first path component, which a
    prepare does not create)."""
    below = 1 if hasattr(fs, "split_path") else 0  # gcsfs, s3fs, adlfs: bucket/key paths
    missing: list[str] = []
    p = path.rstrip("/")
    while p and p != fs.root_marker and p.strip("/").count("/") >= below and not fs.exists(p):
        missing.append(p)
        parent = fs._parent(p)
        if parent == p:
            break
        p = parent
    return missing


def _remove_created(fs, folders: list[str]) -> None:
    """Delete the folders a failed prepare created, deepest first, each only while empty (a file
    someone else put there since keeps it); a failure here must not hide the original error."""
    for folder in folders:
        try:
            fs.invalidate_cache(folder)
            if not fs.exists(folder):  # an object store's folder goes with its last object
                continue
            if fs.ls(folder, detail=False):
                return
            fs.rmdir(folder)
        except Exception:  # noqa: BLE001
            return


class _Found(NamedTuple):
    """What `out` held before a prepare."""

    dataset: bool  # its manifest.json is a jaxjob dataset's
    folders: frozenset[str]  # the shard folders that manifest names
    others: list[str]  # entries that are not a prepare's, when it is no dataset


def _look(out: str) -> _Found:
    fs, root = url_to_fs(out)
    try:
        if fs.isfile(root):
            raise DataError(f"--out {out} is a file; give a new or empty folder for the dataset")
        names = sorted(e.rsplit("/", 1)[-1] for e in _entries(fs, root))
        manifest = _read_json(fs, join(root, MANIFEST_FILE)) if MANIFEST_FILE in names else None
    except OSError:  # e.g. a path under a file: the first write says why, in one sentence
        return _Found(False, frozenset(), [])
    if isinstance(manifest, dict) and manifest.get("format") == FORMAT:
        return _Found(True, _folders_of(manifest), [])
    mine = [n for n in names if _SHARD_DIR.match(n) or _OWN_FILE.match(n)]
    return _Found(False, frozenset(), [n for n in names if n not in mine])


def _read_json(fs, path: str) -> object:
    try:
        with fs.open(path, "rb") as f:
            return json.loads(f.read())
    except ValueError:
        return None


def _folders_of(manifest: dict) -> frozenset[str]:
    """The top folders of the files a manifest names (its shard folder)."""
    splits = manifest.get("splits")
    paths = [split.get("offsets") for split in (splits or {}).values() if isinstance(split, dict)]
    return frozenset(p.split("/", 1)[0] for p in paths if isinstance(p, str) and "/" in p)


def _check_out(out: str, overwrite: bool) -> _Found:
    """Refuse an `out` that holds someone else's files, unless `overwrite`."""
    found = _look(out)
    if found.others and not overwrite:
        shown = ", ".join(found.others[:3]) + (", …" if len(found.others) > 3 else "")
        raise DataError(
            f"{out} already holds files that are not a jaxjob dataset ({shown}); prepare into a "
            "new or empty folder, or pass --overwrite to `runtime data prepare` to write the "
            "dataset beside them (they are kept; a manifest.json there is replaced)"
        )
    return found


def _remove_previous(out: str, keep: str, found: _Found) -> None:
    """After the new manifest is in place: delete the shard folders of earlier prepares, and the
    loose shard files of an older layout's dataset (nothing else in `out` is ours to delete).
    A folder the old manifest did not name was left by a prepare that never finished: said."""
    fs, path = url_to_fs(out)
    for entry in _entries(fs, path):
        name = entry.rsplit("/", 1)[-1]
        if _SHARD_DIR.match(name) and name != keep:
            fs.rm(entry, recursive=True)
            if name not in found.folders:
                print(
                    f"note: removed {join(out, name)}, left by a prepare that did not finish",
                    file=sys.stderr,
                    flush=True,
                )
        elif _OWN_FILE.match(name) and found.dataset:
            fs.rm_file(entry)


def _plan(
    inputs: list[str],
    tokenizer: str,
    *,
    val_fraction: float,
    max_bytes: int | None,
    shard_tokens: int,
    format: str,
    text_field: str,
    part_bytes: int,
) -> Plan:
    if not 0 <= val_fraction < 1:
        raise DataError(f"val_fraction is {val_fraction}; use a value in [0, 1)")
    if shard_tokens <= 0:
        raise DataError(f"shard_tokens is {shard_tokens}; use a positive token count")
    if part_bytes <= 0:
        raise DataError(f"part_bytes is {part_bytes}; use a positive byte count")
    if format not in ("text", "rollouts"):
        raise DataError(f"format is {format!r}; use 'text' or 'rollouts'")
    if format == "rollouts" and max_bytes is not None:
        raise DataError(
            "max_bytes cuts documents at a byte count, which would cut a rollout; leave max_bytes "
            "unset for format 'rollouts' (select fewer input files instead)"
        )
    if not text_field:
        raise DataError("the text field is empty; give the JSONL key or parquet column to read")
    tok = load_tokenizer(tokenizer)
    return make_plan(
        inputs,
        list_inputs(inputs),
        tok,
        tokenizer,
        token_dtype_for(tok.vocab_size),
        format=format,  # type: ignore[arg-type]
        text_field=text_field,
        val_fraction=val_fraction,
        max_bytes=max_bytes,
        shard_tokens=shard_tokens,
        part_bytes=part_bytes,
    )


def _bar(plan: Plan, indices: list[int], progress: bool | None) -> PrepareProgress:
    if plan.format == "rollouts":
        return PrepareProgress(None, progress)
    total = sum(f.size for i in indices for f in plan.parts[i])
    if plan.max_bytes is not None:
        total = min(total, plan.max_bytes)
    return PrepareProgress(total, progress)


def _workers(workers: int | None) -> int:
    if workers is None:
        return default_workers()
    if workers < 1:
        raise DataError(f"workers is {workers}; use 1 or more (default: the cores)")
    return workers


def prepare_dataset(
    inputs: list[str],
    tokenizer: str,
    out: str,
    val_fraction: float = 0.05,
    max_bytes: int | None = None,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    format: Literal["text", "rollouts"] = "text",
    progress: bool | None = None,
    *,
    text_field: str = TEXT_FIELD,
    workers: int | None = None,
    part_bytes: int = PART_BYTES,
    overwrite: bool = False,
) -> Manifest:
    """Tokenize `inputs` into `out` (local folder or gs://…) and return the written manifest.

    format="rollouts" reads rollout JSONL (see rollouts.py) into the "rollouts" layout.
    progress: show the bar on stderr (True), never (False), or only on a terminal (None).
    workers: processes tokenizing parts at once (default: the cores).
    overwrite: prepare into a folder that holds other files than a jaxjob dataset's."""
    found = _check_out(out, overwrite)
    plan = _plan(
        inputs, tokenizer, val_fraction=val_fraction, max_bytes=max_bytes,
        shard_tokens=shard_tokens, format=format, text_field=text_field, part_bytes=part_bytes,
    )  # fmt: skip
    n = _workers(workers)
    indices = list(range(len(plan.parts)))
    bar = _bar(plan, indices, progress)
    fs, root = url_to_fs(out)
    folder = _new_folder()
    created: list[str] = []
    try:
        created = _missing_folders(fs, root)
        fs.makedirs(join(root, folder), exist_ok=True)
        done = run_parts(plan, indices, out, folder, n, bar, max_bytes)
        manifest = _commit(plan, [done[i] for i in sorted(done)], out, folder)
    except BaseException as e:  # nothing was swapped in: the old dataset stays as it was
        bar.close(complete=False)
        _remove_folder(out, folder)
        _remove_created(fs, created)  # an --out this prepare made is not left behind empty
        if isinstance(e, Exception) and not isinstance(e, JaxjobError):
            _raise_write_error(out, e)
        raise
    bar.close(complete=True)
    _remove_previous(out, folder, found)
    return manifest


def _commit(plan: Plan, results: list, out: str, folder: str) -> Manifest:
    """Merge the parts and write manifest.json (the commit point)."""
    splits = _merge_parts(plan, results, out, folder)
    if splits.train.documents + splits.validation.documents == 0:
        raise DataError(
            f"the inputs {plan.inputs} matched {len(plan.files)} files but they hold no text; "
            "point the inputs at non-empty text, .jsonl or .parquet files (the dataset already "
            f"in {out}, if any, is unchanged)"
        )
    manifest = _manifest(plan, splits)
    write_manifest(manifest, manifest_uri(out))
    return manifest.with_root(out.rstrip("/") or out)


def _manifest(plan: Plan, splits: Splits) -> Manifest:
    source = SourceInfo(
        inputs=list(plan.inputs),
        files=len(plan.files),
        val_fraction=plan.val_fraction,
        max_bytes=plan.max_bytes,
        shard_tokens=plan.shard_tokens,
        text_field=plan.text_field,
        part_bytes=plan.part_bytes,
        parts=len(plan.parts),
    )
    draft = Manifest(
        tokenizer=plan.tokenizer,
        token_dtype=plan.token_dtype,
        layout="rollouts" if plan.format == "rollouts" else "stream",
        splits=splits,
        total_tokens=splits.train.tokens + splits.validation.tokens,
        total_documents=splits.train.documents + splits.validation.documents,
        max_token_id=max(splits.train.max_token_id, splits.validation.max_token_id),
        fingerprint="",
        source=source,
    )
    return draft.model_copy(update={"fingerprint": compute_fingerprint(draft)})


def shares_folder(plan_id: str) -> str:
    return f"shares-{plan_id}"


def prepare_share(
    inputs: list[str],
    tokenizer: str,
    out: str,
    share: tuple[int, int],
    val_fraction: float = 0.05,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    format: Literal["text", "rollouts"] = "text",
    progress: bool | None = None,
    *,
    text_field: str = TEXT_FIELD,
    workers: int | None = None,
    part_bytes: int = PART_BYTES,
    overwrite: bool = False,
) -> ShareReport:
    """Write share i of n: the parts p with p % n == i, into out/shares-<plan id>/. Parts an
    earlier run committed are kept; the manifest is written by merge_shares."""
    i, n = share
    if not (n >= 1 and 0 <= i < n):
        raise DataError(f"share {i}/{n} does not exist; use --shard I/N with 0 <= I < N")
    _check_out(out, overwrite)
    plan = _plan(
        inputs, tokenizer, val_fraction=val_fraction, max_bytes=None, shard_tokens=shard_tokens,
        format=format, text_field=text_field, part_bytes=part_bytes,
    )  # fmt: skip
    folder = shares_folder(plan.id)
    mine = [p for p in range(len(plan.parts)) if p % n == i]
    skipped = [p for p in mine if read_part(out, folder, plan, p) is not None]
    todo = [p for p in mine if p not in skipped]
    bar = _bar(plan, todo, progress)
    try:
        # The plan goes in first (the same bytes from every host), so merge can read it.
        write_bytes(join(out, folder, PLAN_JSON), plan.model_dump_json(indent=1).encode())
        for p in todo:  # a half-written part of an earlier run is written again from scratch
            _remove_folder(out, part_folder(folder, p))
        run_parts(plan, todo, out, folder, _workers(workers), bar)
    except BaseException as e:  # committed parts stay: running the share again resumes
        bar.close(complete=False)
        if isinstance(e, Exception) and not isinstance(e, JaxjobError):
            _raise_write_error(out, e)
        raise
    bar.close(complete=True)
    return ShareReport(plan.id, (i, n), todo, skipped, len(plan.parts))


def _plans_in(out: str) -> dict[str, Plan]:
    fs, root = url_to_fs(out)
    plans = {}
    for entry in _entries(fs, root):
        name = entry.rsplit("/", 1)[-1]
        if name.startswith("shares-"):
            try:
                with fs.open(f"{entry}/{PLAN_JSON}", "rb") as f:
                    plan = Plan.model_validate_json(f.read())
            except (FileNotFoundError, ValueError):
                continue
            plans[plan.id] = plan
    return plans


def merge_shares(out: str, plan: str | None = None) -> Manifest:
    """The manifest over every share's parts in out/shares-<plan>/ (the only such folder,
    unless `plan` names one); refused while a part is missing."""
    plans = _plans_in(out)
    if plan is not None:
        if plan not in plans:
            raise DataError(
                f"{out} holds no shares of plan {plan} (it holds {sorted(plans) or 'none'}); "
                "check --plan against the folder names shares-<plan>"
            )
        chosen = plans[plan]
    elif len(plans) == 1:
        chosen = next(iter(plans.values()))
    elif not plans:
        raise DataError(
            f"{out} holds no prepare shares; run `runtime data prepare ... --shard I/N --out "
            f"{out}` on every host first"
        )
    else:
        raise DataError(
            f"{out} holds the shares of {len(plans)} different prepares ({', '.join(sorted(plans))}"
            "); pass --plan with the one to merge (the others differ in inputs or settings)"
        )
    folder = shares_folder(chosen.id)
    found = _look(out)
    results = [read_part(out, folder, chosen, p) for p in range(len(chosen.parts))]
    missing = [p for p, r in enumerate(results) if r is None]
    if missing:
        shown = ", ".join(str(p) for p in missing[:10]) + (" …" if len(missing) > 10 else "")
        first = chosen.parts[missing[0]][0].uri
        raise DataError(
            f"the shares in {out} do not cover the input: {len(missing)} of "
            f"{len(chosen.parts)} parts are missing ({shown}; part {missing[0]} starts at "
            f"{first}); run the share that holds them again (with --shard I/N, part p is in "
            "share p % N) and then merge"
        )
    try:
        manifest = _commit(chosen, results, out, folder)  # type: ignore[arg-type]
    except Exception as e:
        if not isinstance(e, JaxjobError):
            _raise_write_error(out, e)
        raise
    _remove_previous(out, folder, found)
    return manifest


def prepare_for_run(cfg: DataConfig) -> Manifest:
    """Make the dataset `[data.prepare]` says how, in the folder of data.manifest (which must be
    new, empty or a jaxjob dataset's): what a run's writer host does when that manifest is absent
    (runtime/data/mixture.py `ensure_manifest` decides, and has the other hosts wait)."""
    out_dir = os.path.dirname(cfg.manifest.rstrip("/")) or "."
    others = _look(out_dir).others
    if others:
        raise DataError(
            f"data.manifest {cfg.manifest}: its folder already holds files that are not a "
            f"jaxjob dataset ({', '.join(others[:3])}); point data.manifest into a new "
            "or empty folder, where [data.prepare] makes the dataset"
        )
    return prepare_dataset(
        cfg.prepare.inputs,
        cfg.prepare.tokenizer,
        out_dir,
        val_fraction=cfg.prepare.val_fraction,
        max_bytes=cfg.prepare.max_bytes,
        format=cfg.prepare.format,
        text_field=cfg.prepare.text_field,
        workers=cfg.prepare.workers,
    )
