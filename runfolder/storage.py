"""fsspec filesystems for local paths and gs:// URIs, with the GCS emulator settings applied.

Every module that touches files resolves them here, so a local path and gs:// behave the same.
"""

from __future__ import annotations

import errno
import os
import posixpath
import random
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import wait
from dataclasses import dataclass
from typing import Any, TypeVar

import fsspec

from jobspec.errors import StorageError, StorageFaultError
from runfolder.background import in_background


def configure_gcs_env() -> None:
    """Point every GCS client (gcsfs, tensorstore, google-cloud-storage) at the emulator if one is set.

    Real GCS needs nothing here. With STORAGE_EMULATOR_HOST set, tensorstore needs its own URL
    variable, and gcsfs must skip its gRPC bucket-layout probe that the emulator never answers.
    """
    host = os.environ.get("STORAGE_EMULATOR_HOST")
    if not host:
        return
    if not host.startswith("http"):
        host = "http://" + host
    os.environ.setdefault("TENSORSTORE_GCS_HTTP_URL", host)
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    os.environ.setdefault("EPATH_USE_TF", "false")


def join(base: str, *parts: str) -> str:
    out = base.rstrip("/")
    for p in parts:
        p = p.strip("/")
        if p:
            out = f"{out}/{p}"
    return out


def url_to_fs(uri: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """(filesystem, path-within-it) for a local path or URI; gs:// needs the `gcs` extra."""
    configure_gcs_env()
    kwargs: dict = {}
    if uri.startswith(("gs://", "gcs://")):
        try:
            import gcsfs  # noqa: F401
        except ImportError as e:
            raise StorageError(
                f"{uri} is a gs:// URI but gcsfs is not installed; install jaxjob with the 'gcs' extra "
                "(pip install 'jaxjob[gcs]')"
            ) from e
        # Every gcsfs request reports its failures here, so a try cut off by its deadline while
        # gcsfs was still retrying inside it names what the server answered (HTTP 503), not
        # only that it did not return.
        kwargs["session_kwargs"] = {"trace_configs": [_gcs_trace()]}
        emulator = os.environ.get("STORAGE_EMULATOR_HOST")
        if emulator:
            kwargs["token"] = "anon"
            kwargs["endpoint_url"] = (
                emulator if emulator.startswith("http") else "http://" + emulator
            )
    try:
        return fsspec.core.url_to_fs(uri, **kwargs)
    except (ValueError, ImportError) as e:
        raise StorageError(f"cannot open {uri}: {e}") from e


T = TypeVar("T")

# ---- storage faults: what is worth retrying, and what ends the job restartable ----------------

# Errors of the environment, not of the user: a full or failing disk, a network or server hiccup.
# ENOENT/EACCES/EROFS stay out: those are a wrong path or missing permission (exit 2).
_FAULT_ERRNOS = {
    errno.ENOSPC: "ENOSPC",
    errno.EDQUOT: "EDQUOT",
    errno.EIO: "EIO",
    errno.ETIMEDOUT: "ETIMEDOUT",
    errno.ECONNRESET: "ECONNRESET",
    errno.ECONNABORTED: "ECONNABORTED",
    errno.ECONNREFUSED: "ECONNREFUSED",
    errno.EPIPE: "EPIPE",
    errno.ENETUNREACH: "ENETUNREACH",
    errno.EHOSTUNREACH: "EHOSTUNREACH",
}
# Disk faults: retried only briefly (space may be freed), then the job ends restartable.
_DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EIO}
_RETRY_HTTP = {408, 429, 500, 502, 503, 504}
# What tensorstore/Orbax put in the text of the errors they re-raise (the type is lost there).
_FAULT_TEXT = re.compile(
    r"No space left on device|Disk quota exceeded|Input/output error|\bUNAVAILABLE\b|"
    r"DEADLINE_EXCEEDED|Service Unavailable|HTTP (?:status|response) code:? (?:5\d\d|429|408)|"
    r"http_response_code='(?:5\d\d|429|408)'",  # tensorstore's since 0.1.7x
)


