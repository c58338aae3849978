"""Observability from the run's own records: TensorBoard and W&B sinks, a profile capture, goodput
over a SIGTERMed and resumed run, and the ETA.

One run, two attempts (module fixture): attempt 1 has both sinks on (W&B offline) and profiles
steps 3..4, and is SIGTERMed; attempt 2 resumes it for a few steps. The tests read what it wrote.
"""

from __future__ import annotations

import glob
import json
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobspec.exit_codes import EXIT_RESTARTABLE

from runs import ROOT, read_jsonl, run_cli, tiny_config, write_config

pytestmark = pytest.mark.slow

PROFILE_FIRST, PROFILE_STEPS = 3, 2
RESUMED_STEPS = 4


@pytest.fixture(scope="module")
def two_attempts(tmp_path_factory, prepared) -> dict:
    tmp = tmp_path_factory.mktemp("observe")
    cfg = tiny_config(
        prepared, str(tmp), run_id="obs",
        training={"target_tokens": 16 * 8 * 100000, "eval_every": 4},
        evals=[{"name": "val", "batches": 1}],
        metrics={"tensorboard": True, "wandb": {"project": "jaxjob-tests", "mode": "offline"}},
        profile={"start_step": PROFILE_FIRST, "steps": PROFILE_STEPS},
    )  # fmt: skip
    path = write_config(tmp / "obs.toml", cfg)
    run = tmp / "obs"
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "runtime", "local", str(path)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    metrics = run / "metrics/train.jsonl"
    deadline = time.monotonic() + 180
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 8):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "training did not start"
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out1, err1 = proc.communicate(timeout=180)
    first_exit = time.time()
    stopped = json.loads((run / "summaries/final.json").read_text())["steps"]
    events1 = read_jsonl(run / "events.jsonl")
    index = json.loads((run / "checkpoints/index.json").read_text())
    manifest1 = json.loads((run / "manifest.json").read_text())
    time.sleep(1.0)  # time between attempts: the restart's lost time must show it
    second_start = time.time()
    res = run_cli("local", str(path), "--resume", "--max-steps", str(RESUMED_STEPS))
    t1 = time.time()
    return {
        "run": run, "rc1": proc.returncode, "out1": out1, "err1": err1, "stopped": stopped,
        "events1": events1, "index1": index, "manifest1": manifest1, "res2": res,
        "t0": t0, "t1": t1, "gap": second_start - first_exit,
        "starts": (t0, second_start), "exits": (first_exit, t1),
    }  # fmt: skip


def test_sigterm_checkpoints_and_resume_continues(two_attempts):
    a = two_attempts
    assert a["rc1"] == EXIT_RESTARTABLE, a["err1"]
    assert "SIGTERM received" in a["out1"] and "Traceback" not in a["err1"]
    assert a["events1"][-1]["event"] == "interrupted" and a["events1"][-1]["signal"] == "SIGTERM"
    assert a["events1"][-2]["event"] == "ledger"  # the attempt's time, recorded just before
    assert a["index1"]["latest"] == a["stopped"] > PROFILE_FIRST + PROFILE_STEPS
    assert a["manifest1"]["status"] == "interrupted"
    res = a["res2"]
    assert res.returncode == 0, res.stderr
    assert f"from checkpoint {a['stopped']}" in res.stdout
    rows = read_jsonl(a["run"] / "metrics/train.jsonl")
    assert [r["step"] for r in rows] == list(range(1, a["stopped"] + RESUMED_STEPS + 1))
    # The live line gains an ETA (steps left x the interval's step time).
    assert " | eta: " in a["out1"]
    timed = [r for r in rows if "step_time" in r]
    total = json.loads((a["run"] / "manifest.json").read_text())["total_steps"]
    assert all(r["eta_s"] == pytest.approx((total - r["step"]) * r["step_time"]) for r in timed)


