"""`launch` costs: load + validate + render a job spec for 1, 64 and 1024 hosts on each backend,
and `launch submit` to the first training step on the local backend (2 processes). Prints JSON.

    python bench/launch.py [--repeats 5] [--no-submit] [--manifest M]

Rendering needs no cluster: k8s and slurm backends are imported lazily, and one that cannot be
imported is reported as {"absent": reason} instead of failing the benchmark. The submit figure
is wall-clock from starting `launch submit` (a fresh Python, as a user runs it) to the time of
the `first_step` event in events.jsonl, which the writer host records after step 1 (compilation
included); `submit_return_s` is when `launch submit` itself returned. A submit run that fails,
ends without a first step, or outlasts the timeout exits non-zero with its status and log tail.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NoReturn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tomli_w  # noqa: E402
import yaml  # noqa: E402

from jobspec.errors import JaxjobError  # noqa: E402
from launch.backends import get_backend  # noqa: E402
from launch.cli import prepare_submission  # noqa: E402
from launch.registry import Registry  # noqa: E402

HOSTS = (1, 64, 1024)
TERMINAL = ("succeeded", "failed", "cancelled")
# One realistic accelerator per backend; hosts -> (accelerator, devices per host).
TPU_V5P = {1: "tpu-v5p-8", 64: "tpu-v5p-512", 1024: "tpu-v5p-8192"}  # 4 chips per host


def run_config(manifest: str, output_uri: str, devices: int, steps: int = 20) -> dict[str, Any]:
    """A tiny model whose batch splits over every device (fsdp = devices)."""
    batch = max(8, devices)
    return {
        "run": {"id": "bench", "seed": 0, "output_uri": output_uri},
        "model": {"vocab_size": 260, "hidden_size": 32, "num_layers": 2, "num_heads": 4,
                  "num_kv_heads": 2, "intermediate_size": 64, "max_position_embeddings": 64},
        "optimizer": {"lr": 3e-3},
        "data": {"manifest": manifest},
        "training": {"seq_len": 16, "global_batch_size": batch, "target_tokens": 16 * batch * steps,
                     "log_every": 5},
        "checkpoint": {"every": 0, "keep": 1},
        "mesh": {"data": 2} if devices == 2 else {"fsdp": devices},
    }  # fmt: skip


# Per backend: the job spec's hardware keys for `hosts` hosts, devices per host, where runs go
# (None: under the bench's temp folder) and the backend's options.
_TARGETS: dict[str, tuple[Any, int, str | None, dict[str, Any]]] = {
    "local": (lambda h: {"accelerator": "cpu", "hosts": h}, 1, None, {}),
    "slurm": (lambda h: {"accelerator": "h100-80gb", "hosts": h}, 8, None, {}),
    "k8s": (
        lambda h: {"accelerator": TPU_V5P[h], "image": "example/jaxjob:1"},
        4,
        "gs://bench-bucket/runs",
        {"context": None, "namespace": None},
    ),
}


def job_for(backend: str, hosts: int, tmp: Path, manifest: str) -> Path:
    hardware, per_host, out, _ = _TARGETS[backend]
    run_path = tmp / f"{backend}-{hosts}.toml"
    cfg = run_config(manifest, out or str(tmp / "runs"), hosts * per_host)
    run_path.write_text(tomli_w.dumps(cfg))
    job = tmp / f"{backend}-{hosts}.yaml"
    spec = {"name": f"bench-{backend}", "run": run_path.name, **hardware(hosts)}
    job.write_text(yaml.safe_dump(spec))
    return job


def time_render(backend: str, hosts: int, tmp: Path, repeats: int) -> dict[str, Any]:
    job = job_for(backend, hosts, tmp, "unused/manifest.json")
    registry = Registry(tmp / "state")
    load, render, size = [], [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        sub = prepare_submission(str(job), backend, registry)  # load, validate, mesh fit
        t1 = time.perf_counter()
        files = get_backend(backend, _TARGETS[backend][3]).render(sub)
        t2 = time.perf_counter()
        load.append(t1 - t0)
        render.append(t2 - t1)
        size = sum(len(f.content) for f in files)
    return {
        "load_validate_ms": round(1e3 * statistics.median(load), 2),
        "render_ms": round(1e3 * statistics.median(render), 2),
        "total_ms": round(
            1e3 * statistics.median(a + b for a, b in zip(load, render, strict=True)), 2
        ),
        "files": [f.name for f in files],
        "bytes": size,
    }


def render_bench(tmp: Path, repeats: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for backend, (*_, opts) in _TARGETS.items():
        try:
            get_backend(backend, opts)
        except JaxjobError as e:
            out[backend] = {"absent": str(e)}
            continue
        out[backend] = {str(h): time_render(backend, h, tmp, repeats) for h in HOSTS}
    return out


def _parse_time(s: str) -> float:
    return dt.datetime.fromisoformat(s).timestamp()


def submit_bench(tmp: Path, manifest: str | None, timeout: float = 600) -> dict[str, Any]:
    if manifest is None:
        data = tmp / "data"
        subprocess.run(
            [sys.executable, "-m", "runtime", "data", "prepare", "--input",
             "{stdlib}/json/*.py", "--out", str(data), "--val-fraction", "0.1"],
            cwd=ROOT, check=True, capture_output=True,
        )  # fmt: skip
        manifest = str(data / "manifest.json")
    run_path = tmp / "submit.toml"
    run_path.write_text(tomli_w.dumps(run_config(manifest, str(tmp / "runs"), devices=2)))
    job = tmp / "submit.yaml"
    job.write_text(yaml.safe_dump({"name": "bench-submit", "hosts": 2, "run": run_path.name}))
    env = {**os.environ, "XDG_STATE_HOME": str(tmp / "submit-state")}

    def launch(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "launch.cli", *args],
            cwd=ROOT, env=env, capture_output=True, text=True, check=True,
        )  # fmt: skip

    def status() -> dict[str, Any]:
        return json.loads(launch("status", run_id, "--json").stdout)

    def fail(why: str, st: dict[str, Any]) -> NoReturn:
        logs = subprocess.run(
            [sys.executable, "-m", "launch.cli", "logs", run_id, "--tail", "20"],
            cwd=ROOT, env=env, capture_output=True, text=True,
        )  # fmt: skip
        raise SystemExit(
            f"bench/launch.py: local submit run {run_id} {why}\nstatus: {json.dumps(st)}\n"
            f"{logs.stdout[-3000:]}{logs.stderr[-1000:]}"
        )

    t0 = time.time()
    run_id = json.loads(launch("submit", str(job), "--json").stdout)["run_id"]
    returned = time.time() - t0
    events = tmp / "runs" / run_id / "events.jsonl"
    first: dict[str, Any] | None = None
    deadline = time.monotonic() + timeout
    next_status = 0.0
    st: dict[str, Any] = {}
    # Until the first step is recorded, and then until the run ends: a run that ends (or fails)
    # before its first step stops the wait at once instead of polling to the deadline.
    while True:
        if first is None and events.exists():
            rows = [json.loads(ln) for ln in events.read_text().splitlines() if ln.strip()]
            first = next((r for r in rows if r["event"] == "first_step"), None)
        if time.monotonic() >= next_status:
            st = status()
            next_status = time.monotonic() + 0.5
            if st["state"] in TERMINAL:
                break
        if time.monotonic() > deadline:
            launch("cancel", run_id)
            fail(f"did not end within {timeout:.0f} s (cancelled)", status())
        time.sleep(0.05)
    if first is None and events.exists():  # recorded between the last read and the end
        rows = [json.loads(ln) for ln in events.read_text().splitlines() if ln.strip()]
        first = next((r for r in rows if r["event"] == "first_step"), None)
    if first is None:
        fail(f"ended {st['state']} without a first_step event in {events}", st)
    if st["state"] != "succeeded":
        fail(f"ended {st['state']} after its first step", st)
    return {
        "processes": 2,
        "submit_return_s": round(returned, 3),
        "submit_to_first_step_s": round(_parse_time(first["time"]) - t0, 3),
        "runtime_start_to_first_step_s": round(first["seconds_since_start"], 3),
        "final_state": st["state"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-submit", action="store_true", help="Only the render timings.")
    ap.add_argument("--manifest", default=None, help="A prepared manifest for the submit run.")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="jaxjob-bench-launch-") as d:
        tmp = Path(d)
        report: dict[str, Any] = {
            "hosts": list(HOSTS),
            "render": render_bench(tmp, args.repeats),
        }
        if not args.no_submit:
            report["local_submit"] = submit_bench(tmp, args.manifest)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
