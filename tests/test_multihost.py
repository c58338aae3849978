"""Multi-host training: several local processes form one JAX cluster over gloo (CPU collectives) and
run `runtime worker` exactly as a backend would start it."""

from __future__ import annotations

import json
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from multihost import HostResult, run_hosts, start_hosts

from runs import read_jsonl, run_cli, tiny_config, write_config

STEPS = 6
# What may differ between a 1-process and an N-process run of the same job: timings, the
# host count, and the output root (each layout writes under its own folder).
VARIES = {"time", "step_time", "tokens_per_s", "elapsed", "wall_time_s", "created", "updated",
          "seconds_since_start", "blocked_s", "waited_s", "tokens_per_s_median", "output_uri", "topology.process_count",
          "eta_s", "goodput", "lower_s", "compile_s", "compile_from_cache", "compile_wait_s",
          "restore_s", "verify_s", "restore_overlap_s", "at_step", "write_s"}  # fmt: skip


def _config(
    tmp: Path, prepared: str, name: str, mesh: dict, out: Path | None = None, **over
) -> Path:
    from jobspec.files.run_toml import merge

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
    # Two hosts, one device each: a host count the writer check needs, no more (every host past
    # the second is another process to start and compile for, and runs the same code).
    "p2-data": (2, 1, {"data": 2}),
    "p1x2-data": (1, 2, {"data": 2}),  # one process, the same mesh as p2-data: the writer baseline
    # Four hosts in one cluster: each sequence split over two of them (the context axis spans
    # hosts: both read the same rows and keep a half each), the rows and parameters over fsdp.
    "p4-fsdp-context": (4, 1, {"fsdp": 2, "context": 2}),
}


class Layouts:
    """The layouts' runs, each started the first time a test asks for it (a test of one layout
    does not pay for the others): one run id, one output root per layout, so the runs differ
    only in how they are laid out."""

    def __init__(self, tmp: Path, prepared: str) -> None:
        self.tmp, self.prepared = tmp, prepared
        self.started: set[str] = set()

    def __getitem__(self, name: str) -> Path:
        out = self.tmp / name
        if name not in self.started:
            self.started.add(name)  # once, even if it fails: a failed run is not run again
            procs, devices, mesh = LAYOUTS[name]
            _worker(_config(self.tmp, self.prepared, "eq", mesh, out=out), "eq", procs, devices)
        assert (out / "eq/summaries/final.json").is_file(), f"the {name} run did not finish"
        return out / "eq"


@pytest.fixture(scope="module")
def layouts(tmp_path_factory, prepared) -> Layouts:
    return Layouts(tmp_path_factory.mktemp("mh"), prepared)


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

    if path.suffix == ".jsonl":  # time-ledger snapshots and when writes end are timing too
        timing = ("ledger", "checkpoint_written")
        return [strip(r) for r in read_jsonl(path) if r.get("event") not in timing]
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
    two, one = layouts["p2-data"], layouts["p1x2-data"]
    for rel in HOST_GLOBAL:
        assert (two / rel).is_file() == (one / rel).is_file(), rel
        if (one / rel).is_file():
            _same(_normalised(two / rel), _normalised(one / rel), rel)
    source = (one / "config/source.toml").read_text().replace(str(one.parent), str(two.parent))
    assert (two / "config/source.toml").read_text() == source
    # Host-global files exist once: only hosts/<i>/ holds per-host copies, one per host.
    hosts = sorted(p.name for p in (two / "hosts").iterdir())
    assert hosts == ["0", "1"]
    names = [
        p.relative_to(two).as_posix() for p in two.rglob("*.json*") if "hosts/" not in p.as_posix()
    ]
    assert len(names) == len(set(names))
    for i in range(2):  # every host's output is kept in the run's storage, not only on the host
        log = (two / f"logs/attempt-0/host-{i}.log").read_text()
        assert f"host {i} of 2" in log and f"step: {STEPS} " in log
    diag = json.loads((two / "diagnostics/runtime.json").read_text())
    assert diag["boot"]["mode"] == "contract" and diag["process_count"] == 2
    assert diag["boot"]["writer_index"] == 0 and diag["global_device_count"] == 2
    assert diag["param_shardings"], "each parameter's sharding is recorded"
    sharded = json.loads((layouts["p2-fsdp-tensor"] / "diagnostics/runtime.json").read_text())
    assert any("fsdp" in spec and "tensor" in spec for spec in sharded["param_shardings"].values())


