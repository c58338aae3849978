"""An export's output folder: refused while it holds files jaxjob did not export, written beside
it and swapped in whole, so that a kill at any moment leaves the old folder or the new one.

Public API:
    MARKER                                   jaxjob-export.json: the files an export wrote
    check_out(out_dir, overwrite) -> Path    the folder to write, refused early when it may not be
    replace_folder(out_dir, write, overwrite=False, record=None) -> list[str]

How a folder is replaced. `write(folder)` fills a new sibling `.<name>.jaxjob-new-<pid>-<id>/`;
the files of the old folder the export does not replace (a tokenizer, `model_ema.safetensors`,
a README) are hard-linked into it (copied where links fail), the marker is written last, and the
new folder takes the old one's place in one step: rename(2) when there is no folder or an empty
one, Linux's renameat2(RENAME_EXCHANGE) otherwise, and then the old one is deleted. Where the
exchange is not available (not Linux, a filesystem without it) the old folder is first renamed
to `.<name>.jaxjob-old-<pid>-<id>`, so a kill between the two renames leaves no folder at <name>;
the next export puts the old one back. Every export first cleans what a killed one left beside
its folder (one line on stderr for each), leaving alone the folders of an export still running.

What an export replaces is the model: config.json, model.safetensors, the
model-NNNNN-of-NNNNN.safetensors shards and their index. A folder holding anything without the
marker of an earlier export (someone's own Hugging Face dir) is refused unless `overwrite`.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import secrets
import shutil
import stat
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jobspec.errors import ConfigError, StorageError, StorageFaultError
from runfolder.storage import storage_fault

MARKER = "jaxjob-export.json"
MARKER_FORMAT = "jaxjob.hf-export"
# The model an export replaces as a whole; any other file of the folder is kept.
_MODEL = re.compile(
    r"^(config\.json|model\.safetensors|model\.safetensors\.index\.json"
    r"|model-\d{5}-of-\d{5}\.safetensors)$"
)
_LEFTOVER = re.compile(r"^jaxjob-(?P<kind>new|old)-(?P<pid>\d+)-[0-9a-f]{8}$")
_AT_FDCWD = -100  # <fcntl.h>: paths relative to the working directory
_RENAME_EXCHANGE = 2  # <linux/fs.h>


def _target(out_dir: str | Path) -> Path:
    """The folder an export replaces: absolute, with a symlink followed (the swap replaces the
    folder it points at, not the link)."""
    out = Path(os.path.abspath(Path(out_dir).expanduser()))
    return out.resolve() if out.is_symlink() else out


def check_out(out_dir: str | Path, *, overwrite: bool) -> Path:
    """The folder `out_dir` names, once it is known the export may replace it: call it before
    reading a checkpoint, so a wrong --out costs nothing. Cleans up after a killed export."""
    out = _target(out_dir)
    if not out.name:
        raise ConfigError(f"--out {out_dir} is a filesystem root; give a folder inside one")
    if out.exists() and not out.is_dir():
        raise ConfigError(
            f"--out {out_dir} is an existing file, not a directory; give a new or existing "
            "directory for config.json and the *.safetensors files"
        )
    parent = next((p for p in out.parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise ConfigError(f"--out {out_dir} is inside the file {parent}; give a directory path")
    if parent is not None and not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(
            f"--out {out_dir} cannot be written: {parent} is not writable (the export writes "
            f"the new folder beside {out.name} and swaps it in); give a --out in a folder you "
            "can write"
        )
    recover(out)
    others = [] if overwrite else _not_exported(out)
    if others:
        shown = ", ".join(others[:3]) + (", …" if len(others) > 3 else "")
        raise ConfigError(
            f"--out {out_dir} already holds files jaxjob did not export ({shown}); give a new or "
            "empty folder, or pass --overwrite to replace its config.json and model weights "
            "(model.safetensors, or its shards and index) and keep its other files"
        )
    return out


def _read_marker(folder: Path) -> dict[str, Any] | None:
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(marker, dict) and marker.get("format") == MARKER_FORMAT
    return marker if ok and isinstance(marker.get("files"), list) else None


def _not_exported(out: Path) -> list[str]:
    """The entries of `out` when it is neither missing, empty nor an earlier export's folder."""
    if not out.is_dir():
        return []
    entries = sorted(os.listdir(out))
    return [] if not entries or _read_marker(out) is not None else entries


