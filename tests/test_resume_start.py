"""A resume's start: nothing of the model is initialised, the checkpoint is read straight into
its shapes and shardings while the step compiles, its checksums compared beside the read, and
the first step says what each part took."""

from __future__ import annotations

import threading

import jax
import numpy as np
import pytest
from test_checkpoint import _corrupt, abstract, make_state, save

from jobspec.files.run_toml import parse_run_config
from runfolder.store import ArtifactStore
from runtime.model import build as build_module
from runtime.run import checksums
from runtime.run.checkpoint.errors import UnreadableCheckpointError
from runtime.run.checkpoint.service import CheckpointService
from runtime.train.loop import train

from runs import read_jsonl, tiny_config


def _train(cfg: dict, **kw):
    return train(parse_run_config(cfg), "# test\n", emit=lambda _line: None, **kw)


class _CountingJax:
    """`jax` as runtime/model/build.py sees it, counting the programs it jits: every one of
    them is a model init (parameters, or the constants beside them)."""

    def __init__(self) -> None:
        self.jitted = 0

    def __getattr__(self, name: str):
        return getattr(jax, name)

    def jit(self, *args, **kwargs):
        self.jitted += 1
        return jax.jit(*args, **kwargs)


def test_a_resume_runs_no_init_program_and_says_what_its_start_took(
    tmp_path, prepared, monkeypatch
) -> None:
    cfg = tiny_config(prepared, str(tmp_path), run_id="warm", checkpoint={"every": 2},
                      training={"target_tokens": 16 * 8 * 4})  # fmt: skip
    counting = _CountingJax()
    monkeypatch.setattr(build_module, "jax", counting)
    _train(cfg, resume=False, max_steps=2)
    assert counting.jitted == 1  # a fresh run initialises its parameters: one program
    counting.jitted = 0
    assert _train(cfg, resume=True).status == "completed"
    assert counting.jitted == 0  # the resume built shapes only and read the checkpoint into them

    first = [e for e in read_jsonl(tmp_path / "warm/events.jsonl") if e["event"] == "first_step"]
    resumed = first[-1]
    assert resumed["step"] == 3 and resumed["compiled_ahead"] is True, resumed
    for key in ("restore_s", "verify_s", "restore_overlap_s", "compile_s", "compile_wait_s"):
        assert isinstance(resumed[key], float) and resumed[key] >= 0, (key, resumed)
    assert resumed["restore_overlap_s"] <= min(resumed["restore_s"], resumed["compile_s"])
    assert "restore_s" not in first[0] and first[0]["compiled_ahead"] is True


def test_the_checksums_are_compared_while_orbax_reads_the_step(tmp_path, monkeypatch) -> None:
    """The resume's read and its checksum comparison run side by side: the comparison here
    waits (bounded) for Orbax's read to start, which a compare-then-read order never lets
    happen."""
    store = ArtifactStore(str(tmp_path / "run"))
    svc = CheckpointService(store, keep=3, async_save=False)
    for step in (1, 2):
        save(svc, step)
    svc.close()
    svc = CheckpointService(ArtifactStore(str(tmp_path / "run")), keep=3)
    reading, overlapped = threading.Event(), []
    real_check, real_restore = checksums.check, svc._mgr.restore

    def check(*args, **kwargs):
        overlapped.append(reading.wait(timeout=30))
        return real_check(*args, **kwargs)

    def restore(*args, **kwargs):
        reading.set()
        return real_restore(*args, **kwargs)

    monkeypatch.setattr(checksums, "check", check)
    monkeypatch.setattr(svc._mgr, "restore", restore)
    params, opt_state = make_state(2.0)
    got = svc.restore_resume(None, params_target=abstract(params),
                             opt_state_target=abstract(opt_state), before_read=lambda s: None)  # fmt: skip
    assert overlapped == [True]
    assert got.step == 2 and got.meta.step == 2 and got.verify_s is not None
    np.testing.assert_array_equal(np.asarray(got.params["embed"]), np.asarray(params["embed"]))
    svc.close()


