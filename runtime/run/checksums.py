"""Content checksums of a committed checkpoint, so that a byte changed after the save is found.

Once Orbax has committed step N, the writer records the size and MD5 of every file under
`checkpoints/N/` in `checkpoints/N/checksums.json`. Orbax reads only its item directories, so
the file rides along and goes with the step when it is deleted. Locally the files are read back
(still in the page cache after the save); on gs:// the MD5 that GCS computed on upload comes with
the listing, so nothing is downloaded (an object's bytes never change in place there: a rewrite
gets a new MD5). A step without the file was saved before checksums were recorded: it is
unverified, never damaged.
"""

from __future__ import annotations

import base64
import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from jobspec.errors import StorageError
from runfolder.storage import with_retries
from runfolder.store import ArtifactStore

FILE = "checksums.json"
CHUNK = 16 << 20  # bytes per read: one request on gs://, bounded memory for any file size
HASH_THREADS = 4  # files a check reads at once (a resume compares them beside Orbax's read)


@dataclass(frozen=True)
class Finding:
    verified: bool  # the step has a record to check against
    damage: str | None  # the first file that differs from it, in one phrase; None when intact


def record(store: ArtifactStore, rel: str) -> dict[str, Any]:
    """Size and MD5 of every file under `rel` (a step directory), by its path within it."""
    files = {}
    for name, (path, info) in sorted(_listing(store, rel).items()):
        size = int(info["size"])
        md5 = _metadata_md5(info) or _content_md5(store, f"{rel}/{name}", path, size)
        files[name] = {"bytes": size, "md5": md5}
    return {"algorithm": "md5", "files": files}


def write(store: ArtifactStore, rel: str, done: dict[str, Any] | None = None) -> None:
    """Write the checksums of the committed step directory `rel` (the writer's job): `done`,
    a `record` already made, or one made now."""
    store.write_json(f"{rel}/{FILE}", done if done is not None else record(store, rel))


def check(
    store: ArtifactStore, rel: str, *, content: bool, items: tuple[str, ...] | None = None
) -> Finding:
    """Compare the step directory `rel` with its record. `content=True` reads every byte also
    on gs:// (verify); otherwise gs:// objects are compared by the MD5 GCS keeps for them.
    `items` limits the check to those item directories and the step's own files (a restore of
    the parameters alone need not read the optimizer state)."""
    if not store.exists(f"{rel}/{FILE}"):
        return Finding(verified=False, damage=None)
    try:
        files = json.loads(store.read_bytes(f"{rel}/{FILE}"))["files"]
        wanted = {str(k): (int(v["bytes"]), str(v["md5"])) for k, v in files.items()}
    except (ValueError, TypeError, KeyError, AttributeError):
        return Finding(verified=True, damage=f"{FILE}: not a checksum record")
    found = _listing(store, rel)
    wanted = {
        name: v for name, v in wanted.items()
        if items is None or "/" not in name or name.split("/", 1)[0] in items
    }  # fmt: skip
    digests = _digests(store, rel, wanted, found, content)
    for name, (size, md5) in sorted(wanted.items()):
        if name not in found:
            return Finding(verified=True, damage=f"{name}: missing")
        info = found[name][1]
        if int(info["size"]) != size:
            return Finding(
                verified=True, damage=f"{name}: {info['size']} bytes, {size} when it was saved"
            )
        got = digests.get(name)
        if got is None:
            return Finding(verified=True, damage=f"{name}: missing")
        if got != md5:
            return Finding(verified=True, damage=f"{name}: its bytes changed after it was saved")
    return Finding(verified=True, damage=None)


def _digests(
    store: ArtifactStore, rel: str, wanted: dict, found: dict, content: bool
) -> dict[str, str | None]:
    """The MD5 of every wanted file present at its recorded size (None: gone while read): GCS's
    own where it has one and `content` is off, else read and hashed, several files at once
    (reads and hashlib release the GIL, and a multi-GB step is a few large files)."""
    out: dict[str, str | None] = {}
    todo = []
    for name, (size, _) in wanted.items():
        if name not in found or int(found[name][1]["size"]) != size:
            continue
        path, info = found[name]
        if (md5 := None if content else _metadata_md5(info)) is not None:
            out[name] = md5
        else:
            todo.append((name, path, size))

    def one(name: str, path: str, size: int) -> str | None:
        try:
            return _content_md5(store, f"{rel}/{name}", path, size)
        except FileNotFoundError:
            return None

    if len(todo) > 1:
        with ThreadPoolExecutor(max_workers=min(HASH_THREADS, len(todo))) as pool:
            hashed = list(pool.map(lambda t: one(*t), todo))
    else:
        hashed = [one(*t) for t in todo]
    out.update({t[0]: h for t, h in zip(todo, hashed, strict=True)})
    return out


def _listing(store: ArtifactStore, rel: str) -> dict[str, tuple[str, dict]]:
    """{path within `rel`: (filesystem path, info)} of every file under `rel`, less the record."""
    base = store._path(rel).rstrip("/")
    if store.remote:
        store.fs.invalidate_cache()  # Orbax wrote through another client: list the bucket anew
    found = _io(store, lambda: store.fs.find(base, detail=True), f"list {store.uri(rel)}")
    out = {}
    for path, info in found.items():
        name = str(path)[len(base) :].lstrip("/")
        if name and name != FILE and info.get("type", "file") == "file":
            out[name] = (str(path), info)
    return out


def _metadata_md5(info: dict) -> str | None:
    """The MD5 GCS computed for an object, as hex (absent for composed objects and locally)."""
    b64 = info.get("md5Hash")
    return base64.b64decode(b64).hex() if b64 else None


def _content_md5(store: ArtifactStore, rel: str, path: str, size: int) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    for start in range(0, size, CHUNK):
        end = min(start + CHUNK, size)
        read = lambda s=start, e=end: store.fs.cat_file(path, start=s, end=e)  # noqa: E731
        digest.update(_io(store, read, f"read {store.uri(rel)}"))
    return digest.hexdigest()


def _io(store: ArtifactStore, fn: Any, what: str) -> Any:
    """A storage call, retried on faults (StorageFaultError once spent, exit 45); a missing file
    is the caller's finding; any other OSError is one sentence."""
    try:
        return with_retries(fn, what, store.retry)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise StorageError(f"cannot {what}: {e.strerror or e}") from e
