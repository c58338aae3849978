"""`runtime worker CFG` for a prepare job: every host writes its share of the parts, host 0 the
manifest (docs/data.md, "Preparing on many hosts").

Host i of n runs `prepare_share(share=(i, n))`: it writes the parts p with p % n == i into
`<out>/shares-<plan>/`, each committed by its part.json, and skips the parts an earlier attempt
committed. So a restart of the job (max_restarts) runs every share again but redoes only the
parts that were not committed. Once every host has written its share, host 0 merges the parts
into `<out>/manifest.json`; the dataset is the same however many hosts made it.

The hosts agree through the jax.distributed key-value store, under
`jaxjob/<run>/prepare/<attempt>/`, never through a device collective: a host may wait hours for
a slower share, and stays interruptible while it waits.
* `share/<i>`: host i's report (plan id, parts written and skipped) once its share is done;
* `outcome`: set once, the first writer wins: `0|<summary>` by host 0 after the merge, or
  `<exit code>|<sentence>` by the first host that failed (bad input 2, storage fault 45, a
  SIGTERM 42, a bug 1);
* `left/<i>`: host i leaves on a failed outcome.
A host that fails publishes the outcome and leaves with its own code; the others see it within
POLL_S (a watcher thread, also while they still write their share) and leave with its code, so
the backend sees one verdict. Host 0 runs the coordination service, so it leaves last (once the
others said they leave, or after LEAVE_WAIT_S): no host is aborted by JAX because the service
went away first. A failed job's hosts leave through hostlog.hard_exit, since JAX's exit-time
shutdown barrier would wait for peers that have already gone.

SIGTERM/SIGINT: JAX's preemption service is turned off for a prepare job (there are no steps to
agree on, and it would take SIGTERM from the start-up handlers), so runtime/host/startup.py keeps
the signals: the host stops with exit 42 (restartable) and its committed parts stay.

Records under `<output_uri>/<run_id>/`, as for a training run: `manifest.json` (host 0: kind
"prepare", status, the dataset's manifest and fingerprint), `config/source.toml`,
`hosts/<i>/share.json` (each host's parts written and skipped) and `logs/attempt-<n>/host-<i>.log`.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import re
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

import click

from jobspec.errors import DataError, JaxjobError
from jobspec.exit_codes import EXIT_FAILED, EXIT_RESTARTABLE
from jobspec.files.run_toml import merge
from jobspec.prepare_job import PrepareJobConfig, load_prepare_config
from runfolder.layout import MANIFEST, SOURCE_CONFIG, now
from runfolder.storage import RetryPolicy, join
from runtime.data.manifest import manifest_uri
from runtime.host import boot, hostlog, startup

POLL_S = 0.5  # how often a waiting host asks the key-value store
LEAVE_WAIT_S = 30.0  # longest host 0 waits, on a failure, for the others to leave first


def _parts(indices: list[int]) -> str:
    shown = ", ".join(map(str, indices[:20])) + (" …" if len(indices) > 20 else "")
    return f" ({shown})" if indices else ""


def _describe(e: BaseException) -> tuple[int, str]:
    """(exit code, one sentence) for what ended this host's share or merge."""
    if isinstance(e, startup.StartupInterrupted):
        found = re.search(r"stopped by (SIG[A-Z]+)", str(e))
        return EXIT_RESTARTABLE, (
            f"stopped by {found.group(1) if found else 'a signal'} while preparing; the parts "
            "already committed are kept, and a restart writes only the others"
        )
    if isinstance(e, JaxjobError):
        return e.exit_code, str(e)
    if isinstance(e, KeyboardInterrupt):
        return EXIT_RESTARTABLE, "interrupted while preparing; committed parts are kept"
    traceback.print_exception(e)
    return EXIT_FAILED, f"{type(e).__name__}: {e} (a bug; the traceback is in this host's log)"