def _scalars(folder: Path) -> dict[str, dict[int, float]]:
    """Every scalar in the event files under `folder`, read by TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_tensorboard_scalars_equal_the_json_records(two_attempts):
    run = two_attempts["run"]
    assert len(list((run / "tensorboard").glob("events.out.tfevents.*"))) == 2  # one per attempt
    tb = _scalars(run / "tensorboard")
    rows = read_jsonl(run / "metrics/train.jsonl")
    for field in ("loss", "lr", "grad_norm", "tokens_per_s"):
        want = {r["step"]: r[field] for r in rows if field in r}
        got = tb[f"train/{field}"]
        assert got.keys() == want.keys(), field
        assert all(got[s] == pytest.approx(v, rel=1e-6) for s, v in want.items()), field
    evals = read_jsonl(run / "metrics/eval.jsonl")
    assert evals and tb["eval/val/loss"] == pytest.approx({e["step"]: e["loss"] for e in evals})


def _wandb_records(path: str) -> list:
    """The records of a W&B run file (a LevelDB-style log: 7-byte header, 32 KiB blocks of
    checksummed chunks), parsed with W&B's own protobuf classes."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    out, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        pending += chunk
        if kind in (1, 4):  # a full record, or the last chunk of one
            rec = pb.Record()
            rec.ParseFromString(pending)
            out.append(rec)
            pending = b""
    return out


def test_wandb_offline_run_holds_the_scalars(two_attempts):
    run = two_attempts["run"]
    files = sorted(glob.glob(str(run / "wandb/offline-run-*/run-obs.wandb")))
    assert len(files) == 2, files  # offline runs cannot resume: one per attempt
    logged: dict[int, float] = {}
    config_seen = False
    for f in files:
        for rec in _wandb_records(f):
            kind = rec.WhichOneof("record_type")
            if kind == "history":
                # W&B stores a key with "/" as its parts (nested_key).
                item = {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json)
                    for i in rec.history.item
                }
                if "train/loss" in item:
                    logged[int(item["step"])] = item["train/loss"]
            elif kind in ("run", "config"):  # the run record carries the initial config
                config = rec.run.config if kind == "run" else rec.config
                config_seen |= any(u.key == "model" for u in config.update)
    rows = read_jsonl(run / "metrics/train.jsonl")
    assert logged == pytest.approx({r["step"]: r["loss"] for r in rows})
    assert config_seen  # the resolved config went with it


def test_profile_trace_parses_and_is_kept_out_of_throughput(two_attempts):
    import jax

    run = two_attempts["run"]
    (ev,) = [e for e in two_attempts["events1"] if e["event"] == "profile"]
    assert (ev["start_step"], ev["last_step"]) == (PROFILE_FIRST, PROFILE_FIRST + PROFILE_STEPS - 1)
    (xplane,) = glob.glob(str(run / "profile/host-0/plugins/profile/*/*.xplane.pb"))
    planes = [p.name for p in jax.profiler.ProfileData.from_file(xplane).planes]
    assert "/host:CPU" in planes
    rows = {r["step"]: r for r in read_jsonl(run / "metrics/train.jsonl")}
    traced = range(PROFILE_FIRST, PROFILE_FIRST + PROFILE_STEPS)
    assert all("tokens_per_s" not in rows[s] for s in traced)
    # The step after the window is timed from the trace's end: over one step, not three.
    after = rows[PROFILE_FIRST + PROFILE_STEPS]
    assert "tokens_per_s" in after and rows[PROFILE_FIRST - 1].get("step_time") is not None


def test_goodput_accounts_for_all_wall_time(two_attempts):
    from runtime.run.inspect import inspect_run, render

    a = two_attempts
    final = json.loads((a["run"] / "summaries/final.json").read_text())
    g = final["goodput"]
    assert len(g["attempts"]) == 2
    assert sum(g["seconds"].values()) == pytest.approx(g["wall_s"])
    # Every second from the first process start to the last record is in a bucket...
    ledgers = {e["process_start"]: e for e in read_jsonl(a["run"] / "events.jsonl")
               if e["event"] == "ledger"}  # fmt: skip
    (start1, last1), (start2, last2) = sorted(
        (start, e["recorded_at"]) for start, e in ledgers.items()
    )
    assert g["wall_s"] == pytest.approx(last2 - start1, abs=0.01)  # recorded to the ms
    # ... each process start is when the test started it (/proc's boot time is whole seconds;
    # the fork may come a little late on a loaded machine, but not after jax's import, seconds
    # later), and each attempt's last record is at its end: only the closing of the sinks and
    # the interpreter's teardown follow (slow on a loaded machine, so the bound is generous).
    for start, last, began, ended in zip((start1, start2), (last1, last2), a["starts"],
                                         a["exits"], strict=True):  # fmt: skip
        assert began - 1.0 <= start <= began + 2.0
        assert 0 <= ended - last < 30.0
    s = g["seconds"]
    assert s["lost"] >= a["gap"]  # the restart's lost time is shown
    assert s["productive"] > 0 and s["compile"] > 0 and s["startup"] > 0 and s["eval"] > 0
    assert s["restore"] > 0 and s["profile"] > 0 and s["checkpoint"] > 0
    assert 0 < g["goodput"] < 1
    report = inspect_run(str(a["run"]))
    assert report["goodput"] == g
    assert "goodput      " in render(report) and "2 attempts" in render(report)


