"""One live owner per run directory: `<run>/owner.json`, claimed before anything is written.

The writer host of a training job claims the run before it touches the index, Orbax, artifacts
or metrics, renews the claim's lease from a daemon thread, and releases it when `train` ends
(normally or by an exception; an `atexit` hook is the safety net). Every other host of the job
waits for the writer's answer through the jax.distributed key-value store
(`jaxjob/<run>/owner/<attempt>`), so a refused job exits on every host with the same sentence.
Read-only commands (inspect, eval, sample, checkpoint listings) never claim.

The record: run id, submission id (JAXJOB_SUBMISSION_ID: what every backend gives all hosts and
all restarted attempts of one submission), attempt, host, pid, the pid's start time, boot id and
pid namespace, start time, last renewal and lease length, and a random token naming the claim.

When an existing claim may be taken over (`takeover_reason`), checked in this order:
  * successor: same run id, same (non-empty) submission id and a lower attempt: a restarted
    attempt of the same job takes over at once, whatever state the old attempt's writer is in
    (the backend has already stopped it);
  * dead owner on this machine: same host name, boot id and pid namespace, and the pid is gone
    or now belongs to a process that started at another time (a reused pid): at once;
  * expired lease: `renewed` is more than `runtime.owner_lease_s` seconds old (host clocks must
    agree to well within the lease); this is how a dead owner on another host is detected;
  * an unreadable record (not JSON) is taken over too: it cannot name a live owner.
Anything else is a live owner: RunOwnedError, one sentence naming host, pid, start and attempt.

Atomicity. Locally, the read-decide-write of a claim, a renewal and a release run under an
exclusive `flock` of `<run>/.owner.lock` (never deleted, so every process locks the same inode),
and owner.json is replaced by an atomic rename. On gs:// every write is a conditional upload:
a first claim with `ifGenerationMatch=0` (create only if absent), a takeover or renewal with the
generation that was read, so of two takers of one stale record only one can win (the other gets
412 and reads the winner's record). A release deletes only a record whose token is ours (by
generation on real GCS; the fake-gcs-server used by the tests ignores DELETE preconditions).

An owner that finds at renewal that its claim is gone or someone else's (it was suspended or cut
off past its lease and was taken over) stops at once with exit 2, so it writes nothing more.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime as dt
import json
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, wait
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import quote

from jobspec.errors import JaxjobError, RunOwnedError, StorageError
from jobspec.exit_codes import EXIT_BAD_INPUT
from jobspec.run_config import is_remote
from runfolder.background import in_background
from runfolder.layout import OWNER, OWNER_LOCK
from runfolder.storage import (
    DEFAULT_RETRY,
    NoAnswer,
    RetryPolicy,
    join,
    url_to_fs,
    with_retries,
)

# ---- who we are ---------------------------------------------------------------------------------


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _boot_id() -> str:
    return _read("/proc/sys/kernel/random/boot_id")


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def pid_start(pid: int) -> str | None:
    """The start time of `pid` in clock ticks since boot (field 22 of /proc/<pid>/stat), or None
    when no such process runs; with the boot id it tells a live owner from a reused pid."""
    stat = _read(f"/proc/{pid}/stat")
    if not stat:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[19] if len(fields) > 19 else None


def _utc(epoch: float) -> str:
    return dt.datetime.fromtimestamp(epoch, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class OwnerRecord:
    run_id: str
    submission_id: str | None
    attempt: int
    host: str
    pid: int
    pid_start: str | None
    boot_id: str
    pid_namespace: str
    started: str  # UTC, for people
    renewed_epoch: float
    lease_s: float
    token: str

    @property
    def renewed(self) -> str:
        return _utc(self.renewed_epoch)

    def to_bytes(self) -> bytes:
        return (json.dumps({**asdict(self), "renewed": self.renewed}, indent=2) + "\n").encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> OwnerRecord | None:
        """The record, or None when it is not one (torn, hand-edited, another format)."""
        try:
            raw = json.loads(data)
            return cls(**{k: raw[k] for k in cls.__dataclass_fields__})
        except (ValueError, TypeError, KeyError):
            return None

    @classmethod
    def mine(cls, run_id: str, submission_id: str | None, attempt: int, lease_s: float):
        now = time.time()
        return cls(
            run_id=run_id,
            submission_id=submission_id or None,
            attempt=attempt,
            host=socket.gethostname(),
            pid=os.getpid(),
            pid_start=pid_start(os.getpid()),
            boot_id=_boot_id(),
            pid_namespace=_pid_namespace(),
            started=_utc(now),
            renewed_epoch=now,
            lease_s=lease_s,
            token=uuid.uuid4().hex,
        )


def takeover_reason(
    old: OwnerRecord | None, me: OwnerRecord, lease_s: float, now: float | None = None
) -> str | None:
    """Why `me` may replace the claim `old`, or None when `old` is a live owner (module doc)."""
    if old is None:
        return "the previous owner record is unreadable"
    if old.token == me.token:
        return "it is this process's own claim"
    if (
        old.submission_id
        and old.submission_id == me.submission_id
        and old.run_id == me.run_id
        and old.attempt < me.attempt
    ):
        return f"attempt {me.attempt} succeeds attempt {old.attempt} of the same submission"
    same_machine = (
        old.host == me.host
        and old.boot_id == me.boot_id
        and old.pid_namespace == me.pid_namespace
        and bool(me.boot_id)
    )
    if same_machine:
        started = pid_start(old.pid)
        if started is None:
            return f"its process {old.pid} on this host has exited"
        if old.pid_start is not None and started != old.pid_start:
            return f"its pid {old.pid} now belongs to another process"
    age = (time.time() if now is None else now) - old.renewed_epoch
    if age > lease_s:
        return f"its lease was last renewed {age:.0f} s ago (runtime.owner_lease_s={lease_s:g})"
    return None


def owned_message(run_id: str, uri: str, old: OwnerRecord) -> str:
    return (
        f"run {run_id!r} at {uri} is in use by host {old.host} pid {old.pid} (started "
        f"{old.started}, attempt {old.attempt}); wait for it to finish or use another run.id"
    )


# ---- where the record lives ---------------------------------------------------------------------


class _LocalSlot:
    """owner.json in a local directory; every change under an exclusive flock."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.path = os.path.join(root, OWNER)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        import fcntl

        os.makedirs(self.root, exist_ok=True)
        fd = os.open(os.path.join(self.root, OWNER_LOCK), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing drops the lock

    def read(self) -> tuple[bytes | None, Any]:
        try:
            with open(self.path, "rb") as f:
                return f.read(), None
        except FileNotFoundError:
            return None, None

    def write(self, data: bytes, generation: Any) -> Any:
        tmp = f"{self.path}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        return None

    def delete(self, generation: Any) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.path)


