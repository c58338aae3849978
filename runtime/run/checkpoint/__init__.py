"""A run's checkpoints under `<run>/checkpoints`, one job a module: `service.py` (Orbax save and
restore, `CheckpointService`), `index.py` (index.json: the committed steps, latest and best),
`retention.py` (which steps are kept, how the others are deleted), `verify.py` (checksums and
the full read of `checkpoints verify`), `orbax_manager.py` (the items of a step and Orbax's
manager), `gcs_setup.py` (gs:// retries and caches before Orbax), `errors.py` (the errors and
their one-line causes), `log_filters.py` (library reports that repeat a failure already said).
Which steps are saved is the train loop's: runtime/train/cadence.py. Import each name from its
module; nothing is re-exported here.
"""

# Imported for its effect: the filters are installed once any part of the checkpoint code is.
from runtime.run.checkpoint import log_filters as _log_filters  # noqa: F401
