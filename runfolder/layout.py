"""The run directory, `<output_uri>/<run_id>/`: the name of every file in it, and the rows of its
JSONL files.

Jax-free, so the runtime (which writes these files through runfolder.store), `runtime inspect`,
`runtime plot` and `launch status` (which only read them) name them from one place. Rows are
built as the types below and written with `to_json()`; readers get them back as dicts. A row's
keys, and their order, are the file format: renaming one breaks the readers of older runs.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

MANIFEST = "manifest.json"  # what the run is, its status and progress
OWNER = "owner.json"  # the live owner's claim (runtime/run/owner.py)
OWNER_LOCK = ".owner.lock"  # a local run directory: changes to the claim, one at a time
SOURCE_CONFIG = "config/source.toml"  # the config as given
RESOLVED_CONFIG = "config/resolved.json"  # with every default
DIAGNOSTICS = "diagnostics/runtime.json"  # the writer host's view at the start of the attempt
HOST_DIAGNOSTICS = "runtime.json"  # each host's own, under host_dir(i)
TRAIN_METRICS = "metrics/train.jsonl"  # TrainRow
EVAL_METRICS = "metrics/eval.jsonl"  # EvalRow
EVENTS = "events.jsonl"  # Event
SUMMARY = "summaries/final.json"
CHECKPOINTS = "checkpoints"  # Orbax's step folders, checkpoint_dir(step)
CHECKPOINT_INDEX = f"{CHECKPOINTS}/index.json"  # committed checkpoints only
TENSORBOARD, WANDB = "tensorboard", "wandb"  # the [metrics] sinks' files
PROFILE = "profile"  # [profile] traces, profile_dir(i) per host
DISK_RESERVE = ".disk-reserve"  # room for the failure record on a full disk
LOGS = "logs"  # each host's output in each attempt, host_log(attempt, i)
LINE_TIMES = ".times"  # beside each host log: when its lines arrived (line_times_record)

#: The layout recorded in manifest.json.
LAYOUT = {
    "manifest": MANIFEST,
    "config": [SOURCE_CONFIG, RESOLVED_CONFIG],
    "diagnostics": DIAGNOSTICS,
    "metrics": [TRAIN_METRICS, EVAL_METRICS],
    "events": EVENTS,
    "summary": SUMMARY,
    "checkpoints": CHECKPOINT_INDEX,
}


def checkpoint_dir(step: int) -> str:
    return f"{CHECKPOINTS}/{step}"


def host_dir(process_index: int) -> str:
    """Per-host files: any host may write its own."""
    return f"hosts/{process_index}"


def profile_dir(process_index: int) -> str:
    return f"{PROFILE}/host-{process_index}"


def host_log(attempt: int, process_index: int) -> str:
    """A host's copy of its stdout/stderr in one attempt (runtime/host/hostlog.py)."""
    return f"{LOGS}/attempt-{attempt}/host-{process_index}.log"


def line_times_record(lines: int, unix_time: float) -> bytes:
    """One record of a host log's sidecar `<log>.times` (runtime/host/hostlog.py): by
    `unix_time` the log held `lines` newlines. A line's time is that of the first record whose
    count exceeds its index (0-based); records never go back in time or count."""
    return f"{lines} {unix_time:.3f}\n".encode()


def parse_line_times(data: bytes) -> list[tuple[int, float]]:
    """The records of a `<log>.times` sidecar, in order: its complete lines (a last one without
    its newline is a write cut short); a malformed one is skipped."""
    out: list[tuple[int, float]] = []
    for raw in data.split(b"\n")[:-1]:
        fields = raw.split()
        if len(fields) != 2:
            continue
        try:
            out.append((int(fields[0]), float(fields[1])))
        except ValueError:
            continue
    return out


# host_log's path, or its attempt's folder, at the end of a path under any root; its sidecar
# (`host-<i>.log.times`, also as `.times.parts/`) and the log's parts folder are neither.
_HOST_LOG = re.compile(rf"(?:^|/){LOGS}/attempt-([0-9]+)(?:/host-([0-9]+)\.log)?\Z")


