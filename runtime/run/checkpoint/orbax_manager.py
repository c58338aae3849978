"""How a run's checkpoints are held in Orbax: the items each step holds, the handlers and restore
args of its arrays, and the CheckpointManager opened over `<run>/checkpoints`."""

from __future__ import annotations

from typing import Any

import orbax.checkpoint as ocp
from etils import epath

from jobspec.errors import CheckpointError
from runfolder.layout import CHECKPOINTS
from runfolder.store import ArtifactStore

JSON_FILE = "metadata"  # what Orbax's JSON handler names an item's one file
# `entry` repeats the step's index entry inside the checkpoint, so a step that committed just
# before a crash (index not yet rewritten) can be re-indexed from disk.
ITEMS = ("params", "opt_state", "meta", "entry")
RESUME_ITEMS = ("params", "opt_state", "meta")  # what a resume reads
ARRAY_ITEMS = ("params", "opt_state")
#: Orbax compresses arrays with zstd unless told otherwise. Over float32 weights and Adam moments
#: that saved 8% of the bytes for twice the CPU of the whole write (bench/ckpt_host_cost.py), CPU
#: a background write takes from the host that feeds the steps; so arrays are written plain.
#: Either kind restores: Orbax reads the codec from each array's metadata.
COMPRESS = False


def open_manager(
    store: ArtifactStore, *, async_save: bool, read_only: bool
) -> ocp.CheckpointManager:
    """Orbax's manager of `store`'s checkpoints, or CheckpointError when it cannot open them.
    Retention is ours, never Orbax's (service.py says why)."""
    directory = store.uri(CHECKPOINTS)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=None,  # retention is ours (retention.py)
        enable_async_checkpointing=async_save,
        # Removes what a crash left: local `<step>.orbax-checkpoint-tmp` dirs, gs:// steps
        # without a commit file. Never in read-only use: it would delete a live run's save.
        cleanup_tmp_directories=not read_only,
        create=not read_only,
        read_only=read_only,
        # The writer creates and commits step directories; the others write their shards.
        multiprocessing_options=ocp.options.MultiprocessingOptions(primary_host=store.writer_index),
    )
    try:
        return ocp.CheckpointManager(
            epath.Path(directory),
            item_names=ITEMS,
            item_handlers=array_handlers(store.writer_index),
            options=options,
        )
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot open checkpoints under {directory}: {e}") from e


def array_handlers(primary_host: int) -> dict[str, ocp.PyTreeCheckpointHandler]:
    """Orbax's handlers of the array items: `COMPRESS`, and the writer as the primary host."""
    mp = ocp.options.MultiprocessingOptions(primary_host=primary_host)
    return {
        item: ocp.PyTreeCheckpointHandler(use_compression=COMPRESS, multiprocessing_options=mp)
        for item in ARRAY_ITEMS
    }


def array_restore(target: Any) -> ocp.args.PyTreeRestore:
    """Restore args that read an array item into `target`'s shapes, dtypes and shardings."""
    return ocp.args.PyTreeRestore(
        target, restore_args=ocp.checkpoint_utils.construct_restore_args(target)
    )