def test_launch_status_progress_has_goodput_and_eta(two_attempts, tmp_path):
    from runfolder.view import eta_seconds, read_progress

    p = read_progress(str(two_attempts["run"]))
    assert p["goodput"]["wall_s"] > 0 and p["eta_s"] is None  # stopped: no ETA
    rows = [{"step": 10, "step_time": 0.5}, {"step": 11}, {"step": 12, "step_time": 0.7}]
    assert eta_seconds(rows, 100) == pytest.approx(88 * 0.7)
    assert eta_seconds([{"step": 3}], 100) is None


def _rows(n: int) -> list[dict]:
    return [{"step": s, "tokens": 128 * s, "loss": 5.0 - 0.1 * s, "lr": 1e-3, "batch_hash": "x"}
            for s in range(1, n + 1)]  # fmt: skip


def test_a_failing_sink_is_one_warning_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    """W&B online with no key, and TensorBoard on a disk that fails mid-run: one warning each,
    no exception into the training loop, and the other sink keeps logging."""
    from jobspec.run_config import MetricsConfig
    from runfolder.store import ArtifactStore
    from runtime.observe.sinks import MetricSinks, sink_check

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc: no key anywhere
    cfg = MetricsConfig(tensorboard=True, wandb={"project": "p", "mode": "online"})
    with pytest.raises(RuntimeError, match="no API key"):
        sink_check(cfg)
    store = ArtifactStore(str(tmp_path / "run"))
    sinks = MetricSinks.open(cfg, store, run_id="r", start_step=0, config={})
    tb = sinks.sinks[0]
    sinks.train_rows(_rows(3))
    calls = []

    def full_disk(*a, **k):
        calls.append(a)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tb.writer, "add_scalar", full_disk)
    sinks.train_rows(_rows(6)[3:])
    sinks.eval_row({"step": 6, "name": "val", "loss": 4.0})
    sinks.close()
    err = capsys.readouterr().err.splitlines()
    warnings = [ln for ln in err if ln.startswith("warning: ")]
    assert len(calls) == 1 and len(warnings) == 2, err
    assert any("W&B sink is off" in w and "no W&B API key" in w for w in warnings)
    assert any("TensorBoard sink is off" in w and "No space left" in w for w in warnings)
    assert _scalars(tmp_path / "run/tensorboard")["train/loss"].keys() == {1, 2, 3}


def test_sinks_live_on_the_writer_only(tmp_path):
    from jobspec.run_config import MetricsConfig
    from runfolder.store import ArtifactStore
    from runtime.observe.sinks import MetricSinks, scalars

    store = ArtifactStore(str(tmp_path / "run"), process_index=1, writer_index=0)
    sinks = MetricSinks.open(MetricsConfig(tensorboard=True), store, run_id="r", start_step=0,
                             config={})  # fmt: skip
    assert sinks.sinks == [] and not (tmp_path / "run/tensorboard").exists()
    assert scalars({"step": 3, "loss": 2.5, "flag": True, "record_ids": [1]}, "train") == {
        "train/loss": 2.5
    }