def test_non_writer_cannot_write_host_global_files(tmp_path):
    from runfolder.store import ArtifactStore, NotWriterError

    store = ArtifactStore(str(tmp_path / "run"), process_index=1, writer_index=0)
    with pytest.raises(NotWriterError):
        store.write_json("manifest.json", {"x": 1})
    store.write_host_json("runtime.json", {"x": 1})
    assert (tmp_path / "run/hosts/1/runtime.json").is_file()
    assert not (tmp_path / "run/manifest.json").exists()


def test_multihost_resume_is_exact_and_reshards(tmp_path, prepared, layouts):
    # The same job in one attempt is the data x fsdp layout's run (run ids do not enter the math).
    full = [r["loss"] for r in read_jsonl(layouts["p2-data-fsdp"] / "metrics/train.jsonl")]
    half = STEPS // 2
    split = _config(tmp_path, prepared, "split", LAYOUTS["p2-data-fsdp"][2])
    _worker(split, "split", 2, 2, "--max-steps", str(half))
    runs = tmp_path / "runs"
    shutil.copytree(runs / "split", runs / "moved")
    _worker(split, "split", 2, 2, attempt=1)  # a restarted attempt resumes on its own
    assert [r["loss"] for r in read_jsonl(runs / "split/metrics/train.jsonl")] == full

    # The same checkpoint on one process: refused without --reshard, exact to 1e-5 with it.
    one = _config(tmp_path, prepared, "moved", {})
    refused = run_cli("worker", str(one), env={"JAXJOB_RUN_ID": "moved"})
    assert refused.returncode == 2 and "--reshard" in refused.stderr, refused.stderr
    _worker(one, "moved", 1, 1, "--reshard")
    moved = [r["loss"] for r in read_jsonl(runs / "moved/metrics/train.jsonl")]
    assert len(moved) == STEPS
    assert moved[:half] == full[:half]
    assert moved[half:] == pytest.approx(full[half:], rel=1e-5)


def test_resume_onto_another_context_layout(tmp_path, prepared, layouts):
    # Half the steps with each sequence over 2 devices, the rest on 1 device with --reshard:
    # the losses of the one-device run (layout p1) to 1e-5.
    full = [r["loss"] for r in read_jsonl(layouts["p1"] / "metrics/train.jsonl")]
    half = STEPS // 2
    _worker(_config(tmp_path, prepared, "cp", {"context": 2}), "cp", 1, 2, "--max-steps", str(half))
    _worker(_config(tmp_path, prepared, "cp", {}), "cp", 1, 1, "--reshard")
    moved = [r["loss"] for r in read_jsonl(tmp_path / "runs/cp/metrics/train.jsonl")]
    assert moved == pytest.approx(full, rel=1e-5)


# A run that is still stepping when the test acts on it. Its schedule decays over STEPS as the
# layouts' runs do, so its program is the p2-data layout's and XLA's cache has it.
LONG = {
    "training": {"target_tokens": 16 * 8 * 10_000},
    "optimizer": {"schedule": {"decay_steps": STEPS}},
}


