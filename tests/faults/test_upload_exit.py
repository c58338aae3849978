"""The gs:// server dies while an async checkpoint is uploading: the run ends with exit 45 in
one sentence, its failure recorded, and the process is gone seconds after that sentence, not
after the minutes Orbax's and tensorstore's threads go on retrying the dead upload."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from faults.gcs_proxy import GcsFaultProxy

from jobspec.exit_codes import EXIT_STORAGE_FAULT

from runs import ROOT, tiny_config, write_config

# Far below tensorstore's own default retrying of one upload (32 tries with backoff: about 15
# minutes), far above what flushing the records and leaving takes on loaded cores.
EXIT_AFTER_ERROR_S = 60
HANG_S = 600  # only catches a run that never gets to its error sentence


@pytest.fixture
def proxy(gcs_emulator):
    p = GcsFaultProxy(os.environ["STORAGE_EMULATOR_HOST"]).start()
    yield p
    p.stop()


def _stderr_lines(proc: subprocess.Popen) -> queue.Queue:
    """Each stderr line as it comes, with the time it came (None at the end of the stream)."""
    lines: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in proc.stderr:
            lines.put((time.monotonic(), line.rstrip("\n")))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines


# `runtime local` with faulthandler on SIGUSR1 into argv[1]: where a stuck run's threads are.
RUN_WITH_STACKS = """
import faulthandler, runpy, signal, sys
faulthandler.register(signal.SIGUSR1, file=open(sys.argv.pop(1), "w"), all_threads=True)
runpy.run_module("runtime", run_name="__main__", alter_sys=True)
"""


def _stacks(proc: subprocess.Popen, path: Path) -> str:
    """Only for a run already stuck: the dump is written once its size holds still for 1 s."""
    proc.send_signal(signal.SIGUSR1)
    size, deadline = -1, time.monotonic() + 30
    while time.monotonic() < deadline and (size <= 0 or size != path.stat().st_size):
        size = path.stat().st_size
        time.sleep(1)
    return path.read_text()


@dataclass
class Ended:
    rc: int
    seen: list[str]  # its stderr lines
    error_at: float  # when its `error:` sentence came (time.monotonic)
    exited_at: float

    @property
    def errors(self) -> list[str]:
        return [ln for ln in self.seen if ln.startswith("error: ")]

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.seen[-n:])


def _run_to_its_error(tmp_path: Path, path: Path, proxy: GcsFaultProxy) -> Ended:
    """`runtime local path` through the proxy, until it exits; fails the test if it never says
    its error (with its threads' stacks) or lingers after it."""
    env = {**os.environ, "STORAGE_EMULATOR_HOST": proxy.url, "TENSORSTORE_GCS_HTTP_URL": proxy.url}
    stacks = tmp_path / "stacks.txt"
    proc = subprocess.Popen(
        [sys.executable, "-c", RUN_WITH_STACKS, str(stacks), "local", str(path)],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        lines = _stderr_lines(proc)
        seen: list[str] = []
        error_at = None
        deadline = time.monotonic() + HANG_S
        while error_at is None:
            try:
                got = lines.get(timeout=max(1.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"no error sentence in {HANG_S} s; its threads:\n{_stacks(proc, stacks)}"
                            + "\n".join(seen[-40:]))  # fmt: skip
            if got is None:
                break
            at, line = got
            seen.append(line)
            if line.startswith("error: "):
                error_at = at
        assert error_at is not None, "\n".join(seen[-40:])
        try:
            rc = proc.wait(timeout=EXIT_AFTER_ERROR_S)
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"still running {EXIT_AFTER_ERROR_S} s after its error sentence:\n"
                + "\n".join(seen[-20:])
            )
        exited_at = time.monotonic()
        while (got := lines.get(timeout=30)) is not None:
            seen.append(got[1])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return Ended(rc, seen, error_at, exited_at)


def _config(tmp_path: Path, prepared: str, uri: str) -> Path:
    cfg = tiny_config(prepared, uri, "up", checkpoint={"every": 5, "async": True},
                      runtime={"storage_retry_s": 1})  # fmt: skip
    return write_config(tmp_path / "up.toml", cfg)


def _records_written(uri: str) -> None:
    """The run's failure record, manifest and released claim, written before it left."""
    from runfolder.store import ArtifactStore

    store = ArtifactStore(f"{uri}/up")
    failures = [e for e in store.read_jsonl("events.jsonl") if e["event"] == "failure"]
    assert len(failures) == 1 and failures[0]["exit_code"] == EXIT_STORAGE_FAULT, failures
    assert store.read_json("manifest.json")["status"] == "failed"
    assert not store.exists("owner.json")  # the claim was released, not left to expire


@pytest.mark.gcs
def test_exit_45_soon_after_the_upload_fails(tmp_path, prepared, orbax_gs_run_uri, proxy):
    path = _config(tmp_path, prepared, orbax_gs_run_uri)
    # From tensorstore's first upload of checkpoint 5 on (Orbax's background save), the server
    # answers every request with 503, but for the run's records (events, manifest, owner claim),
    # so that what the run writes on its way out can be checked.
    plan = proxy.fail(
        status=503,
        when=r"uploadType=media&name=[^ ]*checkpoints%2F5%2F",
        only=r"^(?!(?s:.*)(events\.jsonl|manifest\.json|owner\.json))",
    )
    run = _run_to_its_error(tmp_path, path, proxy)
    assert plan.hits > 0, "the fault never started"
    assert run.rc == EXIT_STORAGE_FAULT, run.tail()
    assert len(run.errors) == 1 and "HTTP 503" in run.errors[0], run.tail()
    # gcsfs's own report of the request it gave up on (an ERROR with a traceback) is not shown:
    # the sentence says it.
    noise = [ln for ln in run.seen if "Traceback" in ln or ln.startswith(("ERROR", "E0000"))]
    assert not noise, run.tail()
    assert run.exited_at - run.error_at < EXIT_AFTER_ERROR_S
    _records_written(orbax_gs_run_uri)


@pytest.mark.gcs
def test_a_failing_tensorstore_upload_is_retried_within_the_runs_budget(
    tmp_path, prepared, orbax_gs_run_uri, proxy
):
    """Only tensorstore's own uploads of checkpoint 5 fail, so nothing but the save can end the
    run. tensorstore's default retries (32 tries up to 32 s apart) would keep it in the next
    save's wait for about 15 minutes; runtime.storage_retry_s (1 s here) bounds them."""
    path = _config(tmp_path, prepared, orbax_gs_run_uri)
    plan = proxy.fail(
        status=503, when=r"uploadType=media&name=[^ ]*checkpoints%2F5%2F", only=r"uploadType=media"
    )
    run = _run_to_its_error(tmp_path, path, proxy)
    assert plan.started is not None, "the fault never started"
    assert run.rc == EXIT_STORAGE_FAULT, run.tail()
    assert len(run.errors) == 1, run.tail()
    assert "checkpoint 5 " in run.errors[0] and "HTTP 503" in run.errors[0], run.tail()
    # Two tries 0.5 s apart, then the step loop's next look at the save: seconds, however loaded
    # the machine; far below tensorstore's own quarter of an hour.
    assert run.error_at - plan.started < 120, run.tail()
    _records_written(orbax_gs_run_uri)