class Agreement:
    """One attempt's keys in the coordination service; without one (a single process) the
    host's own values are all there is."""

    def __init__(self, run_id: str, attempt: int, index: int, count: int) -> None:
        self.client = boot.kv_client() if count > 1 else None
        self.prefix = f"jaxjob/{run_id}/prepare/{attempt}"
        self.index, self.count = index, count
        self._local: dict[str, str] = {}

    def set(self, key: str, value: str) -> None:
        """Store `value` unless the key has one already (the first writer wins)."""
        if self.client is None:
            self._local.setdefault(key, value)
            return
        from jax.errors import JaxRuntimeError

        try:
            self.client.key_value_set(f"{self.prefix}/{key}", value, allow_overwrite=False)
        except JaxRuntimeError as e:
            if "ALREADY_EXISTS" not in str(e):
                raise

    def get(self, key: str) -> str | None:
        if self.client is None:
            return self._local.get(key)
        from jax.errors import JaxRuntimeError

        try:
            return self.client.key_value_try_get(f"{self.prefix}/{key}")
        except JaxRuntimeError as e:
            if "NOT_FOUND" not in str(e):
                raise
            return None

    def under(self, folder: str) -> dict[int, str]:
        """{host index: value} of the keys `folder/<i>`."""
        if self.client is None:
            items = [(k, v) for k, v in self._local.items() if k.startswith(f"{folder}/")]
        else:
            items = self.client.key_value_dir_get(f"{self.prefix}/{folder}/")
        return {int(k.rsplit("/", 1)[1]): v for k, v in items}

    def outcome(self) -> tuple[int, str] | None:
        value = self.get("outcome")
        if value is None:
            return None
        code, _, text = value.partition("|")
        return int(code), text


