"""A gs:// server that stops answering (a frozen or SIGSTOPped server: connections are accepted,
requests are never answered) must not hang a single-process run. Every storage call has a deadline
inside `runtime.storage_retry_s`, so the run ends with exit 45 and one sentence once the budget is
spent; and a SIGTERM while a call is stuck ends the run within seconds, whatever the budget.

The stall comes from a proxy in front of the emulator that holds every request from the first
metrics upload on; the test waits for that held request (an event, not a sleep) before it
judges or signals, so the run is inside the stuck call however slow the machine is."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from faults.gcs_proxy import GcsFaultProxy

import runfolder.storage as storage
from jobspec.errors import StorageFaultError
from jobspec.exit_codes import EXIT_STORAGE_FAULT

from runs import ROOT, stderr_lines, tiny_config, write_config

# ---- with_retries itself: a call that blocks for real (an Event nobody sets) -----------------


def _bounded(fn, bound_s: float = 60):
    """`fn()` in a thread; fails (rather than hangs) if it has not returned within `bound_s`."""
    pool = ThreadPoolExecutor(1)
    try:
        return pool.submit(fn).result(timeout=bound_s)
    finally:
        pool.shutdown(wait=False)


@pytest.fixture
def fresh_storage_state(monkeypatch):
    """A stop or a storage known down stays in this test (the module's state is process-wide)."""
    monkeypatch.setattr(storage, "_state", storage._State())
    never = threading.Event()
    yield never
    never.set()  # lets the calls left behind end


def test_a_call_that_does_not_answer_is_a_failed_try(fresh_storage_state) -> None:
    never = fresh_storage_state

    def call(what: str, policy: storage.RetryPolicy = storage.DEFAULT_RETRY):
        def run():
            with pytest.raises(StorageFaultError) as e:
                storage.with_retries(never.wait, what, policy)
            return e.value

        t0 = time.monotonic()
        return _bounded(run), time.monotonic() - t0

    err, took = call("write gs://b/x", storage.RetryPolicy(total_s=2))
    assert str(err).startswith("cannot write gs://b/x: the storage did not answer within 2 s ("), (
        err
    )
    assert "restartable" in str(err) and err.exit_code == EXIT_STORAGE_FAULT
    assert took < 30
    # Once a call gave up, the next gets one short try, whatever its budget (the process is
    # ending and writes its records), and an answer ends that state.
    err, took = call("write gs://b/y")
    assert "(after 1 try over" in str(err), err
    assert took < storage.DOWN_TRY_S + 30
    assert storage.with_retries(lambda: "ok", "read gs://b/z") == "ok"
    assert storage._state.down is None


def test_a_stop_gives_up_a_call_that_does_not_answer(fresh_storage_state) -> None:
    never = fresh_storage_state
    entered = threading.Event()

    def blocked() -> None:
        entered.set()
        never.wait()

    def stop_when_in_flight() -> float:
        assert entered.wait(60)
        storage.interrupt("SIGTERM")
        return time.monotonic()

    stopper = ThreadPoolExecutor(1).submit(stop_when_in_flight)

    def run():
        with pytest.raises(StorageFaultError) as e:
            storage.with_retries(blocked, "write gs://b/x")  # a budget of 120 s
        return e.value, time.monotonic()

    err, ended = _bounded(run)
    assert "no more after SIGTERM" in str(err) and "restartable" in str(err), err
    assert ended - stopper.result(timeout=60) < storage.STOP_GRACE_S + 30


# ---- whole runs --------------------------------------------------------------------------------

# The first upload of a metrics part: the run has compiled and stepped; from here on nothing
# the server is asked is answered.
FIRST_METRICS_UPLOAD = r"^POST /upload/(?s:.*)train\.jsonl\.parts"
HANG_S = 300  # only catches a hang: the bounds asserted below are far shorter


class StallingProxy(GcsFaultProxy):
    """Forwards requests until one matches `when`; from then on holds every request (or, with
    `only`, every request matching it) unanswered (the connection stays open, as with a stopped
    server) until the proxy stops."""

    def __init__(self, upstream: str, when: str, only: str | None = None) -> None:
        super().__init__(upstream)
        self._when = re.compile(when)
        self._only = re.compile(only) if only else None
        self.armed = threading.Event()  # `when` was seen
        self.stalled = threading.Event()  # a request is held
        self._release = threading.Event()

    def _decide(self, what: str) -> int | None:
        if self._when.search(what):
            self.armed.set()
        if self.armed.is_set() and (self._only is None or self._only.search(what)):
            self.stalled.set()
            self._release.wait()
            return 503  # to a client that gave up long ago
        return super()._decide(what)

    def stop(self) -> None:
        self._release.set()
        super().stop()


@pytest.fixture
def stalling(gcs_emulator):
    proxies: list[StallingProxy] = []

    def make(when: str = FIRST_METRICS_UPLOAD, only: str | None = None) -> StallingProxy:
        p = StallingProxy(os.environ["STORAGE_EMULATOR_HOST"], when, only).start()
        proxies.append(p)
        return p

    yield make
    for p in proxies:
        p.stop()


def _start(
    tmp_path, prepared, uri: str, run_id: str, proxy: StallingProxy, retry_s: float, **over
) -> subprocess.Popen:
    cfg = tiny_config(prepared, uri, run_id, runtime={"storage_retry_s": retry_s}, **over)
    path = write_config(tmp_path / f"{run_id}.toml", cfg)
    env = {"STORAGE_EMULATOR_HOST": proxy.url, "TENSORSTORE_GCS_HTTP_URL": proxy.url}
    return subprocess.Popen(
        [sys.executable, "-m", "runtime", "local", str(path)],
        cwd=ROOT, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip


def _wait_stalled(proc: subprocess.Popen, proxy: StallingProxy) -> float:
    """When the first request was held (the run is inside a storage call that never returns)."""
    deadline = time.monotonic() + HANG_S
    while not proxy.stalled.wait(0.2):
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the run ended (exit {proc.returncode}) before the stall:\n{err[-3000:]}")
        assert time.monotonic() < deadline, "the run never reached its first metrics upload"
    return time.monotonic()


def _ended(proc: subprocess.Popen, since: float) -> tuple[int, str, float]:
    """(exit code, stderr, seconds from `since` to the end); a hang fails after HANG_S."""
    try:
        _, err = proc.communicate(timeout=HANG_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"the run hung for {HANG_S} s on a storage server that stopped answering")
    return proc.returncode, err, time.monotonic() - since


def _one_error(stderr: str) -> str:
    errors = [ln for ln in stderr_lines(stderr) if ln.startswith("error: ")]
    assert len(errors) == 1, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    return errors[0]


@pytest.mark.gcs
def test_a_stalled_server_ends_the_run_within_the_retry_budget(
    tmp_path, prepared, gs_run_uri, stalling
) -> None:
    proxy = stalling()
    proc = _start(tmp_path, prepared, gs_run_uri, "d1", proxy, retry_s=4)
    stalled = _wait_stalled(proc, proxy)
    code, err, took = _ended(proc, stalled)
    assert code == EXIT_STORAGE_FAULT, err[-3000:]
    line = _one_error(err)
    assert line.startswith(f"error: cannot write {gs_run_uri}/d1/metrics/train.jsonl: "), line
    assert "did not answer within" in line and "restartable" in line, line
    # The budget (4 s) and then the failure record's calls, each one short try on a storage
    # known to be down: seconds, not gcsfs's minutes per request.
    assert took < 60, f"it took {took:.0f} s after the stall to end"


@pytest.mark.gcs
def test_sigterm_during_a_stalled_call_ends_the_run(
    tmp_path, prepared, gs_run_uri, stalling
) -> None:
    proxy = stalling()
    # A budget far longer than the test: only the signal can end the run in time.
    proc = _start(tmp_path, prepared, gs_run_uri, "d2", proxy, retry_s=3600)
    _wait_stalled(proc, proxy)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code, err, took = _ended(proc, sent)
    # Nothing can be saved on a storage that does not answer: the storage fault, restartable.
    assert code == EXIT_STORAGE_FAULT, err[-3000:]
    line = _one_error(err)
    assert "SIGTERM" in line and "restartable" in line, line
    assert took < 45, f"it took {took:.0f} s after SIGTERM to end"


@pytest.mark.gcs
def test_sigterm_while_a_checkpoint_save_is_stuck_ends_the_run(
    tmp_path, prepared, orbax_gs_run_uri, stalling
) -> None:
    # A synchronous save: the main thread is inside Orbax (no deadline of ours) when the server
    # stops answering, at the first request for checkpoint 3.
    proxy = stalling(when=r"checkpoints(/|%2F)3")
    proc = _start(
        tmp_path, prepared, orbax_gs_run_uri, "d3", proxy, retry_s=3600,
        checkpoint={"every": 3, "async": False},
    )  # fmt: skip
    _wait_stalled(proc, proxy)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code, err, took = _ended(proc, sent)
    assert code == EXIT_STORAGE_FAULT, err[-3000:]
    line = _one_error(err)
    assert line.startswith("error: stopped by SIGTERM, but the run's storage"), line
    assert "does not answer" in line and "restartable" in line, line
    # The watcher's wait (20 s) and its probe (5 s), then the process is gone.
    assert took < 60, f"it took {took:.0f} s after SIGTERM to end"


# A read of a train token shard's bytes (gcsfs downloads with alt=media; listings do not).
SHARD_READ = r"^GET \S*train-\d{5}\.bin\S*alt=media"


@pytest.mark.gcs
def test_a_data_server_that_stops_answering_ends_the_run_within_the_retry_budget(
    tmp_path, prepared, gs_run_uri, stalling
) -> None:
    """The dataset on gs://: once the run has stepped (its first metrics upload), the token
    reads get no answer. A read is a storage call with a deadline like any other, from inside
    Grain's reader threads: exit 45 and one sentence naming the data, within the budget."""
    from runfolder.storage import url_to_fs

    fs, path = url_to_fs(f"{gs_run_uri}/data")
    fs.put(str(Path(prepared).parent) + "/", path, recursive=True)
    proxy = stalling(when=FIRST_METRICS_UPLOAD, only=SHARD_READ)
    # Steps enough that reads go on after the first upload, whatever the loader prefetched;
    # decaying over the suite's 20 tiny steps keeps the one train step program XLA has cached.
    proc = _start(
        tmp_path, f"{gs_run_uri}/data/manifest.json", gs_run_uri, "d4", proxy, retry_s=4,
        training={"target_tokens": 16 * 8 * 400}, optimizer={"schedule": {"decay_steps": 20}},
    )  # fmt: skip
    stalled = _wait_stalled(proc, proxy)
    code, err, took = _ended(proc, stalled)
    assert code == EXIT_STORAGE_FAULT, err[-3000:]
    line = _one_error(err)
    assert re.match(rf"error: cannot read \d+ token ranges of {gs_run_uri}/data/", line), line
    assert "did not answer within" in line and "restartable" in line, line
    assert took < 60, f"it took {took:.0f} s after the stall to end"


def test_tensorstore_error_texts_name_the_fault() -> None:
    """Orbax re-raises tensorstore's errors as text (the type is lost): a retryable HTTP code in
    tensorstore's current `[http_response_code='503']` form is a fault, said in one line; a 404
    is not (the checkpoint's own problem)."""
    text = (
        "ABORTED: Error writing gs://b/run/checkpoints/5/opt_state/_sharding: All 2 retry "
        "attempts failed: injected [http_response_code='503'] [http_response_body='{\"error\": "
        "{\"code\": 503}}'] [source locations='tensorstore/kvstore/gcs_http/gcs_key_value_store.cc:1']"
    )
    fault = storage.storage_fault(ValueError(text))
    assert fault == storage.Fault(
        "HTTP 503: ABORTED: Error writing gs://b/run/checkpoints/5/opt_state/_sharding: All 2 "
        "retry attempts failed: injected",
        disk=False,
    )
    assert storage.storage_fault(ValueError("NOT_FOUND: x [http_response_code='404']")) is None
    assert storage.storage_fault(ValueError("x [http_response_code='429']")) is not None