def test_a_damaged_latest_found_beside_the_read_falls_back_to_the_newest_intact(
    tmp_path, capsys
) -> None:
    store = ArtifactStore(str(tmp_path / "run"))
    svc = CheckpointService(store, keep=3, async_save=False)
    for step in (1, 2):
        save(svc, step)
    svc.close()
    _corrupt(store, 2, "zeroed opt_state", checksums=True)  # same sizes, other bytes
    params, opt_state = make_state(1.0)
    targets = {"params_target": abstract(params), "opt_state_target": abstract(opt_state)}

    svc = CheckpointService(ArtifactStore(str(tmp_path / "run")), keep=3)
    with pytest.raises(UnreadableCheckpointError, match=r"checkpoint 2 .* \(opt_state/"):
        svc.restore_resume(2, before_read=lambda s: None, **targets)  # as chosen: refused
    capsys.readouterr()
    read_before: list[int] = []
    got = svc.restore_resume(None, before_read=read_before.append, **targets)
    assert got.step == 1 and read_before == [2, 1]
    np.testing.assert_array_equal(np.asarray(got.params["embed"]), np.asarray(params["embed"]))
    warned = capsys.readouterr().err.strip().splitlines()
    assert len(warned) == 1 and "resuming from checkpoint 1, the newest intact one" in warned[0]
    assert svc.steps() == [1]
    svc.close()


def test_the_comparison_started_with_the_process_serves_the_resume_of_that_step_only(
    tmp_path, monkeypatch
) -> None:
    """`runtime local --resume` starts the comparison beside its imports (run/early_check.py):
    the resume takes that verdict, for the step it was made for; a damaged step is found the
    same way, and any other step is compared as before."""
    from runtime.run import early_check

    store = ArtifactStore(str(tmp_path / "run"))
    svc = CheckpointService(store, keep=3, async_save=False)
    for step in (1, 2):
        save(svc, step)
    svc.close()
    _corrupt(store, 1, "zeroed opt_state", checksums=True)
    calls: list[int] = []
    real_check = checksums.check

    def check(store, rel, **kwargs):
        calls.append(int(rel.rsplit("/", 1)[-1]))
        return real_check(store, rel, **kwargs)

    monkeypatch.setattr(checksums, "check", check)
    params, opt_state = make_state(2.0)
    targets = {"params_target": abstract(params), "opt_state_target": abstract(opt_state)}
    early = early_check.take  # what the train loop hands its CheckpointService

    early_check.start(str(tmp_path / "run"), None)  # the newest step: 2
    svc = CheckpointService(ArtifactStore(str(tmp_path / "run")), keep=3, early_finding=early)
    got = svc.restore_resume(None, before_read=lambda s: None, **targets)
    assert got.step == 2 and calls == [2]  # compared once, early
    np.testing.assert_array_equal(np.asarray(got.params["embed"]), np.asarray(params["embed"]))
    svc.close()

    calls.clear()
    early_check.start(str(tmp_path / "run"), 1)  # a chosen step, damaged: refused as before
    svc = CheckpointService(ArtifactStore(str(tmp_path / "run")), keep=3, early_finding=early)
    with pytest.raises(UnreadableCheckpointError, match=r"checkpoint 1 .* \(opt_state/"):
        svc.restore_resume(1, before_read=lambda s: None, **targets)
    assert calls == [1]
    svc.close()

    calls.clear()
    early_check.start(str(tmp_path / "run"), 1)  # made for step 1; the resume reads 2
    svc = CheckpointService(ArtifactStore(str(tmp_path / "run")), keep=3, early_finding=early)
    assert svc.restore_resume(2, before_read=lambda s: None, **targets).step == 2
    assert calls == [1, 2]  # the early verdict did not stand in for step 2's
    assert early_check.take(svc.store.root_uri, 1, None) is None  # taken once only
    svc.close()