def test_profile_steps_option(tmp_path, prepared, capsys):
    from runtime.commands.cli import main
    from runtime.commands.run import _profile_sets

    assert _profile_sets("10:3") == ("profile.start_step=10", "profile.steps=3")
    assert _profile_sets("7") == ("profile.start_step=7", "profile.steps=2")
    cfg = write_config(tmp_path / "c.toml", tiny_config(prepared, str(tmp_path)))
    for spec, says in (("x:2", "use START:COUNT"), ("1:2", "profile.start_step"),
                       ("500:2", "past the run's last step")):  # fmt: skip
        with pytest.raises(SystemExit) as exit:
            main(["local", str(cfg), "--profile-steps", spec])
        err = capsys.readouterr().err
        assert exit.value.code == 2 and says in err and "Traceback" not in err, err


def test_tensorboard_sink_on_gs_and_a_resumed_attempt_purges(run_uri, tmp_path):
    """Through the run's store, locally and on gs:// (the emulator): two attempts, the second
    resuming from step 3 after the first logged to step 5; TensorBoard's reader then shows the
    second attempt's rows from step 4 on, as train.jsonl has them."""
    from jobspec.run_config import MetricsConfig
    from runfolder.storage import url_to_fs
    from runfolder.store import ArtifactStore
    from runtime.observe.sinks import MetricSinks

    store = ArtifactStore(run_uri)
    cfg = MetricsConfig(tensorboard=True)
    first = MetricSinks.open(cfg, store, run_id="r", start_step=0, config={})
    first.train_rows(_rows(5))
    first.close()
    second = MetricSinks.open(cfg, store, run_id="r", start_step=3, config={})
    again = [{**r, "loss": r["loss"] - 1.0} for r in _rows(6)[3:]]
    second.train_rows(again)
    second.close()
    fs, root = url_to_fs(run_uri)
    local = tmp_path / "tb"
    local.mkdir()
    names = fs.ls(f"{root}/tensorboard", detail=False)
    assert len(names) == 2
    for name in names:
        (local / name.rsplit("/", 1)[-1]).write_bytes(fs.cat_file(name))
    want = {r["step"]: r["loss"] for r in _rows(3) + again}
    assert _scalars(local)["train/loss"] == pytest.approx(want)


def test_goodput_accounting_of_synthetic_attempts():
    """A crashed attempt (its last snapshot at t=60, then nothing) and a restart at t=100 that
    recomputes the steps the crash lost: the 40 s gap is lost, the buckets sum to the span."""
    from runfolder.goodput import account, goodput_line
    from runtime.observe.ledger import TimeLedger

    def snap(start, at, seconds, pid):
        return {"event": "ledger", "process_start": start, "recorded_at": at, "pid": pid,
                "seconds": seconds, "first_step": 1, "last_step": 9}  # fmt: skip

    events = [
        {"event": "start", "step": 0},
        snap(0.0, 30.0, {"startup": 10, "compile": 5, "productive": 15}, 1),
        snap(0.0, 60.0, {"startup": 10, "compile": 5, "productive": 40, "checkpoint": 5}, 1),
        snap(
            100.0,
            150.0,
            {"startup": 10, "restore": 2, "compile": 5, "recomputed": 8, "productive": 25},
            2,
        ),  # fmt: skip
    ]
    g = account(events)
    assert g["wall_s"] == pytest.approx(150.0) == sum(g["seconds"].values())
    assert g["seconds"]["lost"] == pytest.approx(40.0)
    assert g["seconds"]["recomputed"] == 8 and g["productive_s"] == 65
    assert g["goodput"] == pytest.approx(65 / 150)
    assert [a["wall_s"] for a in g["attempts"]] == [60.0, 50.0]
    assert goodput_line(g).startswith("43.3% of 2m30s trained (2 attempts); lost 40.0s, ")
    assert account([{"event": "start"}]) is None

    ledger = TimeLedger()
    ledger.redo_until = 5
    assert ledger.step_bucket(4, first_of_attempt=True) == "compile"
    assert ledger.step_bucket(5, first_of_attempt=False) == "recomputed"
    assert ledger.step_bucket(6, first_of_attempt=False) == "productive"
    snap_now = ledger.snapshot()
    assert sum(snap_now["seconds"].values()) == pytest.approx(
        snap_now["recorded_at"] - snap_now["process_start"], abs=1e-3
    )