class PrepareHost:
    """One host of a prepare job, from its share to the job's end."""

    def __init__(self, cfg: PrepareJobConfig, source: str, info: boot.BootInfo, claim: Any):
        from runfolder.store import ArtifactStore

        self.cfg, self.source, self.info, self.claim = cfg, source, info, claim
        self.index, self.count = info.process_index, info.process_count
        self.sync = Agreement(cfg.run.id, info.attempt, self.index, self.count)
        retry = RetryPolicy(total_s=cfg.runtime.storage_retry_s)
        root = join(cfg.run.output_uri, cfg.run.id)
        self.store = ArtifactStore(root, process_index=self.index, writer_index=0, retry=retry)
        self._leaving = threading.Lock()
        self._done = threading.Event()  # the job succeeded: the watcher stops
        self._record: dict[str, Any] = {}

    # ---- the job ---------------------------------------------------------------------------

    def run(self) -> int:
        p = self.cfg.prepare
        i, n = self.index, self.count
        click.echo(
            f"host {i} of {n} ({self.info.mode}, attempt {self.info.attempt}): preparing share "
            f"{i}/{n} of {p.out} (parts of {p.part_size} input bytes)"
        )
        try:
            if i == 0:
                self._start_record()
            if self.sync.client is not None:
                threading.Thread(
                    target=self._watch, name="jaxjob-prepare-watch", daemon=True
                ).start()
            report = self._share()
            summary = self._merge(report.plan, report.parts) if i == 0 else self._await_outcome()
        except BaseException as e:  # noqa: B036 - every way out of a share is a verdict
            code, text = _describe(e)
            self._leave(code, f"host {i}: {text}", own=text)
        self._done.set()
        _ignore_signals()  # the dataset is complete: a late SIGTERM must not turn it into 42
        dataset = manifest_uri(p.out)
        click.echo(
            f"{'wrote' if i == 0 else 'host 0 wrote'} {dataset} (fingerprint "
            f"{summary['fingerprint']}, {summary['total_tokens']} tokens in "
            f"{summary['total_documents']} documents; {summary['parts']} parts: "
            f"{summary['written']} written by this attempt, {summary['skipped']} already committed)"
        )
        if self.claim is not None:
            self.claim.release()
        boot.shutdown()
        return 0

    def _share(self):
        from runtime.data.prepare.build import prepare_share

        p, i, n = self.cfg.prepare, self.index, self.count
        started = time.monotonic()
        rep = prepare_share(
            p.inputs, p.tokenizer, p.out, (i, n), val_fraction=p.val_fraction, format=p.format,
            progress=False, text_field=p.text_field, workers=p.workers, part_bytes=p.part_bytes,
        )  # fmt: skip
        click.echo(
            f"host {i}: share {i}/{n} of plan {rep.plan}: wrote {len(rep.written)} "
            f"part(s){_parts(rep.written)}, skipped {len(rep.skipped)} already committed"
            f"{_parts(rep.skipped)}; {rep.parts} parts in all"
        )
        self.store.write_host_json(
            "share.json",
            {"attempt": self.info.attempt, "share": [i, n], "plan": rep.plan, "parts": rep.parts,
             "written": rep.written, "skipped": rep.skipped,
             "seconds": round(time.monotonic() - started, 3), "time": now()},
        )  # fmt: skip
        self.sync.set(
            f"share/{i}",
            json.dumps(
                {"plan": rep.plan, "written": len(rep.written), "skipped": len(rep.skipped)}
            ),
        )
        return rep

    def _merge(self, plan: str, parts: int) -> dict[str, Any]:
        """Host 0: once every share is written, the manifest over all of them."""
        from runtime.data.prepare.build import merge_shares

        out = self.cfg.prepare.out
        if self.count > 1:
            click.echo(
                f"host 0: waiting for the other {self.count - 1} host(s) to finish their shares"
            )
        self._wait_for(lambda: len(self.sync.under("share")) >= self.count)
        shares = {i: json.loads(v) for i, v in self.sync.under("share").items()}
        for i, s in sorted(shares.items()):
            if s["plan"] != plan:
                raise DataError(
                    f"host {i} listed other input files than host 0 (plan {s['plan']}, host 0's "
                    f"{plan}); every host must see the same inputs, unchanged during the job: "
                    "check that they are on storage all hosts share"
                )
        m = merge_shares(out, plan=plan)
        summary = {
            "plan": plan, "parts": parts,
            "written": sum(s["written"] for s in shares.values()),
            "skipped": sum(s["skipped"] for s in shares.values()),
            "dataset_manifest": manifest_uri(out), "fingerprint": m.fingerprint,
            "total_tokens": m.total_tokens, "total_documents": m.total_documents,
        }  # fmt: skip
        self._update_record(status="completed", **summary)
        self.sync.set("outcome", "0|" + json.dumps(summary))
        return summary

    def _await_outcome(self) -> dict[str, Any]:
        """Hosts 1..n-1: host 0's merge result (a failure ends this host from _leave)."""
        self._wait_for(lambda: self.sync.outcome() is not None)
        outcome = self.sync.outcome()
        assert outcome is not None
        code, text = outcome
        if code != 0:
            self._leave(code, text, own=None)
        return json.loads(text)

    def _wait_for(self, ready: Callable[[], bool]) -> None:
        # A Python loop, not a blocking call: SIGTERM is handled at once (start-up's handler).
        while not ready():
            time.sleep(POLL_S)

    # ---- failure: every host leaves with the same verdict ----------------------------------

    def _watch(self) -> None:
        """A failure published by another host ends this one too, even mid-share."""
        while not self._done.wait(POLL_S):
            try:
                outcome = self.sync.outcome()
            except Exception:  # the service is going away: JAX itself ends this process
                return
            if outcome is not None and outcome[0] != 0:
                self._leave(outcome[0], outcome[1], own=None)

    def _leave(self, code: int, text: str, *, own: str | None) -> NoReturn:
        """End this host on a failure: its own (`own`: its sentence; it publishes `text` as the
        job's outcome unless another host's came first) or another host's (`text`)."""
        if not self._leaving.acquire(blocking=False):
            _park()  # the other thread of this host is leaving already
        _ignore_signals()  # the verdict is given: finish leaving
        if own is not None:
            _best_effort(lambda: self.sync.set("outcome", f"{code}|{text}"))
            first = _best_effort(self.sync.outcome)
            if code == EXIT_RESTARTABLE and first is not None and first[0] not in (0, code):
                # The backend stops the other hosts when one fails: that failure is the verdict.
                own, (code, text) = None, first
        if own is not None:
            print(f"error: {own}", file=sys.stderr, flush=True)
        else:
            print(f"error: stopping this host (exit {code}): {text}", file=sys.stderr, flush=True)
        _best_effort(lambda: self.sync.set(f"left/{self.index}", str(code)))
        if self.index == 0:
            status = "interrupted" if code == EXIT_RESTARTABLE else "failed"
            _best_effort(lambda: self._update_record(status=status, error=text, exit_code=code))
            deadline = time.monotonic() + LEAVE_WAIT_S
            while self.sync.client is not None and time.monotonic() < deadline:
                if len(_best_effort(lambda: self.sync.under("left"), {})) >= self.count:
                    break
                time.sleep(POLL_S)
        if self.claim is not None:
            _best_effort(self.claim.release)
        for child in mp.active_children():  # tokenizing workers of an unfinished share
            child.terminate()
        sys.stdout.flush()
        sys.stderr.flush()
        hostlog.hard_exit(code)
        raise AssertionError("unreachable")  # hard_exit does not return

    # ---- the run's own records (host 0) ------------------------------------------------------

    def _start_record(self) -> None:
        self.store.write_text(SOURCE_CONFIG, self.source)
        created = now()
        if self.store.exists(MANIFEST):  # an earlier attempt's: keep when the run began
            created = self.store.read_json(MANIFEST).get("created", created)
        self._record = {"created": created}
        self._update_record(
            run_id=self.cfg.run.id, kind="prepare", status="running", output_uri=self.store.uri(),
            out=self.cfg.prepare.out, hosts=self.count, attempt=self.info.attempt,
        )  # fmt: skip

    def _update_record(self, **fields: Any) -> None:
        self._record.update(fields, updated=now())
        self.store.write_json(MANIFEST, self._record)


