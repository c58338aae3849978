"""Exactly one writer host, agreed through the jax.distributed coordination service.

The key `jaxjob/<run>/writer/<attempt>` is claimed with `key_value_set(allow_overwrite=False)`,
which the service lets succeed once; every process then reads the key back, so all return the
value the service holds, not what each assumed. Process 0 claims first, so the writer is
process 0 whenever it is alive; the others wait for its claim and only race to claim themselves
if it has not come within `claim_grace_s` (whoever's set succeeds then wins, and process 0,
arriving late, reads the same answer). The attempt is part of the key, so every restart agrees
afresh. A single process is the writer without any service.
"""

from __future__ import annotations

from jobspec.errors import JaxjobError
from runtime.host import boot


def writer_key(run_id: str, attempt: int) -> str:
    return f"jaxjob/{run_id}/writer/{attempt}"


def elect_writer(
    attempt: int,
    *,
    run_id: str | None = None,
    timeout_s: float = 300.0,
    claim_grace_s: float = 30.0,
) -> int:
    """The process index of this attempt's writer; every process gets the same answer.

    Every process calls it after `boot()`; it is recorded in `boot.current()` for diagnostics.
    """
    from jax.errors import JaxRuntimeError

    client = boot.kv_client()
    info = boot.current()
    if client is None:
        writer, how = 0, "single-process"
    else:
        import jax

        key = writer_key(boot.run_and_attempt(run_id)[0], attempt)
        me = jax.process_index()
        value: str | None = None
        if me == 0:
            _try_claim(client, key, me)
        else:
            try:
                value = client.blocking_key_value_get(key, int(claim_grace_s * 1000))
            except JaxRuntimeError:
                _try_claim(client, key, me)  # process 0 is late: fall back to a race
        if value is None:
            try:
                value = client.blocking_key_value_get(key, int(timeout_s * 1000))
            except JaxRuntimeError as e:
                raise JaxjobError(
                    f"no writer was agreed for attempt {attempt} within {timeout_s:g} s "
                    f"({key} stayed unset: {str(e).splitlines()[0]}); check that every "
                    "process is running"
                ) from None
        writer, how = int(value), f"kv-claim:{key}"
    if info is not None:
        info.writer_index, info.writer_election = writer, how
    return writer


def _try_claim(client, key: str, me: int) -> None:
    """Claim `key` for this process; a claim someone else made first is left as it is (every
    process reads the key back afterwards)."""
    from jax.errors import JaxRuntimeError

    try:
        client.key_value_set(key, str(me), allow_overwrite=False)
    except JaxRuntimeError as e:
        if "ALREADY_EXISTS" not in str(e):
            raise
