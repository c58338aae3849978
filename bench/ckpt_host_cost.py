"""What a background checkpoint write costs the host that feeds the steps: CPU seconds of the
write and of its checksums, and how a stand-in for the train loop's per-step host work fares
while they run.

    python bench/ckpt_host_cost.py [--mb 384] [--dir /tmp/ckpt-host-cost] [--probe-ms 20]
        [--variants plain,zstd]

The state is float32 arrays of normal noise (weights and Adam moments compress about as
badly), `--mb` in all, saved by `CheckpointService` as a run saves it (async, then the writer's
checksums). The probe is one small jitted program, its result fetched, and a row appended to a
file: what `training.log_every = 1` asks of the host at every step. Rows (JSON, one per
variant): `blocked_s` (the save call), `written_s` (until indexed), `write_cpu_s` (the
process's CPU seconds while the save ran less the probe's own, as measured idle: Orbax,
tensorstore and checksums; `write_threads_cpu_s` splits the process's CPU by thread name, the probe's
included), `checksum_cpu_s` (the checksums alone, measured again after), `restore_s` and
`restore_cpu_s`, the probe's median and max milliseconds idle and during the write, and the
bytes on disk. Variants: `plain` (arrays written without compression, the default) and `zstd`
(Orbax's own default).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from runtime.host import platform  # noqa: E402

platform.choose()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from runfolder.store import ArtifactStore  # noqa: E402
from runtime.run import checksums  # noqa: E402
from runtime.run.checkpoint import orbax_manager  # noqa: E402
from runtime.run.checkpoint.service import CheckpointService  # noqa: E402
from runtime.run.meta import CheckpointMeta  # noqa: E402


def _arg(name: str, default: str) -> str:
    args = sys.argv[1:]
    return args[args.index(name) + 1] if name in args else default


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def thread_cpu() -> dict[str, float]:
    """CPU seconds per thread name (Linux /proc; tids of finished threads are gone)."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip().rstrip("0123456789-_")
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def _threads_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    delta = {k: round(v - before.get(k, 0.0), 2) for k, v in after.items()}
    return {k: v for k, v in sorted(delta.items(), key=lambda kv: -kv[1]) if v >= 0.05}


def make_state(mb: int) -> dict:
    """Params and two moments of 4 MiB-row matrices, normal noise, `mb` MiB in all."""
    rng = np.random.default_rng(0)
    rows = max(3, mb // 4)
    leaves = [rng.standard_normal((1024, 1024), np.float32) * 0.02 for _ in range(rows)]
    third = rows // 3
    return {
        "params": {f"w{i}": jnp.asarray(x) for i, x in enumerate(leaves[:third])},
        "opt_state": {f"m{i}": jnp.asarray(x) for i, x in enumerate(leaves[third:])},
    }


class Probe:
    """The train loop's host work of one step with log_every = 1: dispatch, fetch, one row."""

    def __init__(self, folder: str, ms: float) -> None:
        self.rows = open(os.path.join(folder, "probe.jsonl"), "a")  # noqa: SIM115
        n = 256
        self.x = jnp.ones((n, n), jnp.float32) / n
        reps = max(1, int(ms))  # about 1 ms of matmuls per rep on a CPU core
        self.fn = jax.jit(lambda x: [x := jnp.tanh(x @ x) for _ in range(reps)][-1].sum())
        self.fn(self.x).block_until_ready()

    def once(self) -> float:
        t = time.perf_counter()
        value = float(jax.device_get(self.fn(self.x)))
        self.rows.write(json.dumps({"loss": value, "time": time.time()}) + "\n")
        self.rows.flush()
        return time.perf_counter() - t

    def close(self) -> None:
        self.rows.close()


def _ms(times: list[float]) -> dict:
    if not times:
        return {"n": 0}
    return {
        "n": len(times),
        "median_ms": round(1e3 * statistics.median(times), 2),
        "max_ms": round(1e3 * max(times), 2),
    }


def measure(variant: str, mb: int, folder: str, probe_ms: float) -> dict:
    orbax_manager.COMPRESS = variant == "zstd"
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    state = make_state(mb)
    probe = Probe(folder, probe_ms)
    c0 = _cpu()
    idle = [probe.once() for _ in range(40)]
    probe_cpu = (_cpu() - c0) / len(idle)  # XLA runs the probe on threads of its own
    store = ArtifactStore(os.path.join(folder, "run"))
    ckpt = CheckpointService(store, keep=2, async_save=True)
    meta = CheckpointMeta(step=1, tokens=0, rng=[0, 0], decay_steps=1, config={})
    threads0, main0 = thread_cpu(), time.thread_time()
    cpu0, t0 = _cpu(), time.perf_counter()
    ckpt.save(1, params=state["params"], opt_state=state["opt_state"], meta=meta)
    blocked = time.perf_counter() - t0
    during = []
    while ckpt.poll() is None:
        during.append(probe.once())
    written = time.perf_counter() - t0
    write_cpu = (_cpu() - cpu0) - len(during) * probe_cpu
    threads = _threads_delta(threads0, thread_cpu())
    # Python's threads all carry the process's name: the loop's own share is told apart.
    threads["main thread (probe)"] = round(time.thread_time() - main0, 2)
    ckpt.close()
    probe.close()
    c0 = _cpu()
    checksums.record(store, "checkpoints/1")
    checksum_cpu = _cpu() - c0
    restore_s, restore_cpu = _restore(store, state)
    disk = sum(
        os.path.getsize(os.path.join(d, f))
        for d, _, fs in os.walk(os.path.join(folder, "run", "checkpoints", "1"))
        for f in fs
    )
    shutil.rmtree(folder, ignore_errors=True)
    return {
        "variant": variant,
        "device": jax.devices()[0].device_kind,
        "cores": os.cpu_count(),
        "state_mib": mb,
        "disk_mib": round(disk / 2**20, 1),
        "blocked_s": round(blocked, 3),
        "written_s": round(written, 3),
        "write_cpu_s": round(write_cpu, 2),
        "write_threads_cpu_s": threads,
        "checksum_cpu_s": round(checksum_cpu, 2),
        "restore_s": round(restore_s, 3),
        "restore_cpu_s": round(restore_cpu, 2),
        "probe_idle": _ms(idle),
        "probe_during_write": _ms(during),
    }


def _restore(store: ArtifactStore, state: dict) -> tuple[float, float]:
    def target(tree):
        return jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree
        )

    ckpt = CheckpointService(store, keep=2, read_only=True)
    c0, t0 = _cpu(), time.perf_counter()
    got = ckpt.restore(
        1, params_target=target(state["params"]), opt_state_target=target(state["opt_state"])
    )
    jax.block_until_ready(got[:2])
    took, cpu = time.perf_counter() - t0, _cpu() - c0
    ckpt.close()
    return took, cpu


def main() -> None:
    mb = int(_arg("--mb", "384"))
    folder = _arg("--dir", "/tmp/ckpt-host-cost")
    probe_ms = float(_arg("--probe-ms", "20"))
    for variant in _arg("--variants", "plain,zstd").split(","):
        print(json.dumps(measure(variant, mb, folder, probe_ms)), flush=True)


if __name__ == "__main__":
    main()