def _alive(pid: int) -> bool:
    if pid == os.getpid():  # a killed export's pid, reused (a container's small pids)
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def recover(out: Path) -> None:
    """Clean what killed exports left beside `out`: an old folder moved aside while no folder is
    at `out` goes back; any other leftover is deleted. One line on stderr for each."""
    prefix = f".{out.name}."
    try:
        siblings = sorted(p for p in out.parent.iterdir() if p.name.startswith(prefix))
    except OSError:  # no parent yet: nothing was left
        return
    for entry in siblings:
        found = _LEFTOVER.match(entry.name[len(prefix) :])
        if found is None or _alive(int(found["pid"])):
            continue
        if found["kind"] == "old" and not os.path.lexists(out):
            os.rename(entry, out)
            _note(f"restored {out} from {entry.name}, moved aside by an export stopped mid-swap")
        else:
            shutil.rmtree(entry, ignore_errors=True)
            _note(f"removed {entry}, left by an export that was stopped before it finished")


def _note(text: str) -> None:
    print(f"note: {text}", file=sys.stderr, flush=True)


def _sibling(out: Path, kind: str) -> Path:
    return out.with_name(f".{out.name}.jaxjob-{kind}-{os.getpid()}-{secrets.token_hex(4)}")


def replace_folder(
    out_dir: str | Path,
    write: Callable[[Path], list[str]],
    *,
    overwrite: bool = False,
    record: dict[str, Any] | None = None,
) -> list[str]:
    """Have `write(folder)` fill a new folder (it returns the file names it wrote), keep the old
    folder's other files, and swap the result in at `out_dir` in one step; the names written.

    `record` goes into the marker beside the list of files (run id, step)."""
    out = check_out(out_dir, overwrite=overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    new = _sibling(out, "new")
    new.mkdir()
    try:
        files = write(new)
        _keep_others(out, new, files)
        body = {"format": MARKER_FORMAT, "version": 1, "files": files, **(record or {})}
        (new / MARKER).write_text(json.dumps(body, indent=2) + "\n")  # last: the folder is whole
        if out.is_dir():  # a shared folder stays as shared as it was
            os.chmod(new, stat.S_IMODE(out.stat().st_mode))
        _swap(new, out)
    except BaseException as e:
        shutil.rmtree(new, ignore_errors=True)  # the new folder, or the old one after a swap
        if isinstance(e, OSError):
            raise _write_error(out_dir, e) from e
        raise
    return files


def _write_error(out_dir: str | Path, e: OSError) -> StorageError:
    fault = storage_fault(e)
    if fault is not None:  # a full disk, EIO: restartable
        return StorageFaultError(
            f"cannot write the export to {out_dir}: {fault.reason}; free space or fix the storage "
            "and export again (the folder there, if any, is unchanged)"
        )
    return StorageError(
        f"cannot write the export to {out_dir}: {e.strerror or e}; choose a --out you can write "
        "(the folder there, if any, is unchanged)"
    )


def _keep_others(out: Path, new: Path, files: list[str]) -> None:
    """Carry every entry of the old folder the export does not replace into the new one."""
    if not out.is_dir():
        return
    replaced = {*files, MARKER, *((_read_marker(out) or {}).get("files") or [])}
    for name in sorted(os.listdir(out)):
        if name not in replaced and not _MODEL.match(name):
            _link_tree(out / name, new / name)


def _link_tree(src: Path, dst: Path) -> None:
    if src.is_symlink():
        os.symlink(os.readlink(src), dst)
    elif src.is_dir():
        shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
    else:
        _link_or_copy(src, dst)


def _link_or_copy(src: str | Path, dst: str | Path) -> None:
    """A hard link (a large file costs nothing: the old folder's name goes with it), or a copy
    where the filesystem has none."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _swap(new: Path, out: Path) -> None:
    """Put the folder `new` at `out` in one step; the old folder's files are deleted after."""
    if not out.is_dir() or not any(out.iterdir()):
        os.rename(new, out)  # rename(2) replaces an empty folder
        return
    if _exchange(new, out):
        shutil.rmtree(new, ignore_errors=True)  # the old folder now; a leftover is cleaned later
        return
    old = _sibling(out, "old")
    os.rename(out, old)  # a kill until the next rename: the next export puts `old` back
    try:
        os.rename(new, out)
    except BaseException:
        if not os.path.lexists(out):
            os.rename(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2 RENAME_EXCHANGE); False where the kernel, the C
    library or the filesystem lacks it."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # glibc before 2.28, musl
        return False
    fd, name = ctypes.c_int, ctypes.c_char_p
    renameat2.argtypes = [fd, name, fd, name, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))
