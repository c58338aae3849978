"""A little disk kept back in a local run directory for the record of how the run ended.

On a full disk the failure itself is what needs recording: its event and a new manifest.json
(written whole, as a new file) would not fit. The writer keeps RESERVE_BYTES in a file of its
own from the start of each attempt and removes it right before the last records are written,
when the run fails or ends. Not on gs:// (an object store does not fill up).
"""

from __future__ import annotations

import contextlib
import os

from runfolder.layout import DISK_RESERVE
from runfolder.store import ArtifactStore

# A few blocks of any filesystem: the failure event, the manifest and a final summary.
RESERVE_BYTES = 64 * 1024


def keep(store: ArtifactStore) -> None:
    """Write the reserve (the writer, locally). Random bytes, so a compressing filesystem (btrfs,
    ZFS) allocates them. A disk already too full for it keeps none: the run's own writes say so."""
    if store.remote or not store.is_writer:
        return
    path = store.uri(DISK_RESERVE)
    try:
        with open(path, "wb") as f:
            f.write(os.urandom(RESERVE_BYTES))
            f.flush()
            os.fsync(f.fileno())
    except OSError:
        release(store)


def release(store: ArtifactStore) -> None:
    """Free the reserve for the records written next (gone already is fine)."""
    if store.remote or not store.is_writer:
        return
    with contextlib.suppress(OSError):
        os.remove(store.uri(DISK_RESERVE))