class _GcsSlot:
    """owner.json on gs://, written only by generation-conditional uploads."""

    def __init__(self, fs: Any, root: str) -> None:
        self.fs = fs
        self.bucket, _, prefix = root.partition("/")
        self.key = join(prefix, OWNER).lstrip("/")
        self.meta_url = (
            f"{fs._location}/storage/v1/b/{quote(self.bucket)}/o/{quote(self.key, safe='')}"
        )

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        yield  # the generation preconditions are the lock

    def read(self) -> tuple[bytes | None, Any]:
        try:
            meta = self.fs.call("GET", self.meta_url, json_out=True)
            gen = meta["generation"]
            _, data = self.fs.call(
                "GET",
                self.meta_url.replace("/storage/v1/", "/download/storage/v1/", 1),
                alt="media",
                generation=gen,
            )
        except FileNotFoundError:
            return None, 0
        return bytes(data), gen

    def write(self, data: bytes, generation: Any) -> Any:
        """Upload if the object's generation is still `generation` (0: absent); FileExistsError
        (HTTP 412) when someone else changed it first."""
        meta = json.dumps({"name": self.key, "contentType": "application/json"})
        body = (
            (
                f"--==0==\nContent-Type: application/json; charset=UTF-8\n\n{meta}\n--==0==\n"
                "Content-Type: application/json\n\n"
            ).encode()
            + data
            + b"\n--==0==--"
        )
        out = self.fs.call(
            "POST",
            f"{self.fs._location}/upload/storage/v1/b/{quote(self.bucket)}/o",
            uploadType="multipart",
            ifGenerationMatch=str(generation),
            headers={"Content-Type": 'multipart/related; boundary="==0=="'},
            data=body,
            json_out=True,
        )
        return out["generation"]

    def delete(self, generation: Any) -> None:
        with contextlib.suppress(FileNotFoundError, FileExistsError):
            self.fs.call("DELETE", self.meta_url, ifGenerationMatch=str(generation))