@dataclass(frozen=True)
class Fault:
    reason: str  # the original error, short: "No space left on device (ENOSPC)"
    disk: bool  # a local disk fault (retried briefly) rather than a network/server one


def _chain(e: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    cur: BaseException | None = e
    while cur is not None and len(out) < 8 and cur not in out:
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out


def _one_line(text: str, limit: int = 240) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def storage_fault(e: BaseException) -> Fault | None:
    """The fault behind `e` (walking its causes) if storage failed under a correct run; None for
    anything else (a missing file, no permission, a bug), which must not be retried or restarted."""
    for x in _chain(e):
        if isinstance(x, OSError) and x.errno in _FAULT_ERRNOS:
            text = x.strerror or os.strerror(x.errno)
            return Fault(f"{text} ({_FAULT_ERRNOS[x.errno]})", x.errno in _DISK_ERRNOS)
        if isinstance(x, NoAnswer):
            return Fault(str(x), False)
        if isinstance(x, TimeoutError):  # asyncio's and fsspec's timeouts are this class too
            return Fault(_one_line(f"timed out ({x})" if str(x) else "timed out"), False)
        code = getattr(x, "code", None) if type(x).__name__ == "HttpError" else None
        code = getattr(x, "status", code) if type(x).__name__ == "ClientResponseError" else code
        if isinstance(code, int | str) and str(code).isdigit():
            if int(code) in _RETRY_HTTP:
                return Fault(_one_line(f"HTTP {code}: {x}"), False)
            continue
        mod = type(x).__module__
        if mod.startswith("aiohttp") and isinstance(x, Exception):
            # Connection refused/reset, server disconnected, payload cut: the network's fault.
            return Fault(_one_line(f"{type(x).__name__}: {x}"), False)
        if mod.startswith("requests") and type(x).__name__ in (
            "ProxyError",  # gcsfs's translation of a 502
            "ConnectionError",
            "Timeout",
            "ReadTimeout",
            "ChunkedEncodingError",
        ):
            return Fault(_one_line(f"{type(x).__name__}: {x}" if str(x) else "HTTP 502"), False)
        m = _FAULT_TEXT.search(str(x))
        if m:
            return _fault_from_text(str(x), m.group(0))
    return None


_DISK_TEXT = {
    "No space left on device": "ENOSPC",
    "Disk quota exceeded": "EDQUOT",
    "Input/output error": "EIO",
}
_QUOTED_PATH = re.compile(r'"((?:/|gs://)[^"]+)"')


def _fault_from_text(text: str, found: str) -> Fault:
    """A fault only known from an error's text (tensorstore's, through Orbax): keep the cause and
    the innermost path it names, not the whole nested message."""
    if found in _DISK_TEXT:
        paths = _QUOTED_PATH.findall(text)
        where = f" writing {paths[-1]}" if paths else ""
        return Fault(f"{found} ({_DISK_TEXT[found]}){where}", True)
    if found.startswith("http_response_code="):
        # `ABORTED: Error writing gs://b/x: All 2 retry attempts failed: <message>
        # [http_response_code='503'] [http_response_body='...']`: the code and the sentence.
        sentence = text.split(" [", 1)[0]
        return Fault(_one_line(f"HTTP {found[-4:-1]}: {sentence}"), False)
    return Fault(_one_line(text), False)


@dataclass(frozen=True)
class RetryPolicy:
    """How long storage calls are retried before a fault ends the job (exit 45, restartable).

    gs:// (5xx, 429, timeouts, connection errors): exponential backoff with full jitter until
    `total_s` (runtime.storage_retry_s) has passed. A local disk fault (ENOSPC, EIO):
    `disk_tries` tries `disk_wait_s` apart, since freeing space takes a person, not a second.
    Every try has a deadline: `call_s`, and never past the end of `total_s` (at least
    MIN_TRY_S); a try that has not returned by then is a failed try ("did not answer"), so a
    server that stops answering costs `total_s`, not gcsfs's minutes per request.
    """

    total_s: float = 120.0
    initial_s: float = 0.5
    max_s: float = 20.0
    disk_tries: int = 3
    disk_wait_s: float = 0.5
    call_s: float = 60.0

    def backoff_s(self, retry: int) -> float:
        """The longest wait before retry `retry` (0 for the first): initial_s doubling up to
        max_s. with_retries waits a random part of it (full jitter)."""
        return min(self.max_s, self.initial_s * 2**retry)


DEFAULT_RETRY = RetryPolicy()
_process_policy = DEFAULT_RETRY


def use_policy(policy: RetryPolicy) -> None:
    """The policy of `with_retries` calls given none (a run's data reads, deep in Grain's reader
    threads): a run sets its runtime.storage_retry_s here once, at its start."""
    global _process_policy
    _process_policy = policy


# Called before each retry's wait: a host that retries storage is alive and working, so the
# host watchdog counts a retry as progress (a stall is a host that does nothing).
_retry_listeners: list[Callable[[], None]] = []


def on_retry(listener: Callable[[], None], *, remove: bool = False) -> None:
    """Add (or with remove=True, remove) a function called before every storage retry."""
    if remove:
        if listener in _retry_listeners:
            _retry_listeners.remove(listener)
    elif listener not in _retry_listeners:
        _retry_listeners.append(listener)


def with_retries(fn: Callable[[], T], what: str, policy: RetryPolicy | None = None) -> T:
    """`fn()`, retried while it fails with a storage fault or does not answer in time; once the
    retries are spent, the fault is a StorageFaultError naming `what` (e.g. "write
    gs://b/run/x.json") and the original error. Any other exception passes through untouched,
    for the caller to put in its own words. Without `policy`, the process's (`use_policy`).

    After a stop was asked for (`interrupt`) a call is given up STOP_GRACE_S after the stop (or
    after it started), retries included; once an earlier call gave up on a storage that does not
    answer, a call gets one short try (DOWN_TRY_S) and no retries. The process is on its way out
    then and must not be held there."""
    policy = policy or _process_policy
    start = time.monotonic()
    tries = 0
    while True:
        tries += 1
        state = _state
        down = state.down
        try:
            result = _attempt(fn, _try_limit(policy, start, down is not None), since=start)
        except Exception as e:
            fault = storage_fault(e)
            if fault is None:
                raise
            waited = time.monotonic() - start
            if fault.disk:
                again = tries < policy.disk_tries
                delay = policy.disk_wait_s
            else:
                delay = random.uniform(0, policy.backoff_s(tries - 1))
                again = waited + delay < policy.total_s
            stopped = state.stop_reason
            if stopped is not None and state.stop_at is not None:  # retried only briefly
                again = again and time.monotonic() + delay < _stop_end(start, state.stop_at)
            if not again or down is not None:
                hint = (
                    "free space on it (or fix the disk) and restart the job"
                    if fault.disk
                    else "the job is restartable once the storage answers again"
                )
                count = "1 try" if tries == 1 else f"{tries} tries"
                by = f", no more after {stopped}" if stopped is not None else ""
                err = StorageFaultError(
                    f"cannot {what}: {fault.reason} (after {count} over {waited:.0f} s{by}); {hint}"
                )
                if not fault.disk:
                    state.gave_up(str(err))
                raise err from e
            for listener in list(_retry_listeners):
                listener()
            _pause(delay)
        else:
            if down is not None:
                state.down = None  # it answers again
            return result


# ---- deadlines: a storage call that does not answer is a failed try --------------------------

MIN_TRY_S = 1.0  # the shortest deadline a try gets, even at the very end of the budget
STOP_GRACE_S = 5.0  # after a stop, how long a call in flight (or started) still waits for an answer
DOWN_TRY_S = 3.0  # the one try a call gets once an earlier call gave up on the storage
_POLL_S = 0.2


class NoAnswer(TimeoutError):
    """A storage call that did not return by its deadline. It is left running in its daemon
    thread (a blocked read or socket cannot be cancelled from outside) and its result dropped;
    the next try starts afresh."""


class _State:
    """What every storage call of this process shares: a stop asked for, and whether the storage
    stopped answering (a call gave up on it, and none has succeeded since)."""

    def __init__(self) -> None:
        self.stop_reason: str | None = None
        self.stop_at: float | None = None
        self.wake = threading.Event()  # set by a stop: no retry waits out its delay
        self.down: str | None = None  # the sentence of the call that gave up
        self.first_give_up: str | None = None  # the first such sentence (what the run says)
        self.last_http_fault: tuple[float, str] | None = None  # (monotonic time, what)

    def gave_up(self, sentence: str) -> None:
        self.down = sentence
        if self.first_give_up is None:
            self.first_give_up = sentence


_state = _State()


def interrupt(reason: str) -> None:
    """A stop was asked for (`reason`: "SIGTERM"): from now on no storage call is retried, and
    one that does not answer is given up STOP_GRACE_S after the stop (or after it started)."""
    state = _state
    if state.stop_reason is None:
        state.stop_reason, state.stop_at = reason, time.monotonic()
    state.wake.set()


def gave_up() -> str | None:
    """The sentence of the first call that gave up on a storage that did not answer or kept
    failing (the StorageFaultError the run ends with), or None."""
    return _state.first_give_up


def answers(fn: Callable[[], Any], within_s: float) -> str | None:
    """None if `fn()` (one storage call) returns within `within_s`, or fails in a way that is an
    answer (a missing file); else why the storage does not answer. One try, no retries: for a
    watcher asking whether the storage is alive."""
    try:
        _attempt(fn, within_s)
    except Exception as e:
        fault = storage_fault(e)
        return None if fault is None else fault.reason
    _state.down = None  # it answers again
    return None


def _try_limit(policy: RetryPolicy, start: float, down: bool) -> float:
    left = policy.total_s - (time.monotonic() - start)
    limit = min(policy.call_s, max(left, MIN_TRY_S))
    return min(limit, DOWN_TRY_S) if down else limit


def _pause(delay: float) -> None:
    """The wait before a retry; a stop ends it at once (the retry is then the last try)."""
    _state.wake.wait(delay)


def _stop_end(since: float, stop_at: float) -> float:
    return max(since, stop_at) + STOP_GRACE_S


def _attempt(fn: Callable[[], T], limit_s: float, *, since: float | None = None) -> T:
    """`fn()` in a daemon thread, waited for at most `limit_s` (after a stop, at most until
    STOP_GRACE_S after the stop or `since`, when the call began); NoAnswer if it has not
    returned by then. The caller's thread only waits, so signal handlers run."""
    began = time.monotonic()
    future = in_background(fn, "jaxjob-storage-call")
    while not wait([future], timeout=_POLL_S).done:
        now, state = time.monotonic(), _state
        end = began + limit_s
        if since is not None and state.stop_at is not None:
            end = min(end, _stop_end(since, state.stop_at))
        if now >= end:
            raise NoAnswer(_no_answer(now - began, began))
    return future.result()


def _no_answer(took: float, began: float) -> str:
    """Why a try was cut off: what the server answered meanwhile, if it answered at all."""
    seen = _state.last_http_fault
    if seen is not None and seen[0] >= began:
        return f"{seen[1]} (still failing when the try was cut off after {took:.0f} s)"
    return f"the storage did not answer within {took:.0f} s"


def _seen_http_fault(what: str) -> None:
    _state.last_http_fault = (time.monotonic(), what)


_trace: Any = None


def _gcs_trace() -> Any:
    """One aiohttp TraceConfig for every gcsfs session (one object, so fsspec's instance cache
    still matches): it notes each retryable HTTP status and each failed connection."""
    global _trace
    if _trace is None:
        import aiohttp

        async def on_end(_session: Any, _ctx: Any, params: Any) -> None:
            status = params.response.status
            if status in _RETRY_HTTP:
                _seen_http_fault(f"HTTP {status}: {params.response.reason}")

        async def on_exception(_session: Any, _ctx: Any, params: Any) -> None:
            e = params.exception
            _seen_http_fault(_one_line(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__))

        class Trace(aiohttp.TraceConfig):
            def __reduce__(self) -> Any:  # a pickled filesystem finds this process's own
                return (_gcs_trace, ())

        trace = Trace()
        trace.on_request_end.append(on_end)
        trace.on_request_exception.append(on_exception)
        _trace = trace
    return _trace


# ---- parted objects: appends on gs:// whose cost does not grow with the file ------------------

# GCS objects cannot be appended to. A growing file (metrics JSONL, a host log) is kept as numbered
# part objects `<name>.parts/000000<ext>`, …: the last part is rewritten while it is under
# PART_BYTES, then a new one starts. Readers take a plain object of that name (if any) first,
# then the parts in order. Locally, files stay plain appended files.
PART_BYTES = 64 * 1024  # an append uploads 32 KiB on average; 1 MB of rows is 16 parts
PARTS_SUFFIX = ".parts"
_PART_NAME = re.compile(r"^(\d{6,})(\.[^/]*)?$")


def parts_dir(path: str) -> str:
    return path.rstrip("/") + PARTS_SUFFIX


def part_path(path: str, index: int) -> str:
    ext = posixpath.splitext(path)[1]
    return f"{parts_dir(path)}/{index:06d}{ext}"


def list_parts(fs: fsspec.AbstractFileSystem, path: str) -> list[tuple[int, str]]:
    """(index, path) of every part of `path`, in order; none if it has no parts."""
    try:
        entries = fs.ls(parts_dir(path), detail=False)
    except FileNotFoundError:
        return []
    found = []
    for p in entries:
        m = _PART_NAME.match(posixpath.basename(str(p).rstrip("/")))
        if m:
            found.append((int(m.group(1)), str(p)))
    return sorted(found)


def parted_exists(fs: fsspec.AbstractFileSystem, path: str) -> bool:
    return bool(fs.exists(path)) or bool(list_parts(fs, path))


def read_parted(fs: fsspec.AbstractFileSystem, path: str) -> bytes:
    """The whole content of `path`: a plain object of that name, then its parts in order.
    FileNotFoundError if there is neither."""
    plain = fs.exists(path) and not fs.isdir(path)
    parts = [p for _, p in list_parts(fs, path)]
    if not plain and not parts:
        raise FileNotFoundError(path)
    chunks = [bytes(fs.cat_file(path))] if plain else []
    if parts:
        got = fs.cat(parts) if len(parts) > 1 else {parts[0]: fs.cat_file(parts[0])}
        # fs.cat of several paths keys by path (fetched concurrently); keep the parts' order.
        by_name = {str(k).rstrip("/").split("://", 1)[-1]: v for k, v in got.items()}
        # Strict: a part missing from the answer is an error, never silently lost rows.
        chunks += [bytes(by_name[p.split("://", 1)[-1]]) for p in parts]
    return b"".join(chunks)


def read_parted_tail(fs: fsspec.AbstractFileSystem, path: str, nbytes: int) -> bytes:
    """About the last `nbytes` of `path` (whole parts, or the plain file's end); b"" if absent."""
    parts = list_parts(fs, path)
    out = b""
    for _, p in reversed(parts):
        out = bytes(fs.cat_file(p)) + out
        if len(out) >= nbytes:
            return out
    if fs.exists(path) and not fs.isdir(path):
        size = fs.size(path)
        start = max(0, size - (nbytes - len(out)))
        out = bytes(fs.cat_file(path, start=start)) + out
    return out
