"""Data at scale: prepare throughput with a BPE tokenizer over 1 and 2 workers, peak memory as the
input grows, and the loader's tokens/s from gs:// (a GCS emulator) against the train step's.

    python bench/prepare_scale.py [--mb 16] [--skip-gcs]

Prints one JSON object. Everything is made here: a synthetic corpus of JSONL files, a byte-level
BPE tokenizer trained on a sample of it (runtime/data/prepare/bpe.py), then:
  prepare   the same inputs with workers=1 and workers=2, in this process one after the other
            (TOKENIZERS_PARALLELISM=false: one worker is one core); the datasets must be equal
  memory    peak RSS of a child process preparing one .jsonl.zst file and one parquet file of
            S and 4S MB (shard_tokens 1M), less the RSS of a child that only imports; goal: flat
  gcs       the workers=2 dataset uploaded to the emulator; TokenBatches over gs:// (shuffle,
            prefetch 2) against the smoke model's train step on the same rows; goal >= 10x
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # before tokenizers loads: 1 worker = 1 core
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # before gcsfs is imported

WORDS = 3000
VOCAB = 4096
FILE_MB = 2  # one input file; parts of 2 MB make one part per file


def _words(seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    letters = "etaoinshrdlucmfwypvbgkqjxz"
    return ["".join(rng.choices(letters, k=rng.randint(2, 9))) for _ in range(WORDS)]


def _documents(total_bytes: int, seed: int):
    """Pseudo-text documents (Zipf-ish word choice, 40..600 words) until total_bytes."""
    rng = random.Random(seed)
    words = _words()
    weights = [1 / (k + 1) for k in range(WORDS)]
    made = 0
    while made < total_bytes:
        n = rng.randint(40, 600)
        text = " ".join(rng.choices(words, weights, k=n)) + "."
        made += len(text)
        yield text


def write_jsonl_files(folder: str, mb: int) -> list[str]:
    os.makedirs(folder, exist_ok=True)
    paths = []
    for k in range(max(1, mb // FILE_MB)):
        path = os.path.join(folder, f"web-{k:04d}.jsonl")
        with open(path, "w") as f:
            for doc in _documents(FILE_MB << 20, seed=k):
                f.write(json.dumps({"text": doc}) + "\n")
        paths.append(path)
    return paths


def bench_prepare(inputs: str, tokenizer: str, tmp: str) -> dict:
    from runtime.data.prepare.build import prepare_dataset

    out = {}
    prints = {}
    for workers in (1, 2):
        t0 = time.perf_counter()
        m = prepare_dataset([inputs], tokenizer, os.path.join(tmp, f"w{workers}"),
                            workers=workers, part_bytes=FILE_MB << 20, progress=False)  # fmt: skip
        s = time.perf_counter() - t0
        prints[workers] = m.fingerprint
        out[f"workers_{workers}"] = {"s": round(s, 2), "tokens": m.total_tokens,
                                     "tokens_per_s": round(m.total_tokens / s)}  # fmt: skip
    out["speedup_2_over_1"] = round(
        out["workers_2"]["tokens_per_s"] / out["workers_1"]["tokens_per_s"], 2
    )
    out["same_dataset"] = prints[1] == prints[2]
    out["parts"] = m.source.parts
    return out


def _child_rss(args: list[str]) -> float:
    """Peak RSS (MiB) of `python this_file --child ...` (VmHWM, see _peak_rss_mb)."""
    res = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True,
                         text=True, check=True)  # fmt: skip
    return json.loads(res.stdout.strip().splitlines()[-1])["maxrss_mb"]


def _one_file(kind: str, path: str, mb: int) -> None:
    docs = list(_documents(mb << 20, seed=99))
    if kind == "zst":
        import zstandard

        raw = "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()
        with open(path, "wb") as f:
            f.write(zstandard.ZstdCompressor().compress(raw))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": docs}), path, row_group_size=2000)


def bench_memory(tokenizer: str, tmp: str, mb: int) -> dict:
    base = _child_rss(["import"])
    out: dict = {"import_only_mb": round(base, 1)}
    for kind, suffix in (("zst", ".jsonl.zst"), ("parquet", ".parquet")):
        row = {}
        for scale in (1, 4):
            path = os.path.join(tmp, f"mem-{kind}-{scale}{suffix}")
            _one_file(kind, path, mb * scale)
            rss = _child_rss(["prepare", path, tokenizer, os.path.join(tmp, f"mem-out-{kind}")])
            row[f"input_{mb * scale}mb_peak_over_import_mb"] = round(rss - base, 1)
            os.remove(path)
        a, b = row.values()
        row["ratio_4x_input"] = round(b / a, 2) if a > 0 else None
        out[kind] = row
    return out


def bench_gcs(local_manifest: str, tmp: str, steps: int) -> dict:
    from conftest import GCS_TEST_BUCKET, _emulator_command, _wait_until_up, free_port

    port = free_port()
    found = _emulator_command(port, os.path.join(tmp, "gcs"))
    if found is None:
        return {"skipped": "no GCS emulator installed"}
    name, cmd = found
    host = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_until_up(proc, f"{host}/storage/v1/b")
        os.environ.update(STORAGE_EMULATOR_HOST=host, EPATH_USE_TF="false")
        from data_throughput import _step_tokens_per_s

        from runfolder.storage import url_to_fs
        from runtime.data.loader import TokenBatches
        from runtime.data.manifest import load_manifest

        uri = f"gs://{GCS_TEST_BUCKET}/bench/data"
        fs, path = url_to_fs(uri)
        fs.put(os.path.dirname(local_manifest) + "/", path, recursive=True)
        m = load_manifest(uri + "/manifest.json")
        seq_len, batch = 256, 32
        tb = TokenBatches(m, "train", seq_len, batch, order="shuffle", seed=0, prefetch=2)
        with tb.iterate() as it:
            for _ in range(3):  # connections, threads and the first permutation
                next(it)
            t0 = time.perf_counter()
            for _ in range(steps):
                next(it)
            s = time.perf_counter() - t0
        loader_tps = steps * batch * seq_len / s
        step_tps = _step_tokens_per_s("configs/smoke.toml", seq_len, batch)
        return {
            "emulator": name, "seq_len": seq_len, "batch": batch, "steps": steps,
            "loader_tokens_per_s": round(loader_tps), "step_tokens_per_s": round(step_tps),
            "loader_over_step": round(loader_tps / step_tps, 1), "goal": ">= 10",
        }  # fmt: skip
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def child(argv: list[str]) -> None:
    if argv[0] == "prepare":
        from runtime.data.prepare.build import prepare_dataset

        inp, tokenizer, out = argv[1:4]
        prepare_dataset([inp], tokenizer, out, workers=1, shard_tokens=1 << 20, progress=False)
    else:
        import runtime.data.prepare.build  # noqa: F401  - the same imports, no work
    print(json.dumps({"maxrss_mb": _peak_rss_mb()}))


def _peak_rss_mb() -> float:
    """This process's own peak RSS: VmHWM belongs to its address space, whereas ru_maxrss
    carries the parent's peak over fork and exec (a large parent would hide everything)."""
    try:
        with open("/proc/self/status") as f:
            kb = next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:"))
        return kb / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=16, help="input MB for the throughput runs")
    ap.add_argument("--memory-mb", type=int, default=24, help="S of the memory runs")
    ap.add_argument("--gcs-steps", type=int, default=30)
    ap.add_argument("--skip-gcs", action="store_true")
    args = ap.parse_args()
    from runtime.data.prepare.bpe import train_bpe

    with tempfile.TemporaryDirectory() as tmp:
        write_jsonl_files(os.path.join(tmp, "web"), args.mb)
        tokenizer = train_bpe(_documents(4 << 20, seed=12345), VOCAB,
                              os.path.join(tmp, "tokenizer.json"))  # fmt: skip
        report: dict = {"bench": "prepare_scale", "input_mb": args.mb, "bpe_vocab": VOCAB,
                        "cores": os.cpu_count()}  # fmt: skip
        report["prepare"] = bench_prepare(os.path.join(tmp, "web", "*.jsonl"), tokenizer, tmp)
        report["memory"] = bench_memory(tokenizer, tmp, args.memory_mb)
        if not args.skip_gcs:
            manifest = os.path.join(tmp, "w2", "manifest.json")
            report["gcs_loader"] = bench_gcs(manifest, tmp, args.gcs_steps)
        print(json.dumps(report, indent=2))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2:])
    else:
        main()