def _slot(root_uri: str) -> _LocalSlot | _GcsSlot:
    fs, root = url_to_fs(root_uri)
    return _GcsSlot(fs, root) if is_remote(root_uri) else _LocalSlot(root)


def _storage_error(uri: str, e: Exception) -> StorageError:
    """A claim that failed on the storage: a fault (ENOSPC, EIO, 5xx, timeouts) outlasted the
    retries (exit 45, restartable); anything else is what the user gave (exit 2)."""
    if isinstance(e, StorageError):
        return e
    return StorageError(
        f"cannot claim the run at {uri}: {e.strerror or e if isinstance(e, OSError) else e}; "
        "choose a writable run.output_uri"
    )


# ---- the claim ------------------------------------------------------------------------------------


class RunClaim:
    """This process's claim on one run directory, renewed until `release()`."""

    def __init__(self, root_uri: str, record: OwnerRecord, slot) -> None:
        self.root_uri = root_uri
        self.record = record
        self.how = ""
        self._slot = slot
        self._stop = threading.Event()
        self._mutex = threading.Lock()  # renewal and release never interleave
        self._released = False
        self._warned = False
        self._thread: threading.Thread | None = None

    @property
    def uri(self) -> str:
        return join(self.root_uri, OWNER)

    def start_renewing(self) -> None:
        interval = max(0.5, min(5.0, self.record.lease_s / 4))
        self._thread = threading.Thread(
            target=self._renew_loop, args=(interval,), name="jaxjob-owner-lease", daemon=True
        )
        self._thread.start()

    def _renew_loop(self, interval: float) -> None:
        renewed = time.monotonic()
        pending: Future | None = None  # a renewal that did not answer in time, still running
        while not self._stop.wait(interval):
            try:
                # Each renewal has until the next one is due: one whose storage stopped answering
                # is a failed try like any fault (never this thread stuck for good), and is not
                # started again on top of itself.
                if pending is None or pending.done():
                    pending = in_background(self.renew, "jaxjob-owner-renew")
                if not wait([pending], timeout=interval).done:
                    raise NoAnswer(f"{self.uri} did not answer within {interval:g} s")
                pending.result()  # its fault, if it failed
                pending = None
                renewed = time.monotonic()
            except RunOwnedError as e:
                from runtime.host import hostlog

                print(f"error: {e}", file=sys.stderr, flush=True)
                hostlog.hard_exit(EXIT_BAD_INPUT)
            except Exception as e:  # a passing storage fault: the lease is long enough to retry
                # Said only once half the lease has gone unrenewed: a fault that passes (or one
                # the run itself reports a moment later, a full disk) needs no line of its own.
                if not self._warned and time.monotonic() - renewed > self.record.lease_s / 2:
                    self._warned = True
                    print(
                        f"warning: could not renew the claim on {self.uri} ({e}); retrying",
                        file=sys.stderr,
                        flush=True,
                    )

    def renew(self) -> None:
        with self._mutex:
            if self._released:
                return
            with self._slot.locked():
                data, gen = self._slot.read()
                current = OwnerRecord.from_bytes(data) if data is not None else None
                if current is None or current.token != self.record.token:
                    who = f"host {current.host} pid {current.pid}" if current else "nobody"
                    self._released = True
                    raise RunOwnedError(
                        f"lost the claim on run {self.record.run_id!r}: {self.uri} now names "
                        f"{who} (this process was not renewing its lease for over "
                        f"{self.record.lease_s:g} s); stopping without writing more"
                    )
                self.record.renewed_epoch = time.time()
                try:
                    self._slot.write(self.record.to_bytes(), gen)
                except FileExistsError:
                    pass  # changed between read and write: the next renewal reads who has it

    def release(self) -> None:
        """Stop renewing and remove the record if it is still ours; safe to call twice. Bounded
        in time: a renewal stuck on a storage that stopped answering (it holds the mutex) or a
        removal that is not answered is left behind, and the lease lapses by itself."""
        self._stop.set()
        if _held.get(_key(self.root_uri)) is self:
            try:
                with_retries(self._remove, f"release {self.uri}", _RELEASE_RETRY)
            except Exception as e:  # the lease lapses by itself; never mask the run's own end
                from runfolder.storage import gave_up

                if gave_up() is None:  # else the run's own sentence says the storage failed
                    print(
                        f"warning: could not release {self.uri} ({e})", file=sys.stderr, flush=True
                    )
        _held.pop(_key(self.root_uri), None)

    def _remove(self) -> None:
        with self._mutex:
            if self._released:
                return
            with self._slot.locked():
                data, gen = self._slot.read()
                current = OwnerRecord.from_bytes(data) if data is not None else None
                if current is not None and current.token == self.record.token:
                    self._slot.delete(gen)
            self._released = True  # only once removed: a failed try is tried again


