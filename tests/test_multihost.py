"""Multi-host training: several local processes form one JAX cluster over gloo (FACTS.md) and
run `runtime worker` exactly as a backend would start it."""

from __future__ import annotations

import json
import shutil
import signal
import time
from pathlib import Path

import pytest
from multihost import run_hosts, start_hosts

from runs import read_jsonl, run_cli, tiny_config, write_config

STEPS = 6
# What may differ between a 1-process and an N-process run of the same job: timings, the
# host count, and the output root (each layout writes under its own folder).
VARIES = {"time", "step_time", "tokens_per_s", "elapsed", "wall_time_s", "created", "updated",
          "seconds_since_start", "blocked_s", "waited_s", "tokens_per_s_median", "output_uri", "topology.process_count",
          "eta_s", "goodput"}  # fmt: skip


def _config(
    tmp: Path, prepared: str, name: str, mesh: dict, out: Path | None = None, **over
) -> Path:
    from jobspec.load import merge

    defaults = {"training": {"target_tokens": 16 * 8 * STEPS}, "mesh": mesh,
                "runtime": {"host_loss_timeout_s": 20, "boot_timeout_s": 60}}  # fmt: skip
    cfg = tiny_config(prepared, str(out or tmp / "runs"), run_id=name, **merge(defaults, over))
    return write_config(tmp / f"{name}.toml", cfg)


def _worker(cfg: Path, name: str, procs: int, devices: int, *args: str, attempt: int = 0):
    env = {"JAXJOB_RUN_ID": name, "JAXJOB_ATTEMPT": str(attempt)}
    if procs == 1:  # one host, no cluster: the worker runs without the distributed contract
        env.update({"JAXJOB_COORDINATOR": "", "JAXJOB_NUM_PROCESSES": "", "JAXJOB_PROCESS_ID": ""})
    results = run_hosts(["worker", str(cfg), *args], procs, devices, env=env, timeout=400)
    for r in results:
        assert r.returncode == 0, f"host {r.process_id} exited {r.returncode}\n{r.output[-4000:]}"
    return results


LAYOUTS = {  # name: (processes, devices per process, mesh)
    "p1": (1, 1, {}),
    "p2-fsdp-tensor": (2, 2, {"fsdp": 2, "tensor": 2}),
    "p2-data-fsdp": (2, 2, {"data": 2, "fsdp": 2}),
    "p4-data": (4, 1, {"data": 4}),
    "p1x4-data": (1, 4, {"data": 4}),  # one process, the same mesh as p4-data: the writer baseline
}


@pytest.fixture(scope="module")
def layouts(tmp_path_factory, prepared) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("mh")
    for name, (procs, devices, mesh) in LAYOUTS.items():
        # One run id, one output root per layout: the runs differ only in how they are laid out.
        _worker(_config(tmp, prepared, "eq", mesh, out=tmp / name), "eq", procs, devices)
    return {name: tmp / name / "eq" for name in LAYOUTS}


def test_same_losses_and_batches_on_every_layout(layouts):
    base = read_jsonl(layouts["p1"] / "metrics/train.jsonl")
    assert [r["step"] for r in base] == list(range(1, STEPS + 1))
    for name in LAYOUTS:
        rows = read_jsonl(layouts[name] / "metrics/train.jsonl")
        assert [r["batch_hash"] for r in rows] == [r["batch_hash"] for r in base], name
        assert [r["record_ids"] for r in rows] == [r["record_ids"] for r in base], name
        for a, b in zip(rows, base, strict=True):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (name, a["step"])
            assert a["token_count"] == b["token_count"]


def _normalised(path: Path):
    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in VARIES}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x

    if path.suffix == ".jsonl":  # time-ledger snapshots are timing, like the fields above
        return [strip(r) for r in read_jsonl(path) if r.get("event") != "ledger"]
    return strip(json.loads(path.read_text()))


