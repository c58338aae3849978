"""A small host program for the multi-host tests of boot, writer election and coordination.

    python tests/_mh_worker.py cluster [--attempts 0,1] [--timeout 60]
    python tests/_mh_worker.py loop [--watchdog 10] [--steps 100000] [--sleep 0.02] [--linger 0]

Lines starting with "MH " carry JSON for the tests; errors end like the CLI's: one sentence on
stderr, exit 2.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import signal
import sys
import time

from jobspec.errors import JaxjobError
from runtime.host import boot
from runtime.host.coordination import HostWatchdog, StopAgreement
from runtime.host.writer import elect_writer, writer_key


def emit(kind: str, **data: object) -> None:
    print("MH " + json.dumps({"kind": kind, **data}), flush=True)


def make_step():
    """A jitted global sum over every device of the cluster: a real cross-process collective."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()), ("data",))
    sharding = NamedSharding(mesh, PartitionSpec("data"))
    total = jax.jit(jnp.sum)
    local_n = jax.local_device_count()

    def step(k: int) -> float:
        # Process p contributes (p + 1) * k on each of its devices.
        local = np.full((local_n,), (jax.process_index() + 1) * k, np.float32)
        return float(total(jax.make_array_from_process_local_data(sharding, local)))

    def expected(k: int) -> float:
        return float(sum((p + 1) * k * local_n for p in range(jax.process_count())))

    return step, expected


def cluster(args: argparse.Namespace) -> int:
    import jax  # noqa: F401 - imported here, so the line below is when boot's own clock starts

    emit("booting", monotonic=time.monotonic())
    info = boot.boot(timeout_s=args.timeout, heartbeat_timeout_s=60)
    writers = {}
    for a in [int(x) for x in args.attempts.split(",")]:
        writers[a] = {"writer": elect_writer(a), "key": writer_key(info.run_id or "run", a)}
    step, expected = make_step()
    sums = [(step(k), expected(k)) for k in (1, 2, 3)]
    emit("cluster", info=info.as_dict(), writers=writers, sums=sums)
    boot.shutdown()
    return 0


def loop(args: argparse.Namespace) -> int:
    info = boot.boot(timeout_s=args.timeout, heartbeat_timeout_s=120)
    writer = elect_writer(info.attempt)
    stop = StopAgreement()
    stop.install()
    watchdog = HostWatchdog(timeout_s=args.watchdog)
    watchdog.start()
    step, expected = make_step()
    started = time.monotonic()
    for k in range(1, args.steps + 1):
        try:
            got = step(k)
        except Exception as e:
            # A dead peer: gloo raises (or the step blocks); the watchdog names the host.
            emit("step-error", process=info.process_index, step=k, error=str(e)[:300])
            watchdog.explain_failure(e)
            raise
        assert got == expected(k), (got, expected(k))
        if k == 1:
            emit("ready", process=info.process_index, writer=writer)
            print("READY", flush=True)
        if stop.should_stop(k):
            emit("stopped", process=info.process_index, step=k, reason=stop.reason)
            break
        time.sleep(args.sleep)
    else:
        emit("finished", process=info.process_index, step=args.steps)
    stop.restore()
    watchdog.mark_done()
    if info.process_index == 0:
        time.sleep(args.linger)  # the writer finishing its files while the others wait to leave
    boot.shutdown()
    watchdog.stop()
    emit("exit", process=info.process_index, seconds=round(time.monotonic() - started, 2))
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["cluster", "loop"])
    p.add_argument("--attempts", default="0")
    p.add_argument("--timeout", type=int, default=60)
    p.add_argument("--watchdog", type=float, default=10.0)
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--sleep", type=float, default=0.02)
    p.add_argument("--linger", type=float, default=0.0)
    args = p.parse_args()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # where a stuck host is: kill -USR1
    try:
        return cluster(args) if args.mode == "cluster" else loop(args)
    except JaxjobError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
