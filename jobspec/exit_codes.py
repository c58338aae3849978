"""Every exit code jaxjob defines: what every host returns and what the backends decide restarts
on, and how the `launch` and `runtime` commands end.

One table for both sides, here because `launch` (no jax) and `runtime` both import `jobspec`.
docs/exit-codes.md's table is this file in words; keep them together.
"""

from __future__ import annotations

# A command that ran and answers no: `launch submit --wait` of a run that failed or was
# cancelled. From a host, 1 is a bug (an uncaught exception).
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2  # a user mistake (config, data, spec): one sentence on stderr; never restarted
EXIT_RESTARTABLE = 42  # stopped by SIGTERM/SIGINT (after its final checkpoint, or during start-up)
EXIT_HOST_LOST = 43  # a peer host stopped responding or stopped advancing (host_loss_timeout_s)
EXIT_CLUSTER_TIMEOUT = 44  # the cluster did not form within runtime.boot_timeout_s
EXIT_STORAGE_FAULT = 45  # storage failed under us (ENOSPC, EIO, gs:// 5xx/timeouts after retries)
# The loss, gradient norm or parameters became NaN/inf (training.on_nonfinite). Not restartable:
# a restart resumes from the last finite checkpoint with the same settings and data, and would
# diverge again; a person changes something first (lower lr, roll back, fix the data).
EXIT_DIVERGED = 46
RESTARTABLE_EXIT_CODES = (
    EXIT_RESTARTABLE,
    EXIT_HOST_LOST,
    EXIT_CLUSTER_TIMEOUT,
    EXIT_STORAGE_FAULT,
)
# A process killed by signal N exits 128+N as a shell or container runtime reports it
# (134 SIGABRT from JAX losing host 0, 137 SIGKILL/OOM, 139 SIGSEGV, 143 SIGTERM).
SIGNAL_EXIT_CODES = tuple(range(129, 160))
# A command stopped by Ctrl-C (128 + SIGINT, as a shell reports it); a host stopped by SIGINT
# checkpoints and exits EXIT_RESTARTABLE instead.
EXIT_INTERRUPTED = 130
# `launch wait`, `launch submit --wait --timeout D`: the run had not ended within D (it goes on);
# 124 as coreutils `timeout` ends.
EXIT_TIMED_OUT = 124


def is_restartable(rc: int) -> bool:
    """Whether a host's exit restarts the job (counted against max_restarts): a restartable
    code, a death by signal as a shell reports it (128+N) or as Popen does (-N)."""
    return rc in RESTARTABLE_EXIT_CODES or rc in SIGNAL_EXIT_CODES or rc < 0