def _same(a, b, where: str) -> None:
    """Equal, except that floats need only agree to 1e-5: gloo's cross-process all-reduce and
    one process's in-memory reduction add the same numbers in a different order, so losses
    differ in the last bits; every key, id, hash, count and string must be identical."""
    if isinstance(a, float) or isinstance(b, float):
        assert a == pytest.approx(b, rel=1e-5), where
    elif isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


HOST_GLOBAL = ["manifest.json", "config/resolved.json", "metrics/train.jsonl", "metrics/eval.jsonl",
               "events.jsonl", "summaries/final.json", "checkpoints/index.json"]  # fmt: skip


def test_one_writer_writes_what_one_process_writes(layouts):
    four, one = layouts["p4-data"], layouts["p1x4-data"]
    for rel in HOST_GLOBAL:
        assert (four / rel).is_file() == (one / rel).is_file(), rel
        if (one / rel).is_file():
            _same(_normalised(four / rel), _normalised(one / rel), rel)
    source = (one / "config/source.toml").read_text().replace(str(one.parent), str(four.parent))
    assert (four / "config/source.toml").read_text() == source
    # Host-global files exist once: only hosts/<i>/ holds per-host copies, one per host.
    hosts = sorted(p.name for p in (four / "hosts").iterdir())
    assert hosts == ["0", "1", "2", "3"]
    names = [
        p.relative_to(four).as_posix()
        for p in four.rglob("*.json*")
        if "hosts/" not in p.as_posix()
    ]
    assert len(names) == len(set(names))
    for i in range(4):  # every host's output is kept in the run's storage, not only on the host
        log = (four / f"logs/attempt-0/host-{i}.log").read_text()
        assert f"host {i} of 4" in log and f"step: {STEPS} " in log
    diag = json.loads((four / "diagnostics/runtime.json").read_text())
    assert diag["boot"]["mode"] == "contract" and diag["process_count"] == 4
    assert diag["boot"]["writer_index"] == 0 and diag["global_device_count"] == 4
    assert diag["param_shardings"], "each parameter's sharding is recorded"
    sharded = json.loads((layouts["p2-fsdp-tensor"] / "diagnostics/runtime.json").read_text())
    assert any("fsdp" in spec and "tensor" in spec for spec in sharded["param_shardings"].values())


def test_non_writer_cannot_write_host_global_files(tmp_path):
    from jobspec.run_store import ArtifactStore, NotWriterError

    store = ArtifactStore(str(tmp_path / "run"), process_index=1, writer_index=0)
    with pytest.raises(NotWriterError):
        store.write_json("manifest.json", {"x": 1})
    store.write_host_json("runtime.json", {"x": 1})
    assert (tmp_path / "run/hosts/1/runtime.json").is_file()
    assert not (tmp_path / "run/manifest.json").exists()


def test_multihost_resume_is_exact_and_reshards(tmp_path, prepared):
    mesh = {"data": 2, "fsdp": 2}
    whole = _config(tmp_path, prepared, "whole", mesh, training={"target_tokens": 16 * 8 * 8})
    _worker(whole, "whole", 2, 2)
    split = _config(tmp_path, prepared, "split", mesh, training={"target_tokens": 16 * 8 * 8})
    _worker(split, "split", 2, 2, "--max-steps", "4")
    runs = tmp_path / "runs"
    shutil.copytree(runs / "split", runs / "moved")
    _worker(split, "split", 2, 2, attempt=1)  # a restarted attempt resumes on its own
    full = [r["loss"] for r in read_jsonl(runs / "whole/metrics/train.jsonl")]
    assert [r["loss"] for r in read_jsonl(runs / "split/metrics/train.jsonl")] == full

    # The same checkpoint on one process: refused without --reshard, exact to 1e-5 with it.
    one = _config(tmp_path, prepared, "moved", {}, training={"target_tokens": 16 * 8 * 8})
    refused = run_cli("worker", str(one), env={"JAXJOB_RUN_ID": "moved"})
    assert refused.returncode == 2 and "--reshard" in refused.stderr, refused.stderr
    _worker(one, "moved", 1, 1, "--reshard")
    moved = [r["loss"] for r in read_jsonl(runs / "moved/metrics/train.jsonl")]
    assert len(moved) == 8
    assert moved[:4] == full[:4]
    assert moved[4:] == pytest.approx(full[4:], rel=1e-5)