_held: dict[str, RunClaim] = {}  # by _key(root_uri)
_RELEASE_RETRY = RetryPolicy(total_s=10.0, call_s=10.0)  # best effort: the lease lapses anyway


def _key(root_uri: str) -> str:
    return root_uri.rstrip("/") if is_remote(root_uri) else os.path.abspath(root_uri)


def acquire(
    root_uri: str,
    *,
    run_id: str,
    submission_id: str | None,
    attempt: int,
    lease_s: float,
    tries: int = 5,
    retry: RetryPolicy = DEFAULT_RETRY,
) -> RunClaim:
    """Claim `root_uri` for this process (again: the claim it already holds), or RunOwnedError."""
    if _key(root_uri) in _held:
        return _held[_key(root_uri)]
    slot = _slot(root_uri)
    me = OwnerRecord.mine(run_id, submission_id, attempt, lease_s)
    uri = join(root_uri, OWNER)

    def attempt() -> tuple[str, Any] | None:
        """One read-decide-write; None when another taker won this generation."""
        try:
            with slot.locked():
                data, gen = slot.read()
                how = "claimed"
                if data is not None:
                    old = OwnerRecord.from_bytes(data)
                    reason = takeover_reason(old, me, lease_s)
                    if reason is None:
                        assert old is not None
                        raise RunOwnedError(owned_message(run_id, root_uri, old))
                    who = f" from host {old.host} pid {old.pid}" if old else ""
                    how = f"took over{who}: {reason}"
                slot.write(me.to_bytes(), gen)
                return how, gen
        except FileExistsError:
            return None  # read the record the winner wrote, next try

    for _ in range(tries):
        try:
            # The shared retry policy: a passing fault is retried, a lasting one is exit 45.
            won = with_retries(attempt, f"claim the run at {uri}", retry)
        except (OSError, StorageError) as e:
            raise _storage_error(uri, e) from e
        if won is None:
            continue
        claim = RunClaim(root_uri, me, slot)
        claim.how = won[0]
        _held[_key(root_uri)] = claim
        claim.start_renewing()
        return claim
    raise StorageError(
        f"could not claim {uri}: it changed {tries} times while being claimed; check that no "
        "other process is starting the same run and start again"
    )