@dataclass(frozen=True)
class Faults:
    """One job, two attempts: SIGTERM to host 1 stops attempt 0 (both hosts, at one step);
    attempt 1 resumes from that stop's checkpoint and loses host 1 to SIGKILL."""

    run: Path
    stopped: list[HostResult]  # attempt 0's hosts
    stopped_output: str
    index_after_stop: dict  # checkpoints/index.json when attempt 0 had ended
    last_event_after_stop: str
    stop_step: int
    resumed: HostResult  # attempt 1's host 0, the survivor
    resumed_output: str
    gave_up_s: float  # from the kill until host 0 had exited


def _stop_step(results: list[HostResult]) -> int:
    stopped = {int(ln.split("stopped at step ")[1].split(",")[0]) for r in results
               for ln in r.stdout.splitlines() if "stopped at step" in ln}  # fmt: skip
    assert len(stopped) == 1, [r.stdout[-500:] for r in results]
    return stopped.pop()


@pytest.fixture(scope="module")
def faults(tmp_path_factory, prepared) -> Faults:
    """The fault tests' job: one pair of hosts per attempt, instead of a fresh job per test."""
    tmp = tmp_path_factory.mktemp("faults")
    cfg = _config(tmp, prepared, "term", {"data": 2}, checkpoint={"every": 2, "keep": 2},
                  runtime={"host_loss_timeout_s": 10}, **LONG)  # fmt: skip
    run = tmp / "runs/term"
    with start_hosts(["worker", str(cfg)], 2, 1, env={"JAXJOB_RUN_ID": "term"}) as hosts:
        hosts.wait_for_output(1, "step: 3 ", timeout=180)
        hosts.signal(1, signal.SIGTERM)
        stopped = hosts.wait(timeout=180)
        stopped_output = hosts.describe()
    step = _stop_step(stopped)
    index = json.loads((run / "checkpoints/index.json").read_text())
    last_event = read_jsonl(run / "events.jsonl")[-1]["event"]
    env = {"JAXJOB_RUN_ID": "term", "JAXJOB_ATTEMPT": "1"}
    with start_hosts(["worker", str(cfg)], 2, 1, env=env) as hosts:
        # Checkpoints every 2 steps: two fall between the resume and the kill.
        hosts.wait_for_output(0, f"step: {step + 5} ", timeout=180)
        hosts.kill(1)
        t0 = time.monotonic()
        (host0,) = hosts.wait(timeout=120, only=[0])
        gave_up_s = time.monotonic() - t0
        resumed_output = hosts.describe()
    return Faults(run, stopped, stopped_output, index, last_event, step, host0, resumed_output,
                  gave_up_s)  # fmt: skip


def test_sigterm_to_one_host_stops_all_at_one_step(faults: Faults):
    assert [r.returncode for r in faults.stopped] == [42, 42], faults.stopped_output
    step = faults.stop_step
    assert _stop_step(faults.stopped) == step  # both hosts stopped at that one step
    assert faults.index_after_stop["latest"] == step
    assert faults.last_event_after_stop == "interrupted"
    # The next attempt starts from that checkpoint and goes on with the very next step.
    assert f"from checkpoint {step}" in faults.resumed.stdout
    steps = [r["step"] for r in read_jsonl(faults.run / "metrics/train.jsonl")]
    assert steps[: step + 2] == list(range(1, step + 3)), steps


def test_sigkill_of_one_host_ends_the_others(faults: Faults):
    host0, took = faults.resumed, faults.gave_up_s
    assert host0.returncode not in (0, None), faults.resumed_output
    assert took < 10 + 30, f"host 0 needed {took:.0f} s to give up"
    assert "host 1" in host0.stderr, host0.stderr[-3000:]
    # The kill came after the resumed attempt's checkpoints at two steps were due: what the
    # index lists was committed, and it lists one of that attempt's.
    index_path = faults.run / "checkpoints/index.json"
    assert index_path.is_file(), "no checkpoint was committed before the kill"
    entries = json.loads(index_path.read_text())["checkpoints"]
    assert any(entry["step"] > faults.stop_step for entry in entries), entries
    for entry in entries:
        assert (faults.run / "checkpoints" / str(entry["step"])).is_dir()


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
