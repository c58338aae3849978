"""One reader of a run folder (`<output_uri>/<run_id>`, local or gs://): what a run says about
itself, read the same way for `launch status` (which never imports jax) and `runtime inspect`.

`read_run` reads the records once into a `RunView`: manifest.json (or a failure the events
recorded after it: runfolder.outcome), the train rows (every one, or only the newest: a tail,
all `launch status` needs of a long run), the eval rows (runfolder.evals), the events
(runfolder.goodput) and the final summary. `read_progress` is `launch status`'s form of it: it
never raises, and says so when the folder holds no progress of the submission it follows.
`runtime inspect` adds the checkpoint index (runtime/run/inspect.py). `record_lines` prints the
lines both commands show of a run.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from jobspec.errors import JaxjobError, StorageError
from runfolder.evals import eval_summary, eval_text
from runfolder.goodput import account, goodput_line
from runfolder.layout import EVAL_METRICS, EVENTS, MANIFEST, SUMMARY, TRAIN_METRICS, EventKind
from runfolder.outcome import effective_manifest
from runfolder.storage import RetryPolicy, configure_gcs_env
from runfolder.store import ArtifactStore

TAIL_BYTES = 64 * 1024  # enough for the last few JSONL rows of any metrics file
ETA_ROWS = 50  # the newest rows whose median step time the ETA is taken at


class ManifestError(JaxjobError):
    """A manifest.json that cannot be read or is not a JSON object."""


def _manifest(data: bytes, shown: str) -> dict[str, Any]:
    try:
        manifest = json.loads(data)
    except ValueError as e:  # the hosts replace it whole: torn only by hand or a broken disk
        raise ManifestError(f"cannot read {shown}: it is not valid JSON ({e})") from None
    if not isinstance(manifest, dict):
        raise ManifestError(
            f"cannot read {shown}: it holds a JSON {type(manifest).__name__}, not an object"
        )
    return manifest


def read_manifest(fs: Any, path: str, shown: str) -> dict[str, Any] | None:
    """The manifest at `path` of the fsspec filesystem `fs` (`shown`: its name for the user);
    None when there is none."""
    if not fs.exists(path):
        return None
    try:
        with fs.open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ManifestError(f"cannot read {shown}: {e.strerror or e}") from None
    return _manifest(data, shown)


def _stored_manifest(store: ArtifactStore) -> dict[str, Any] | None:
    if not store.exists(MANIFEST):
        return None
    return _manifest(store.read_bytes(MANIFEST), store.uri(MANIFEST))


def open_run(run: str) -> ArtifactStore:
    """The run folder `run` (a path or gs:// URI), to read; StorageError when it is none."""
    configure_gcs_env()
    store = ArtifactStore(run.rstrip("/"), process_index=0)
    if not store.exists(MANIFEST):
        raise StorageError(f"{run} is not a jaxjob run directory (no {MANIFEST} there)")
    return store


def eta_seconds(rows: list[dict[str, Any]], total_steps: int | None) -> float | None:
    """Steps left x the median step time of the newest timed rows; None when unknown."""
    times = sorted(
        r["step_time"] for r in rows[-ETA_ROWS:] if isinstance(r.get("step_time"), int | float)
    )
    if not rows or not times or not total_steps:
        return None
    return max(0, total_steps - rows[-1].get("step", 0)) * times[len(times) // 2]


@dataclass(frozen=True)
class RunView:
    """A run as its records say, read once by `read_run`. `whole`: every train row was read;
    else only the newest, and the figures over every row (`first_loss`,
    `tokens_per_s_median`) and the final `summary` are None."""

    uri: str
    whole: bool
    run_id: str | None
    # manifest.json's status, or `failed`/`diverged` from a failure recorded after it.
    status: str | None
    failure: str | None  # a failed or diverged attempt's sentence
    diverged_at_step: int | None
    step: int  # the newest train row's step; without rows, the manifest's
    total_steps: int | None
    tokens: int
    first_loss: float | None
    last_loss: float | None
    tokens_per_s_median: float | None
    mfu_last: float | None
    eta_s: float | None  # while the run says it is running, at the recent step time
    # {name, step, loss} of metrics/eval.jsonl's newest and lowest rows (runfolder.evals).
    latest_eval: dict[str, Any] | None
    best_eval: dict[str, Any] | None
    # The newest thing that happened (time-ledger snapshots are bookkeeping, not events).
    last_event: dict[str, Any] | None
    goodput: dict[str, Any] | None  # over every attempt, from the ledger snapshots
    summary: dict[str, Any] | None  # summaries/final.json, once the run has ended

    def progress(self) -> dict[str, Any]:
        """`launch status`'s progress (the keys of its --json)."""
        return {
            "status": self.status,
            "step": self.step,
            "total_steps": self.total_steps,
            "last_loss": self.last_loss,
            "last_event": self.last_event,
            "goodput": self.goodput,
            "eta_s": self.eta_s,
            "latest_eval": self.latest_eval,
            "best_eval": self.best_eval,
            # A diverged run (training.on_nonfinite) says where; a failed one, why.
            "diverged_at_step": self.diverged_at_step,
            "failure": self.failure,
        }


def _jsonl(store: ArtifactStore, rel: str, *, warn_torn: bool) -> list[dict[str, Any]]:
    return store.read_jsonl(rel, warn_torn=warn_torn) if store.exists(rel) else []


def read_run(
    store: ArtifactStore, *, tail: bool = False, manifest: dict[str, Any] | None = None
) -> RunView:
    """The run in `store` (open_run), as its records say. `tail`: only the newest train rows, as
    a live run is followed (a torn last line is then an append in progress: no warning).
    `manifest`: manifest.json when the caller has read it already."""
    if manifest is None:
        manifest = _stored_manifest(store)
    if manifest is None:
        raise StorageError(f"{store.uri()} is not a jaxjob run directory (no {MANIFEST} there)")
    if tail:
        rows = store.read_jsonl_tail(TRAIN_METRICS, TAIL_BYTES)
    else:
        rows = _jsonl(store, TRAIN_METRICS, warn_torn=True)
    events = _jsonl(store, EVENTS, warn_torn=not tail)
    evals = eval_summary(_jsonl(store, EVAL_METRICS, warn_torn=not tail))
    summary = None if tail or not store.exists(SUMMARY) else store.read_json(SUMMARY)
    # A failure recorded after a `running` manifest that a full disk kept from being replaced.
    manifest = effective_manifest(manifest, events)
    last = rows[-1] if rows else None
    timed = sorted(r["tokens_per_s"] for r in rows if "tokens_per_s" in r)
    running = manifest.get("status") == "running"
    return RunView(
        uri=store.uri(),
        whole=not tail,
        run_id=manifest.get("run_id"),
        status=manifest.get("status"),
        failure=manifest.get("failure"),
        diverged_at_step=manifest.get("diverged_at_step"),
        step=last["step"] if last else manifest.get("steps", 0),
        total_steps=manifest.get("total_steps"),
        tokens=last.get("tokens", 0) if last else 0,
        first_loss=rows[0].get("loss") if rows and not tail else None,
        last_loss=last.get("loss") if last else None,
        tokens_per_s_median=timed[len(timed) // 2] if timed and not tail else None,
        mfu_last=next((r["mfu"] for r in reversed(rows) if "mfu" in r), None),
        eta_s=eta_seconds(rows, manifest.get("total_steps")) if running else None,
        latest_eval=evals["latest"],
        best_eval=evals["best"],
        last_event=next((e for e in reversed(events) if e.get("event") != EventKind.LEDGER), None),
        goodput=account(events),
        summary=summary,
    )


# ---- launch status: only what this submission wrote --------------------------------------------


def prepare_note(m: dict[str, Any]) -> str:
    """A prepare job's state in one line, from the manifest.json its host 0 keeps."""
    status, hosts = m.get("status"), m.get("hosts")
    if status == "completed":
        return (
            f"prepared {m.get('dataset_manifest')} (fingerprint {m.get('fingerprint')}, "
            f"{m.get('total_tokens')} tokens in {m.get('total_documents')} documents; "
            f"{m.get('parts')} parts: {m.get('written')} written by this attempt, "
            f"{m.get('skipped')} already committed)"
        )
    if status == "running":
        return f"preparing {m.get('out')} on {hosts} host(s), attempt {m.get('attempt')}"
    return f"prepare {status}: {m.get('error') or 'see launch logs'}"


def when(stamp: Any) -> dt.datetime | None:
    """An ISO 8601 time of a record (`updated`, a record's `submitted`, a k8s creationTimestamp)
    as an aware datetime; None when it is not one."""
    try:
        t = dt.datetime.fromisoformat(str(stamp))
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=dt.UTC)


def earlier_submission(manifest: dict[str, Any], since: str | None) -> bool:
    """Whether `manifest` was last written before `since` (when a submission was made), so it
    is an earlier submission's record, not this one's: a resubmitted run keeps its folder, and
    this submission's hosts rewrite the manifest when they start. Times of other machines (a
    cluster's nodes) are compared as they are: their clocks are taken to agree within a host's
    boot time."""
    written, made = when(manifest.get("updated")), when(since) if since else None
    return written is not None and made is not None and written < made


def _nothing(note: str) -> dict[str, Any]:
    return {"status": None, "step": 0, "total_steps": None, "last_loss": None,
            "last_event": None, "goodput": None, "eta_s": None, "latest_eval": None,
            "best_eval": None, "note": note}  # fmt: skip


def _earlier_note(manifest: dict[str, Any]) -> str:
    total = manifest.get("total_steps")
    return (
        f"no progress from this submission yet ({MANIFEST} is an earlier submission's, written "
        f"{str(manifest.get('updated'))[:19].replace('T', ' ')} UTC: {manifest.get('status')} "
        f"at step {manifest.get('steps', 0)} / {total if total is not None else '?'})"
    )


#: `launch status` answers within seconds: storage that does not answer in this time is said in
#: the progress's error, not waited for as long as a training host waits (storage_retry_s).
STATUS_RETRY = RetryPolicy(total_s=10.0, call_s=10.0)


def read_progress(run_uri: str, since: str | None = None) -> dict[str, Any]:
    """`launch status`'s progress of the run at `run_uri` (RunView.progress, read with `tail`);
    {"error": …} naming the file when unreadable; never raises. `since`: when the submission
    followed was made; a manifest older than that is an earlier submission's and gives no
    progress, only a note (as does a folder with no artifacts yet, and a prepare job's)."""
    try:
        store = ArtifactStore(run_uri, process_index=0, retry=STATUS_RETRY)
        manifest = _stored_manifest(store)
        if manifest is None:
            return _nothing("no artifacts yet")
        if earlier_submission(manifest, since):
            return _nothing(_earlier_note(manifest))
        if manifest.get("kind") == "prepare":  # a prepare job has no steps: say where it stands
            return {**_nothing(prepare_note(manifest)), "status": manifest.get("status")}
        view = read_run(store, tail=True, manifest=manifest)
    except ManifestError as e:
        return {"error": str(e)}
    except (JaxjobError, OSError, ValueError) as e:
        return {"error": f"cannot read the records under {run_uri}: {e}"}
    return view.progress()


# ---- the lines `launch status` and `runtime inspect` both print ---------------------------------


def _event_text(e: dict[str, Any]) -> str:
    return f"{e.get('event')} at {e.get('time')}"


_RECORD_LINES: dict[str, tuple[str, Callable[[Any], str]]] = {
    "latest_eval": ("latest eval", eval_text),
    "best_eval": ("best eval", eval_text),
    "goodput": ("goodput", goodput_line),
    "last_event": ("last event", _event_text),
    "failure": ("failure", str),
}


def record_lines(report: Mapping[str, Any], keys: Iterable[str], width: int) -> list[str]:
    """`report`'s line for each of `keys` (RunView.progress's or `runtime inspect`'s keys:
    latest_eval, best_eval, goodput, last_event, failure) it has, each label padded to `width`;
    a failure only of a run that failed or diverged."""
    lines = []
    for key in keys:
        value = report.get(key)
        if not value or (key == "failure" and report.get("status") not in ("failed", "diverged")):
            continue
        label, text = _RECORD_LINES[key]
        lines.append(f"{label:<{width}}{text(value)}")
    return lines