def release(root_uri: str) -> None:
    claim = _held.get(_key(root_uri))
    if claim is not None:
        claim.release()


@atexit.register
def _release_all() -> None:
    # A process that ends by sys.exit or an uncaught exception leaves no fresh claim behind.
    for claim in list(_held.values()):
        claim.release()


# ---- every host agrees ----------------------------------------------------------------------------


def owner_key(run_id: str, attempt: int) -> str:
    return f"jaxjob/{run_id}/owner/{attempt}"


def claim_run(
    root_uri: str,
    *,
    run_id: str,
    is_writer: bool,
    lease_s: float,
    timeout_s: float = 300.0,
    retry: RetryPolicy = DEFAULT_RETRY,
) -> RunClaim | None:
    """The writer claims the run; every host returns or raises the writer's outcome.

    The submission id and attempt come from the env contract (boot); without a coordination
    service (one process) the writer's result is the only one.
    """
    from runtime.host import boot

    info = boot.current()
    attempt = info.attempt if info else 0
    submission = (info.submission_id if info else None) or os.environ.get("JAXJOB_SUBMISSION_ID")
    client = boot.kv_client()
    key = owner_key(run_id, attempt)
    if is_writer:
        if _key(root_uri) in _held:  # claimed already (the worker claims before its host log)
            return _held[_key(root_uri)]
        try:
            claim = acquire(
                root_uri,
                run_id=run_id,
                submission_id=submission,
                attempt=attempt,
                lease_s=lease_s,
                retry=retry,
            )
        except BaseException as e:
            if client is not None:
                code = e.exit_code if isinstance(e, JaxjobError) else EXIT_BAD_INPUT
                text = str(e) if isinstance(e, JaxjobError) else f"{type(e).__name__}: {e}"
                _publish(client, key, f"{code}|{text}")
                _end_together(boot, text, code)
            raise
        if client is not None:
            _publish(client, key, "ok")
        if claim.how.startswith("took over"):
            print(f"note: run {run_id!r}: {claim.how}", file=sys.stderr, flush=True)
        return claim
    if client is None:
        return None
    from jax.errors import JaxRuntimeError

    try:
        value = client.blocking_key_value_get(key, int(timeout_s * 1000))
    except JaxRuntimeError as e:
        raise JaxjobError(
            f"the writer host did not say within {timeout_s:g} s whether it claimed the run "
            f"({key} stayed unset: {str(e).splitlines()[0]}); check that every process is running"
        ) from None
    if value == "ok":
        return None
    code, _, text = value.partition("|")
    err: JaxjobError = RunOwnedError(text) if int(code) == EXIT_BAD_INPUT else JaxjobError(text)
    _end_together(boot, text, int(code))
    raise err  # not reached: _end_together exits


def _end_together(boot: Any, message: str, code: int) -> None:
    """Every host of a refused job (each of them reaches here) leaves the cluster together
    (JAX's shutdown barrier: the writer, which hosts the coordination service, stays until the
    others have read its answer), then ends with `error: message` and `code` without Python's
    shutdown: the distributed runtime's threads could otherwise abort a host at interpreter
    exit (return code -6 after its sentence). Nothing was written, so nothing is left to flush."""
    from runtime.host import hostlog

    with contextlib.suppress(Exception):
        boot.shutdown()
    hostlog.fatal(message, code)


def _publish(client: Any, key: str, value: str) -> None:
    from jax.errors import JaxRuntimeError

    with contextlib.suppress(JaxRuntimeError):  # ALREADY_EXISTS: this attempt already answered
        client.key_value_set(key, value, allow_overwrite=False)
