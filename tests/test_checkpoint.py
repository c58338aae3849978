"""The checkpoint service: Orbax round-trips, the committed-only index, retention and resolve."""

from __future__ import annotations

import os
import posixpath
import shutil
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jobspec.errors import CheckpointError
from runfolder.layout import CHECKPOINT_INDEX as INDEX
from runfolder.storage import DEFAULT_RETRY, RetryPolicy
from runfolder.store import ArtifactStore
from runtime.run.checkpoint.errors import UnreadableCheckpointError, short_cause
from runtime.run.checkpoint.gcs_setup import bound_tensorstore_retries, tensorstore_retries
from runtime.run.checkpoint.index import load_index
from runtime.run.checkpoint.service import CheckpointService
from runtime.run.meta import CheckpointMeta

FINGERPRINT = {"model.hidden_size": 8, "data.manifest": "abc"}


def make_state(scale: float = 1.0):
    mesh = Mesh(np.array(jax.devices()[:1]), ("fsdp",))
    sharded = NamedSharding(mesh, PartitionSpec("fsdp"))
    params = {
        "embed": jax.device_put(jnp.arange(32, dtype=jnp.float32).reshape(4, 8) * scale, sharded),
        "norm": jnp.ones((8,), jnp.bfloat16) * scale,
    }
    return params, optax.adamw(1e-3).init(params)


def abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def meta(step: int) -> CheckpointMeta:
    return CheckpointMeta(step=step, tokens=step * 64, rng=[0, step], decay_steps=10, config={},
                          fingerprint=FINGERPRINT)  # fmt: skip


def save(svc: CheckpointService, step: int, val_loss: float | None = None, **kw) -> bool:
    params, opt_state = make_state(float(step))
    metrics = None if val_loss is None else {"val_loss": val_loss}
    return svc.save(
        step, params=params, opt_state=opt_state, meta=meta(step), metrics=metrics, **kw
    )


@pytest.fixture(params=["local", pytest.param("gs", marks=pytest.mark.gcs)])
def ckpt_uri(request: pytest.FixtureRequest, tmp_path) -> str:
    """The same test once on a local directory and once on gs:// (the emulator)."""
    if request.param == "local":
        return str(tmp_path / "run")
    return request.getfixturevalue("orbax_gs_run_uri")


def disk_steps(store: ArtifactStore) -> list[int]:
    return sorted(int(n) for n in store.listdir("checkpoints") if n.isdigit())


def test_save_and_restore_round_trip(ckpt_uri: str) -> None:
    store = ArtifactStore(ckpt_uri)
    svc = CheckpointService(store, keep=3, async_save=True)
    assert save(svc, 5) and save(svc, 10)
    svc.wait()
    assert svc.steps() == [5, 10]

    params, opt_state = make_state(10.0)
    got_params, got_opt, got_meta = svc.restore(
        10, params_target=abstract(params), opt_state_target=abstract(opt_state)
    )
    assert got_meta == meta(10)
    assert jax.tree.structure(got_opt) == jax.tree.structure(opt_state)
    for want, got in zip(
        jax.tree.leaves((params, opt_state)), jax.tree.leaves((got_params, got_opt)), strict=True
    ):
        assert got.dtype == want.dtype and got.sharding == want.sharding
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

    # The index on disk says the same, and is readable without Orbax.
    index = load_index(ArtifactStore(ckpt_uri))
    assert [e["step"] for e in index["checkpoints"]] == [5, 10]
    assert index["latest"] == 10 and index["checkpoints"][1]["fingerprint"] == FINGERPRINT
    assert svc.fingerprint(5) == FINGERPRINT
    svc.close()


