"""A periodic save that comes while the one before is still being written is skipped, never
waited for: the loop keeps stepping, the run says so once, and every skip is an event."""

from __future__ import annotations

import json
import threading

from jobspec.files.run_toml import parse_run_config
from runtime.run import checksums
from runtime.run.checkpoint.service import CheckpointService
from runtime.train.loop import SAVE_GRACE_S, train

from runs import read_jsonl, tiny_config


def test_a_save_due_while_the_last_one_writes_is_skipped_and_said_once(
    tmp_path, prepared, monkeypatch
) -> None:
    """Saves every step; checkpoint 1's write (its checksums, the end of a background save)
    holds until two more saves have come due: step 2's waits its grace (SAVE_GRACE_S) and is
    skipped, step 3's is skipped at once, 4 and 5 save again, and the final save at 6 still
    happens."""
    release = threading.Event()
    real_record, real_writing = checksums.record, CheckpointService.writing

    def record(store, rel):
        if rel.endswith("/1"):
            assert release.wait(timeout=120), "checkpoint 1's write was never let go"
        return real_record(store, rel)

    due_while_writing: list[int] = []
    graces: list[float] = []

    def writing(self, grace_s=0.0):
        if release.is_set():  # storage that keeps up from then on: each write ends in time
            self.wait()
        step = real_writing(self, grace_s)
        if step is not None:
            due_while_writing.append(step)
            graces.append(grace_s)
            if len(due_while_writing) == 2:  # then 1's write ends, before the next step
                release.set()
                self.wait()
        return step

    monkeypatch.setattr(checksums, "record", record)
    monkeypatch.setattr(CheckpointService, "writing", writing)
    said: list[str] = []
    cfg = tiny_config(prepared, str(tmp_path), run_id="busy", checkpoint={"every": 1, "keep": 10},
                      training={"target_tokens": 16 * 8 * 6})  # fmt: skip
    result = train(parse_run_config(cfg), "# test\n", resume=False, emit=said.append)
    assert result.status == "completed"

    run = tmp_path / "busy"
    index = json.loads((run / "checkpoints/index.json").read_text())
    assert [e["step"] for e in index["checkpoints"]] == [1, 4, 5, 6]
    events = read_jsonl(run / "events.jsonl")
    skips = [{k: e[k] for k in ("step", "writing", "skipped")} for e in events
             if e["event"] == "checkpoint_skipped"]  # fmt: skip
    assert skips == [{"step": 2, "writing": 1, "skipped": 1},
                     {"step": 3, "writing": 1, "skipped": 2}]  # fmt: skip
    notes = [line for line in said if line.startswith("note:")]
    assert notes == [
        "note: checkpoint 2 skipped: checkpoint 1 is still being written, as saves every 1 "
        "steps come faster than the storage takes them; the next due step saves (skips are "
        "counted in events.jsonl); raise checkpoint.every to save at each"
    ]
    assert graces == [SAVE_GRACE_S, 0.0]  # after a skip, a write going means skip at once
    # When each write ended, and at which step: checkpoint 1's ran through steps 2 and 3.
    written = [(e["step"], e["at_step"]) for e in events if e["event"] == "checkpoint_written"]
    assert written[0] == (1, 3) and [w[0] for w in written] == [1, 4, 5, 6], written
    # No periodic save waited: each that started found the one before written.
    saves = [e for e in events if e["event"] == "checkpoint"]
    assert [e["step"] for e in saves] == [1, 4, 5, 6]
    assert all(e["waited_s"] < 60 for e in saves)