def test_sigterm_to_one_host_stops_all_at_one_step(tmp_path, prepared):
    cfg = _config(
        tmp_path, prepared, "term", {"data": 2}, training={"target_tokens": 16 * 8 * 10_000}
    )
    env = {"JAXJOB_RUN_ID": "term"}
    with start_hosts(["worker", str(cfg)], 2, 1, env=env) as hosts:
        hosts.wait_for_output(1, "step: 3 ", timeout=180)
        hosts.signal(1, signal.SIGTERM)
        results = hosts.wait(timeout=180)
    assert [r.returncode for r in results] == [42, 42], hosts.describe()
    stopped = {int(ln.split("stopped at step ")[1].split(",")[0]) for r in results
               for ln in r.stdout.splitlines() if "stopped at step" in ln}  # fmt: skip
    assert len(stopped) == 1, [r.stdout[-500:] for r in results]
    step = stopped.pop()
    run = tmp_path / "runs/term"
    assert json.loads((run / "checkpoints/index.json").read_text())["latest"] == step
    assert read_jsonl(run / "events.jsonl")[-1]["event"] == "interrupted"
    again = _worker(cfg, "term", 2, 1, "--max-steps", "2", attempt=1)
    assert f"from checkpoint {step}" in again[0].stdout
    assert read_jsonl(run / "metrics/train.jsonl")[-1]["step"] == step + 2


def test_sigkill_of_one_host_ends_the_others(tmp_path, prepared):
    cfg = _config(tmp_path, prepared, "kill", {"data": 2}, training={"target_tokens": 16 * 8 * 10_000},
                  checkpoint={"every": 2, "keep": 2}, runtime={"host_loss_timeout_s": 10})  # fmt: skip
    with start_hosts(["worker", str(cfg)], 2, 1, env={"JAXJOB_RUN_ID": "kill"}) as hosts:
        hosts.wait_for_output(0, "step: 5 ", timeout=180)
        hosts.kill(1)
        t0 = time.monotonic()
        (host0,) = hosts.wait(timeout=120, only=[0])
        took = time.monotonic() - t0
    assert host0.returncode not in (0, None), hosts.describe()
    assert took < 10 + 30, f"host 0 needed {took:.0f} s to give up"
    assert "host 1" in host0.stderr, host0.stderr[-3000:]
    # Checkpoints every 2 steps and the kill comes after step 5 was logged, so steps 2 and 4
    # were due before it: at least one must be indexed, and whatever is indexed was committed.
    index_path = tmp_path / "runs/kill/checkpoints/index.json"
    assert index_path.is_file(), "no checkpoint was committed before the kill"
    entries = json.loads(index_path.read_text())["checkpoints"]
    assert entries, "the index lists no checkpoint"
    for entry in entries:
        assert (tmp_path / "runs/kill/checkpoints" / str(entry["step"])).is_dir()


def test_wrong_coordinator_fails_with_a_clear_error(tmp_path, prepared):
    from multihost import free_port

    cfg = _config(tmp_path, prepared, "boot", {}, runtime={"boot_timeout_s": 5})
    env = {"JAXJOB_RUN_ID": "boot", "JAXJOB_COORDINATOR": f"127.0.0.1:{free_port()}",
           "JAXJOB_NUM_PROCESSES": "2", "JAXJOB_PROCESS_ID": "1"}  # fmt: skip
    t0 = time.monotonic()
    res = run_cli("worker", str(cfg), env=env, timeout=120)
    assert time.monotonic() - t0 < 60
    assert res.returncode == 2, res.stderr
    assert "coordinator" in res.stderr and env["JAXJOB_COORDINATOR"] in res.stderr
    assert "Traceback" not in res.stderr