def test_params_only_restore_never_reads_optimizer_state(tmp_path) -> None:
    store = ArtifactStore(str(tmp_path / "run"))
    svc = CheckpointService(store, keep=2, async_save=True)
    save(svc, 3)
    svc.wait()
    shutil.rmtree(tmp_path / "run/checkpoints/3/opt_state")  # would fail any read of it
    params, _ = make_state(3.0)
    got_params, got_opt, got_meta = svc.restore(3, params_target=abstract(params))
    assert got_opt is None and got_meta.step == 3
    np.testing.assert_array_equal(np.asarray(got_params["embed"]), np.asarray(params["embed"]))
    svc.close()


def test_async_step_enters_the_index_only_once_committed(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = ArtifactStore(str(tmp_path / "run"))
    svc = CheckpointService(store, keep=2, async_save=True)
    save(svc, 1)
    svc.wait()
    # Orbax still writing step 2: it is pending, not listed, not latest.
    monkeypatch.setattr(svc._mgr, "is_saving_in_progress", lambda: True)
    save(svc, 2)
    assert svc.poll() is None
    assert svc.read_index()["latest"] == 1 and load_index(store)["latest"] == 1
    monkeypatch.undo()
    svc._mgr.wait_until_finished()
    # Committed: the writer's checksums are computed off the training thread, and the step is
    # indexed by the first poll after they are written.
    from runtime.run import checksums

    release = threading.Event()
    real_record = checksums.record

    def slow_record(*args):
        release.wait(600)
        return real_record(*args)

    monkeypatch.setattr(checksums, "record", slow_record)
    assert svc.poll() is None  # checksums under way: the poll returns at once
    assert load_index(store)["latest"] == 1
    release.set()
    assert svc.poll(block=True) == 2
    assert load_index(store)["latest"] == 2
    assert store.exists(f"checkpoints/2/{checksums.FILE}")
    svc.close()


def test_a_save_says_how_long_it_waited_for_the_one_before(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`waited_s`: the part of a save spent finishing the previous one (its write, checksums,
    retention), which the loop reports beside the whole pause."""
    import types

    from runtime.run import checksums
    from runtime.run.checkpoint import service as checkpoint_module

    clock = [0.0]
    monkeypatch.setattr(
        checkpoint_module, "time", types.SimpleNamespace(perf_counter=lambda: clock[0])
    )
    real_record = checksums.record

    def record_taking_7_s(*args):
        clock[0] += 7.0
        return real_record(*args)

    monkeypatch.setattr(checksums, "record", record_taking_7_s)
    svc = CheckpointService(ArtifactStore(str(tmp_path / "run")), keep=3, async_save=True)
    with monkeypatch.context() as m:  # step 1 still writing when its save returns
        m.setattr(svc._mgr, "is_saving_in_progress", lambda: True)
        save(svc, 1)
    assert svc.waited_s == 0.0  # nothing before it
    save(svc, 2)  # finishes step 1 first: its checksums take 7 s of the clock
    assert svc.waited_s == 7.0
    svc.close()


def test_save_that_did_not_commit_fails_loudly_and_is_not_indexed(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = ArtifactStore(str(tmp_path / "run"))
    svc = CheckpointService(store, keep=2, async_save=False)
    save(svc, 1)
    monkeypatch.setattr(svc, "_committed", lambda step: False)  # Orbax finished, nothing committed
    with pytest.raises(CheckpointError, match="checkpoint 2 .* did not commit"):
        save(svc, 2)
    assert svc.steps() == [1] and load_index(store)["latest"] == 1


def test_background_save_failure_is_a_checkpoint_error(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = ArtifactStore(str(tmp_path / "run"))
    svc = CheckpointService(store, keep=2, async_save=True)
    save(svc, 1)

    def failed() -> None:
        raise ValueError("Error writing manifest.ocdbt")

    monkeypatch.setattr(svc._mgr, "wait_until_finished", failed)  # as Orbax re-raises it
    with pytest.raises(CheckpointError, match="checkpoint 1 .* failed to save .*manifest.ocdbt"):
        svc.wait()
    assert svc.steps() == []


def test_latest_best_and_retention(ckpt_uri: str) -> None:
    store = ArtifactStore(ckpt_uri)
    svc = CheckpointService(store, keep=2, async_save=True)
    for step, loss in [(10, 3.0), (20, 1.0), (30, 2.0), (40, 2.5), (50, None)]:
        assert save(svc, step, loss)
    svc.wait()
    # The two most recent plus the best; index and disk agree.
    assert svc.steps() == [20, 40, 50] == disk_steps(store)
    index = load_index(store)
    assert index["latest"] == 50 and index["best"] == 20
    assert index["checkpoints"][0]["metrics"] == {"val_loss": 1.0}
    assert svc.resolve("latest") == 50 and svc.resolve("best") == 20
    assert svc.resolve("40") == 40 and svc.resolve(40) == 40
    svc.close()


def test_resolve_errors(tmp_path) -> None:
    store = ArtifactStore(str(tmp_path / "run"))
    svc = CheckpointService(store, keep=2, async_save=False)
    with pytest.raises(
        CheckpointError, match=r"no checkpoint under .*; run without --resume first"
    ):
        svc.resolve("latest")
    save(svc, 4)
    save(svc, 8)
    with pytest.raises(
        CheckpointError, match="step 6 is not a committed checkpoint .*available steps: 4, 8"
    ):
        svc.resolve("6")
    assert svc.resolve("best") == 8  # no checkpoint records val_loss: best is latest
    with pytest.raises(CheckpointError, match="not 'latest', 'best' or a step number"):
        svc.resolve("newest")
    with pytest.raises(CheckpointError, match="step 6 is not a committed checkpoint"):
        svc.restore(6, params_target=abstract(make_state()[0]))


def test_repeated_and_backward_saves(tmp_path) -> None:
    store = ArtifactStore(str(tmp_path / "run"))
    svc = CheckpointService(store, keep=3, async_save=True)
    assert save(svc, 5) and save(svc, 10)
    assert not save(svc, 10)  # a final save right after the periodic one is a no-op
    assert save(svc, 10, force=True)  # force replaces it
    with pytest.raises(CheckpointError, match="checkpoint 10 is newer"):
        save(svc, 7)
    # A run resumed from step 5 branches off there.
    assert svc.discard_after(5) == [10]
    assert save(svc, 7)
    svc.wait()
    assert svc.steps() == [5, 7] == disk_steps(store)
    svc.close()


def test_local_crash_mid_save_never_becomes_latest(tmp_path) -> None:
    root = tmp_path / "run"
    store = ArtifactStore(str(root))
    svc = CheckpointService(store, keep=3, async_save=True)
    save(svc, 1)
    save(svc, 2)
    svc.close()
    # A crash while writing step 3: Orbax's temporary directory, never renamed.
    shutil.copytree(root / "checkpoints/2", root / "checkpoints/3.orbax-checkpoint-tmp")
    # And a crash after step 2 committed but before the index was rewritten.
    store.write_json(INDEX, {"checkpoints": load_index(store)["checkpoints"][:1], "latest": 1})

    svc = CheckpointService(ArtifactStore(str(root)), keep=3, async_save=True)
    assert svc.steps() == [1, 2] and svc.resolve("latest") == 2  # 2 re-indexed from disk
    assert load_index(store)["latest"] == 2
    assert save(svc, 3)  # the leftover is cleaned up and the step saved for real
    svc.wait()
    assert sorted(os.listdir(root / "checkpoints")) == ["1", "2", "3", "index.json"]
    svc.close()


@pytest.mark.gcs
def test_gs_step_without_commit_file_never_becomes_latest(orbax_gs_run_uri: str) -> None:
    store = ArtifactStore(orbax_gs_run_uri)
    svc = CheckpointService(store, keep=3, async_save=True)
    save(svc, 1)
    save(svc, 2)
    svc.close()
    # On gs:// a step is written in place; without commit_success.txt it is a crashed save.
    store.fs.rm_file(store._path("checkpoints/2/commit_success.txt"))
    # An index entry whose step vanished is dropped too.
    doc = load_index(store)
    doc["checkpoints"].append({**doc["checkpoints"][0], "step": 9})
    store.write_json(INDEX, {**doc, "latest": 9})

    svc = CheckpointService(ArtifactStore(orbax_gs_run_uri), keep=3, async_save=True)
    assert svc.steps() == [1] and svc.resolve("latest") == 1
    assert load_index(store)["latest"] == 1
    assert save(svc, 2)  # the crashed step's objects are cleared and it is saved again
    svc.wait()
    assert store.exists("checkpoints/2/commit_success.txt") and svc.resolve("latest") == 2
    svc.close()


def test_a_service_that_may_write_rebuilds_a_damaged_index(tmp_path, capsys) -> None:
    """As `checkpoints rollback` opens a run (a resume: tests/faults/test_damaged_index.py)."""
    root = tmp_path / "run"
    store = ArtifactStore(str(root))
    svc = CheckpointService(store, keep=3, async_save=False)
    save(svc, 1, val_loss=2.0)
    save(svc, 2, val_loss=3.0)
    svc.close()
    (root / INDEX).write_bytes(b'{"checkpoints": [{"st')
    capsys.readouterr()

    svc = CheckpointService(ArtifactStore(str(root)), keep=3, async_save=False)
    assert svc.steps() == [1, 2] and svc.best() == 1  # the loss each step was saved with
    assert load_index(store) == svc.read_index()  # rebuilt on disk
    (kept,) = (root / "checkpoints").glob("index.json.corrupt-*")
    assert kept.read_bytes() == b'{"checkpoints": [{"st'
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith(
        f"warning: {root}/{INDEX} was damaged (not valid JSON: "
    ), err
    svc.close()


def test_read_only_service_leaves_a_live_save_alone(tmp_path) -> None:
    root = tmp_path / "run"
    svc = CheckpointService(ArtifactStore(str(root)), keep=2, async_save=False)
    save(svc, 1)
    svc.close()
    live = root / "checkpoints/2.orbax-checkpoint-tmp"
    shutil.copytree(root / "checkpoints/1", live)  # another process is writing step 2

    reader = CheckpointService(ArtifactStore(str(root)), keep=2, read_only=True)
    params, _ = make_state(1.0)
    assert reader.restore(reader.resolve("latest"), params_target=abstract(params))[2].step == 1
    with pytest.raises(RuntimeError, match="read-only"):
        save(reader, 3)
    reader.close()
    assert live.exists()


def test_the_loop_saves_at_the_cadence_steps(tmp_path) -> None:
    from runtime.train.cadence import checkpoint_due

    svc = CheckpointService(ArtifactStore(str(tmp_path / "run")), keep=5, async_save=False)
    params, opt_state = make_state()
    due: list[int] = []
    for step in range(1, 10):
        if checkpoint_due(step, every=3, last_step=9):  # as the train loop asks, then saves
            due.append(step)
            assert svc.save(step, params=params, opt_state=opt_state, meta=meta(step))
    # Every third step before the last; the last step's save is the caller's final one.
    assert svc.steps() == [3, 6] and due == [3, 6]
    assert svc.save(9, params=params, opt_state=opt_state, meta=meta(9))
    assert svc.steps() == [3, 6, 9]
    svc.close()


def _corrupt(store: ArtifactStore, step: int, kind: str, *, checksums: bool = False) -> None:
    """Damage one committed step as a torn copy or a failing disk leaves it (local or gs://).
    Unless `checksums`, the step's record goes too (as saved before checksums were recorded):
    then reading it is what finds the damage."""
    base = store._path(f"checkpoints/{step}")
    if not checksums:
        store.fs.rm_file(f"{base}/checksums.json")
    files = [str(f) for f in store.fs.find(base)]
    if kind == "truncated params":
        for f in files:
            if "/params/" in f and posixpath.basename(posixpath.dirname(f)) == "d":
                store.fs.pipe_file(f, store.fs.cat_file(f)[:7])
    elif kind == "zeroed opt_state":
        for f in files:
            if "/opt_state/" in f:
                store.fs.pipe_file(f, b"\0" * len(store.fs.cat_file(f)))
    elif kind == "garbled meta":
        store.fs.pipe_file(f"{base}/meta/metadata", b"{garbled")
    else:  # deleted _METADATA: Orbax restores with a target without it; verify calls it damaged
        store.fs.rm_file(f"{base}/params/_METADATA")


CORRUPTIONS = ["truncated params", "zeroed opt_state", "garbled meta", "deleted _METADATA"]


def test_corrupt_steps_are_one_sentence_and_verify_finds_each(ckpt_uri: str) -> None:
    store = ArtifactStore(ckpt_uri)
    svc = CheckpointService(store, keep=6, async_save=False)
    for step in range(1, 6):
        save(svc, step)
    svc.close()
    for step, kind in zip(range(2, 6), CORRUPTIONS, strict=True):
        _corrupt(store, step, kind)

    svc = CheckpointService(ArtifactStore(ckpt_uri), keep=6, read_only=True)
    found = {r["step"]: r for r in map(svc.verify, svc.steps())}
    assert [found[s]["ok"] for s in range(1, 6)] == [True, False, False, False, False]
    assert found[2]["cause"].startswith("params: ")
    assert found[3]["cause"].startswith("opt_state: ")
    assert found[4]["cause"].startswith("meta: garbled JSON")
    assert found[5]["cause"].startswith("params: ") and "_METADATA" in found[5]["cause"]
    assert all(r["bytes"] and r["bytes"] > 0 for r in found.values())

    params, opt_state = make_state()
    targets = {"params_target": abstract(params), "opt_state_target": abstract(opt_state)}
    for step in (2, 3, 4):
        with pytest.raises(UnreadableCheckpointError) as err:
            svc.restore(step, **targets)
        msg = str(err.value)
        assert "\n" not in msg and len(msg) < 600 and "tensorstore_spec" not in msg
        assert msg.startswith(f"checkpoint {step} under {svc.directory} cannot be read (")
        assert f"`runtime local --resume --from-step {step - 1}` (available: 1, 2, 3, 4, 5)" in msg
        assert err.value.step == step
    with pytest.raises(UnreadableCheckpointError, match=r"--checkpoint 3 \(available"):
        svc.restore(4, params_target=abstract(params), fallback="select")
    svc.restore(1, **targets)  # the good one still reads
    svc.close()


def test_checksums_find_changed_bytes_and_resume_falls_back(ckpt_uri: str, capsys) -> None:
    store = ArtifactStore(ckpt_uri)
    svc = CheckpointService(store, keep=3, async_save=False)
    for step in (1, 2):
        save(svc, step)
    svc.close()
    record = store.read_json("checkpoints/2/checksums.json")
    assert any(name.startswith("params/") for name in record["files"])
    _corrupt(store, 2, "zeroed opt_state", checksums=True)  # same sizes, other bytes

    svc = CheckpointService(ArtifactStore(ckpt_uri), keep=3)
    found = svc.verify(2)
    assert (found["ok"], found["state"]) == (False, "damaged")
    assert found["cause"].startswith("opt_state/") and "bytes changed" in found["cause"]
    assert svc.verify(1)["state"] == "ok" and svc.verify(1)["verified"]
    params, opt_state = make_state()
    svc.restore(2, params_target=abstract(params))  # its parameters are intact: read
    with pytest.raises(UnreadableCheckpointError, match=r"cannot be read \(opt_state/"):
        svc.restore(2, params_target=abstract(params), opt_state_target=abstract(opt_state))

    capsys.readouterr()
    assert svc.resume_step() == 1 and svc.steps() == [1] and disk_steps(store) == [1]
    warned = capsys.readouterr().err.strip().splitlines()
    assert len(warned) == 1 and warned[0].startswith(
        f"warning: checkpoint 2 under {svc.directory} is damaged (opt_state/"
    ), warned
    assert "resuming from checkpoint 1, the newest intact one, and discarding 2" in warned[0]
    event = store.read_jsonl("events.jsonl")[-1]
    assert (event["event"], event["step"], event["resume_from"]) == ("checkpoint_damaged", 2, 1)
    svc.close()


def test_unreadable_first_step_says_there_is_nothing_older(tmp_path) -> None:
    store = ArtifactStore(str(tmp_path / "run"))
    svc = CheckpointService(store, keep=2, async_save=False)
    save(svc, 1)
    _corrupt(store, 1, "garbled meta")
    with pytest.raises(UnreadableCheckpointError, match="no older checkpoint to fall back to"):
        svc.restore(1, params_target=abstract(make_state()[0]))
    # The resume path marks it in the index; a good read later clears the mark.
    svc.mark_unreadable(1, "garbled JSON")
    assert load_index(store)["checkpoints"][0]["unreadable"] == "garbled JSON"
    svc.mark_readable(1)
    assert "unreadable" not in load_index(store)["checkpoints"][0]
    svc.close()


def _abandon_failed_task(filename: str) -> None:
    """Run a task whose coroutine is defined in `filename` and fails, never retrieve its
    exception, and drop it: asyncio then logs "Task exception was never retrieved"."""
    import asyncio
    import gc

    code = compile(
        "async def read():\n    raise ValueError('OUT_OF_RANGE: torn')\n", filename, "exec"
    )
    scope: dict = {}
    exec(code, scope)
    loop = asyncio.new_event_loop()
    task = loop.create_task(scope["read"]())
    loop.run_until_complete(asyncio.sleep(0))
    loop.close()
    del task
    gc.collect()


def test_orbax_siblings_of_a_failed_read_are_not_logged_after_the_sentence(caplog) -> None:
    # A failed restore's other array reads fail too; asyncio reports them whenever the garbage
    # collector reaches them, often after our one sentence. Orbax's are dropped, others kept.
    with caplog.at_level("ERROR", logger="asyncio"):
        _abandon_failed_task("/site-packages/orbax/checkpoint/_src/serialization/fake.py")
        assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]
        _abandon_failed_task("/elsewhere/ours.py")
        kept = [r for r in caplog.records if "never retrieved" in r.getMessage()]
    assert len(kept) == 1 and "/elsewhere/ours.py" in kept[0].getMessage()


def test_short_cause_is_one_line() -> None:
    spec = 'NOT_FOUND: Error opening "cast" driver: Error opening "zarr" driver: gone [tensorstore_spec=\'{"a": 1}\']\nmore'
    assert short_cause(ValueError(spec)) == "NOT_FOUND: gone"
    assert short_cause(KeyError("params")) == "missing key 'params'"
    assert short_cause(RuntimeError()) == "RuntimeError"
    assert len(short_cause("x" * 500)) == 200


def test_checkpoints_commands_verify_list_and_rollback(ckpt_uri: str) -> None:
    from runtime.commands.checkpoints import (
        describe,
        list_checkpoints,
        rollback,
        verify_checkpoints,
    )

    store = ArtifactStore(ckpt_uri)
    store.write_json("manifest.json", {"run_id": "r"})  # what makes it a run directory
    svc = CheckpointService(store, keep=4, async_save=False)
    for step in (2, 4, 6):
        save(svc, step)
    svc.close()
    _corrupt(store, 6, "truncated params")

    report = verify_checkpoints(ckpt_uri)
    lines = describe(report)
    assert not report["ok"] and len(lines) == 3
    assert lines[0].startswith("step 2: ok (") and lines[0].endswith(" MiB)")
    assert lines[2].startswith("step 6: unreadable: params: ")
    assert [e["step"] for e in list_checkpoints(ckpt_uri)["checkpoints"]] == [2, 4, 6]

    with pytest.raises(CheckpointError, match="step 5 is not a committed checkpoint"):
        rollback(ckpt_uri, 5)
    assert disk_steps(store) == [2, 4, 6]  # a refused rollback deletes nothing
    out = rollback(ckpt_uri, 4)
    assert out["discarded"] == [6] and disk_steps(store) == [2, 4]
    assert load_index(store)["latest"] == 4
    event = store.read_jsonl("events.jsonl")[-1]
    assert event["event"] == "checkpoints_discarded" and event["steps"] == [6]
    assert verify_checkpoints(ckpt_uri)["ok"]


def test_a_failed_restore_quiets_only_the_abandoned_reads(caplog):
    """After a failed restore, the abandoned reads' own reports (asyncio's unretrieved plain
    futures holding a tensorstore error, unawaited coroutines) repeat the cause after the one
    sentence; other asyncio errors and warnings stay."""
    import logging
    import warnings

    from runtime.run.checkpoint.log_filters import quiet_abandoned_futures

    log = logging.getLogger("asyncio")
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        log.error("Future exception was never retrieved\nfuture: <Future finished exception="
                  "ValueError('OUT_OF_RANGE: … [tensorstore_spec=\\'{}\\']')>")  # fmt: skip
        log.error("Future exception was never retrieved\nfuture: <Future finished exception="
                  "ValueError('ours')>")  # fmt: skip
    assert [r.getMessage().split("=", 1)[1] for r in caplog.records] == ["ValueError('ours')>"]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        quiet_abandoned_futures()
        warnings.warn("coroutine 'Store._get_array_metadatas' was never awaited", RuntimeWarning,
                      stacklevel=1)  # fmt: skip
        warnings.warn("something else", RuntimeWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["something else"]


def test_tensorstore_retries_add_up_to_the_runs_storage_budget() -> None:
    """Its tries' waits (initial doubling up to max) cover total_s, and one try fewer does not."""
    for total in (0.1, 1, 2, 31.5, 120, 900):
        policy = RetryPolicy(total_s=total)
        r = tensorstore_retries(policy)
        waits = [min(policy.initial_s * 2**k, policy.max_s) for k in range(r["max_retries"])]
        assert sum(waits) >= total > sum(waits[:-1]), (total, r)
        assert r["initial_delay"] == f"{policy.initial_s}s" and r["max_delay"] == f"{policy.max_s}s"
    assert tensorstore_retries(DEFAULT_RETRY)["max_retries"] == 11  # 120 s: 0.5 .. 16, then 20s
    # tensorstore takes the resource as given (an unknown key or bad duration would raise).
    import tensorstore as ts

    ts.Context({"gcs_request_retries": tensorstore_retries(DEFAULT_RETRY)})


def test_the_contexts_orbax_builds_carry_the_bounded_retries(monkeypatch) -> None:
    """Orbax copies its module-level defaults into every save's and restore's context; if a new
    Orbax stops doing so, this fails rather than leaving tensorstore's 15-minute retries."""
    import tensorstore as ts
    from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

    for name in ("_BASE_TS_CONTEXT", "_DEFAULT_OCDBT_TS_CONTEXT"):
        monkeypatch.setattr(ts_utils, name, dict(getattr(ts_utils, name)))
    bound_tensorstore_retries(RetryPolicy(total_s=3))
    want = ts.Context({"gcs_request_retries": tensorstore_retries(RetryPolicy(total_s=3))})
    want = want.spec.to_json()["gcs_request_retries"]  # as tensorstore writes it: 500ms
    assert want["max_retries"] == 3
    for ocdbt in (True, False):
        spec = ts_utils.get_ts_context(use_ocdbt=ocdbt).spec.to_json()
        assert spec["gcs_request_retries"] == want, spec