def _best_effort(fn: Callable[[], Any], default: Any = None) -> Any:
    """On the way out after a failure, a second failure must not change the verdict."""
    try:
        return fn()
    except Exception:
        return default


def _ignore_signals() -> None:
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)


def _park() -> NoReturn:
    while True:  # the thread that leaves ends the process
        try:
            time.sleep(3600)
        except BaseException:  # noqa: B036 - a late signal changes nothing now
            pass


def run_host(config: str, overrides: dict) -> int:
    """One host of a prepare job: boot, claim the run (host 0), tee the log, then the share."""
    from runtime.host.hostlog import HostLogTee, log_uri
    from runtime.run import owner

    contract = boot.BootContract.from_env()
    identity: dict[str, Any] = {}
    if contract.run_id:
        identity["id"] = contract.run_id
    if contract.output_uri:
        identity["output_uri"] = contract.output_uri
    cfg, source = load_prepare_config(config, merge(overrides, {"run": identity}))
    import jax

    # No steps to agree on: SIGTERM stays with start-up's handler (exit 42), not JAX's notifier.
    jax.config.update("jax_enable_preemption_service", False)
    info = boot.boot(
        timeout_s=cfg.runtime.boot_timeout_s,
        heartbeat_timeout_s=cfg.runtime.host_loss_timeout_s + 30,
    )
    run_root = join(cfg.run.output_uri, cfg.run.id)
    claim = owner.claim_run(
        run_root,
        run_id=cfg.run.id,
        is_writer=info.process_index == 0,
        lease_s=cfg.runtime.owner_lease_s,
        timeout_s=cfg.runtime.boot_timeout_s,
        retry=RetryPolicy(total_s=cfg.runtime.storage_retry_s),
    )
    HostLogTee(log_uri(run_root, info.attempt, info.process_index)).start()
    if claim is not None:
        claim.start_renewing()
    return PrepareHost(cfg, source, info, claim).run()
