"""One `runtime local` run of bench/tpu/goodput.sh, watched from outside, as one JSON row.

    python3 bench/tpu/goodput_run.py --what NAME --run RUN_DIR [--stop-at-step N]
        [--timeout S] [--log FILE] -- ARGS...      # ARGS: what follows `runtime local`

The run is started as a user starts it (a new process, timed from its start), and sent SIGTERM
once its train rows reach `--stop-at-step` (pass `--set checkpoint.on_signal=false` for a stop
without a final save). The row: `ttfs_s` (process start, from /proc as the run's ledger has it,
to the end of this attempt's first step), the first_step event (compile_s, restore_s,
verify_s, restore_overlap_s, compile_from_cache, ...), the attempt's last ledger, its
checkpoint events (checkpoint: blocked_s, waited_s; checkpoint_written: write_s, at_step;
checkpoint_skipped), and `steps`: [step, step_time, elapsed] of every train row of the attempt
(log_every = 1: one row, and one host sync, per step).

    python3 bench/tpu/goodput_run.py --compare ROWS.jsonl BASE WITH_SAVES

prints the saves' cost: tokens/s of the run with saves over the run without (wall time from
the rows' `elapsed`, save pauses included), and the steps that ran while a write was going
(those after a save up to its `checkpoint_written` at_step) against the median step.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

CLI = "from runtime.commands.cli import main; main()"


def _arg(args: list[str], name: str, default: str | None = None) -> str | None:
    return args[args.index(name) + 1] if name in args else default


def _jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line being written
    return out


def _epoch(iso: str) -> float:
    return datetime.datetime.fromisoformat(iso).timestamp()


def watch(run: Path, cmd: list[str], stop_at: int | None, timeout: float, log) -> tuple[int, float]:
    """Run `cmd`, SIGTERM it once its train rows reach `stop_at`; (exit code, start time)."""
    rows = run / "metrics" / "train.jsonl"
    before = len(_jsonl(rows))
    started = time.time()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    sent = False
    while proc.poll() is None:
        if time.time() - started > timeout:
            proc.kill()
            break
        if stop_at is not None and not sent:
            new = _jsonl(rows)[before:]
            if new and max(r.get("step", 0) for r in new) >= stop_at:
                proc.send_signal(signal.SIGTERM)
                sent = True
        time.sleep(0.05)
    return proc.wait(), started


def row_of(what: str, run: Path, code: int, started: float) -> dict:
    """The attempt that began at `started`: its first step, ledger, checkpoints and step rows."""
    events = [e for e in _jsonl(run / "events.jsonl") if _epoch(e["time"]) >= started - 1]
    ledgers = [e for e in events if e["event"] == "ledger"]
    ledger = ledgers[-1] if ledgers else {}
    first = next((e for e in events if e["event"] == "first_step"), None)
    ttfs = None
    if first and ledger:
        ttfs = round(_epoch(first["time"]) - float(ledger["process_start"]), 2)
    start_step = (first or {}).get("step", 1) - 1
    steps = [
        [r["step"], r.get("step_time"), r.get("elapsed")]
        for r in _jsonl(run / "metrics" / "train.jsonl")
        if r["step"] > start_step
    ]
    kinds = ("checkpoint", "checkpoint_written", "checkpoint_skipped")
    return {
        "what": what,
        "exit_code": code,
        "ttfs_s": ttfs,
        "ttfs_wall_s": round(_epoch(first["time"]) - started, 2) if first else None,
        "first_step": first,
        "ledger": ledger.get("seconds"),
        "checkpoints": [e for e in events if e["event"] in kinds],
        "steps": steps,
    }


def compare(rows: list[dict], base: str, saves: str, skip_first: int = 5) -> dict:
    """Throughput with saves over without, and the steps while a write went on."""
    by = {r["what"]: r for r in rows}
    b, s = by[base], by[saves]

    def rate(row: dict) -> tuple[float, list[list]]:
        st = [x for x in row["steps"] if x[2] is not None][skip_first:]
        steps, seconds = st[-1][0] - st[0][0], st[-1][2] - st[0][2]
        return steps / seconds, st

    base_rate, base_steps = rate(b)
    saves_rate, steps = rate(s)
    windows = []
    saved = {e["step"] for e in s["checkpoints"] if e["event"] == "checkpoint"}
    for e in s["checkpoints"]:
        if e["event"] == "checkpoint_written" and e["step"] in saved:
            windows.append((e["step"], e["at_step"]))
    during = [x for x in steps if any(a < x[0] <= z for a, z in windows) and x[1] is not None]
    median = statistics.median(x[1] for x in base_steps if x[1] is not None)
    worst = max(during, key=lambda x: x[1]) if during else None
    return {
        "what": f"compare {saves} vs {base}",
        "throughput_ratio": round(saves_rate / base_rate, 4),
        "steps_per_s": [round(base_rate, 4), round(saves_rate, 4)],
        "median_step_s": round(median, 4),
        "write_windows": windows,
        "steps_during_writes": len(during),
        "max_step_during_write_s": worst and round(worst[1], 4),
        "max_over_median": worst and round(worst[1] / median, 4),
        "over_10pct": [x[0] for x in during if x[1] > 1.1 * median],
        "blocked_s": [e.get("blocked_s") for e in s["checkpoints"] if e["event"] == "checkpoint"],
    }


def main() -> None:
    args = sys.argv[1:]
    if "--compare" in args:
        path, base, saves = args[args.index("--compare") + 1 :][:3]
        print(json.dumps(compare(_jsonl(Path(path)), base, saves)), flush=True)
        return
    split = args.index("--")
    mine, rest = args[:split], args[split + 1 :]
    run = Path(_arg(mine, "--run"))
    stop = _arg(mine, "--stop-at-step")
    log_path = _arg(mine, "--log", os.devnull)
    with open(log_path, "a") as log:
        code, started = watch(
            run,
            [sys.executable, "-c", CLI, "local", *rest],
            int(stop) if stop else None,
            float(_arg(mine, "--timeout", "300")),
            log,
        )
    print(json.dumps(row_of(_arg(mine, "--what"), run, code, started)), flush=True)


if __name__ == "__main__":
    main()
