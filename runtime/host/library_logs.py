"""What the libraries under the runtime may print: their errors, not their notices, and not
Orbax's reports of an exception that it raises to the runtime as well.

Orbax logs a failed background save from each of its threads, at ERROR ("[process=0][thread=
array_type_handler] _SignalingThread.run() raised an exception: ...", "[process=0] Failed to run
6 Handler Commit operations ...", "[process=0][thread=MainThread][step=10][wait_until_finished]
Save Finalize thread (save_finalize) failed."), eight lines for one full disk, and then raises
that exception to its caller, where the runtime reports it in one sentence
(runtime/run/checkpoint/service.py). Its "[process=N]" error lines are those reports: they are dropped.
Its other errors (a checkpoint it failed to remove, which it does not raise) are kept.

gcsfs does the same for a request it gives up on ("_request out of retries on exception: ...",
"... non-retriable exception: ...", each with a traceback) and then raises it: the runtime's
storage layer retries or reports it in one sentence (runfolder/storage.py), so those go too.
"""

from __future__ import annotations

import logging


class _DropOrbaxRaisedErrors(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and str(record.msg).startswith("[process="))


class _DropGcsfsRaisedErrors(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        raised = " out of retries on exception: " in msg or " non-retriable exception: " in msg
        return not (record.levelno >= logging.ERROR and raised)


def quiet() -> None:
    """Orbax logs routine notices (read-only managers, cleanup) as absl WARNINGs: keep errors,
    less the ones above. Idempotent."""
    absl = logging.getLogger("absl")
    absl.setLevel(logging.ERROR)
    if not any(isinstance(f, _DropOrbaxRaisedErrors) for f in absl.filters):
        absl.addFilter(_DropOrbaxRaisedErrors())
    gcsfs = logging.getLogger("gcsfs")
    if not any(isinstance(f, _DropGcsfsRaisedErrors) for f in gcsfs.filters):
        gcsfs.addFilter(_DropGcsfsRaisedErrors())
