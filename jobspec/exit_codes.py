"""The runtime's exit codes: what every host returns and what the backends decide restarts on.

One table for both sides, here because `launch` (no jax) and `runtime` both import `jobspec`.
"""

from __future__ import annotations

EXIT_BAD_INPUT = 2  # a user mistake (config, data, spec): one sentence on stderr; never restarted
EXIT_RESTARTABLE = 42  # stopped by SIGTERM/SIGINT after its final checkpoint
EXIT_HOST_LOST = 43  # a peer host stopped responding (runtime.host_loss_timeout_s)
EXIT_CLUSTER_TIMEOUT = 44  # the cluster did not form within runtime.boot_timeout_s
RESTARTABLE_EXIT_CODES = (EXIT_RESTARTABLE, EXIT_HOST_LOST, EXIT_CLUSTER_TIMEOUT)