def parse_host_log(path: str) -> tuple[int, int | None] | None:
    """(attempt, host) of a path host_log built, (attempt, None) of its attempt's folder, under
    any root (`gs://b/run/logs/attempt-1/host-0.log` is (1, 0)); None for any other path (its
    line-times sidecar `host-0.log.times` included)."""
    if (found := _HOST_LOG.search(path.rstrip("/"))) is None:
        return None
    return int(found[1]), None if found[2] is None else int(found[2])


def now() -> str:
    """The time every record carries: ISO 8601 in UTC, so records of one run sort as strings."""
    return dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds")


class EventKind(StrEnum):
    """What an events.jsonl row says happened."""

    START = "start"
    RESUME = "resume"
    FIRST_STEP = "first_step"
    EVAL = "eval"
    EVAL_ROWS_REUSED = "eval_rows_reused"
    CHECKPOINT = "checkpoint"
    CHECKPOINT_SKIPPED = "checkpoint_skipped"  # a periodic save due while the last one wrote
    CHECKPOINT_WRITTEN = "checkpoint_written"  # a save committed and indexed, and when
    CHECKPOINT_MISSING = "checkpoint_missing"
    CHECKPOINT_DAMAGED = "checkpoint_damaged"
    CHECKPOINT_UNREADABLE = "checkpoint_unreadable"
    CHECKPOINTS_DISCARDED = "checkpoints_discarded"
    PROFILE = "profile"
    STEP_SKIPPED = "step_skipped"
    LEDGER = "ledger"  # a time-ledger snapshot (runfolder.goodput)
    INTERRUPTED = "interrupted"
    FAILURE = "failure"
    FINISH = "finish"


@dataclass(frozen=True)
class Event:
    """One row of events.jsonl: `{"time", "event", **fields}`."""

    kind: EventKind
    fields: dict[str, Any] = field(default_factory=dict)
    time: str = field(default_factory=now)

    def to_json(self) -> dict[str, Any]:
        return {"time": self.time, "event": self.kind.value, **self.fields}


@dataclass(frozen=True)
class TrainRow:
    """One row of metrics/train.jsonl: a step's figures and what fed it; the last row of a
    synced interval also carries the interval's timing."""

    step: int
    tokens: int
    values: dict[str, float | bool]  # the step's own scalars (loss, lr, grad_norm, ...), in order
    batch_hash: str
    tokens_per_source: dict[str, int] | None = None  # a mixture: what each source fed the step
    record_ids: list[Any] | None = None  # artifacts.provenance = "ids"
    sources: list[Any] | None = None  # a mixture's record ids are each source's own
    timing: dict[str, float] | None = None  # step_time, tokens_per_s, elapsed[, mfu], eta_s
    skipped_steps: int | None = None  # skip_step: the run's count so far

    def to_json(self) -> dict[str, Any]:
        row: dict[str, Any] = {"step": self.step, "tokens": self.tokens, **self.values}
        row["batch_hash"] = self.batch_hash
        for key in ("tokens_per_source", "record_ids", "sources"):
            if (value := getattr(self, key)) is not None:
                row[key] = value
        row.update(self.timing or {})
        if self.skipped_steps is not None:
            row["skipped_steps"] = self.skipped_steps
        return row


@dataclass(frozen=True)
class EvalRow:
    """One row of metrics/eval.jsonl: an eval's loss as sums and counts; over a mixture also each
    source's, keyed by its name (a loss of None: the source had no counted token)."""

    step: int
    time: str
    name: str
    split: str
    loss: float
    loss_sum: float
    token_count: float
    batches: int
    loss_per_source: dict[str, float | None] | None = None
    loss_sum_per_source: dict[str, float] | None = None
    token_count_per_source: dict[str, float] | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if v is not None}
