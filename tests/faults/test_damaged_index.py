"""A damaged checkpoint index, for real: `checkpoints/index.json` cut to 100 bytes under a run
whose checkpoint folders are intact.

The read-only commands (inspect, checkpoints list and verify, eval) read the committed folders
instead, with one warning line naming the command that rebuilds the index; a resume rebuilds it
on disk from those folders, keeps the damaged file beside it and trains on.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from jobspec.files.run_toml import parse_run_config
from runtime.commands.checkpoints import list_checkpoints, verify_checkpoints
from runtime.commands.offline import eval_checkpoint
from runtime.train.loop import train

from runs import run_cli, stderr_lines, tiny_config

CKPT = {"every": 2, "keep": 3, "async": True}


def _warnings(text: str) -> list[str]:
    return [ln for ln in stderr_lines(text) if ln.startswith("warning: ")]


def _index_steps(run: Path) -> list[int]:
    doc = json.loads((run / "checkpoints/index.json").read_text())
    return [e["step"] for e in doc["checkpoints"]]


def test_a_damaged_index_is_read_from_the_folders_and_rebuilt_by_resume(
    tmp_path, prepared, capsys
) -> None:
    cfg = tiny_config(
        prepared, str(tmp_path), run_id="dmg", training={"target_tokens": 16 * 8 * 8},
        checkpoint=CKPT,
    )  # fmt: skip
    first = train(parse_run_config(cfg), "# test\n", resume=False, max_steps=6, emit=lambda _: None)
    assert first.summary["steps"] == 6
    run = tmp_path / "dmg"
    index = run / "checkpoints/index.json"
    os.truncate(index, 100)
    damaged = index.read_bytes()
    capsys.readouterr()

    said = (
        f"warning: {index} is damaged (not valid JSON: ",
        f"); reading the committed checkpoints under {run}/checkpoints instead (steps 2, 4, 6); "
        "`runtime local CONFIG --resume` rebuilds it (a completed run trains nothing more)",
    )
    ins = run_cli("inspect", str(run))
    assert ins.returncode == 0, ins.stderr
    assert len(stderr_lines(ins.stderr)) == 1, ins.stderr
    line = stderr_lines(ins.stderr)[0]
    assert line.startswith(said[0]) and line.endswith(said[1]), line
    assert "checkpoints  [2, 4, 6]  latest 6" in ins.stdout, ins.stdout

    assert [e["step"] for e in list_checkpoints(str(run))["checkpoints"]] == [2, 4, 6]
    report = verify_checkpoints(str(run))
    assert report["ok"] and [s["step"] for s in report["steps"]] == [2, 4, 6]
    assert eval_checkpoint(str(run), "latest")["step"] == 6
    warned = _warnings(capsys.readouterr().err)
    assert len(warned) == 3 and all(w.startswith(said[0]) for w in warned), warned
    # Read-only: the damaged file is left as it is, and nothing is put beside it.
    assert index.read_bytes() == damaged
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if not p.name.isdigit()) == [
        "index.json"
    ]

    lines: list[str] = []
    res = train(parse_run_config(cfg), "# test\n", resume=True, emit=lines.append)
    assert res.status == "completed" and res.summary["steps"] == 8
    assert "resumed dmg from checkpoint 6; training to step 8" in lines
    kept = sorted((run / "checkpoints").glob("index.json.corrupt-*"))
    assert len(kept) == 1 and kept[0].read_bytes() == damaged
    warned = _warnings(capsys.readouterr().err)
    assert len(warned) == 1, warned
    assert warned[0].startswith(f"warning: {index} was damaged (not valid JSON: "), warned
    assert warned[0].endswith(
        f"); rebuilt it from the committed checkpoints under {run}/checkpoints (steps 2, 4, 6) "
        f"and kept the damaged file as {kept[0]}"
    ), warned
    assert _index_steps(run) == [4, 6, 8]
