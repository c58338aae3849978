"""The gs:// server dies while an async checkpoint is uploading: the run ends with exit 45 in
one sentence, its failure recorded, and the process is gone seconds after that sentence, not
after the minutes Orbax's and tensorstore's threads go on retrying the dead upload."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time

import pytest
from faults.gcs_proxy import GcsFaultProxy

from jobspec.exit_codes import EXIT_STORAGE_FAULT

from runs import ROOT, tiny_config, write_config

# Far below tensorstore's own retrying of one upload (32 tries with backoff: many minutes), far
# above what flushing the records and leaving takes on loaded cores.
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


@pytest.mark.gcs
def test_exit_45_soon_after_the_upload_fails(tmp_path, prepared, orbax_gs_run_uri, proxy):
    cfg = tiny_config(prepared, orbax_gs_run_uri, "up", checkpoint={"every": 5, "async": True},
                      runtime={"storage_retry_s": 1})  # fmt: skip
    path = write_config(tmp_path / "up.toml", cfg)
    # From tensorstore's first upload of checkpoint 5 on (Orbax's background save), the server
    # answers every request with 503, but for the run's records (events, manifest, owner claim),
    # so that what the run writes on its way out can be checked.
    plan = proxy.fail(
        status=503,
        when=r"uploadType=media&name=[^ ]*checkpoints%2F5%2F",
        only=r"^(?!(?s:.*)(events\.jsonl|manifest\.json|owner\.json))",
    )
    env = {**os.environ, "STORAGE_EMULATOR_HOST": proxy.url, "TENSORSTORE_GCS_HTTP_URL": proxy.url}
    proc = subprocess.Popen(
        [sys.executable, "-m", "runtime", "local", str(path)],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        lines = _stderr_lines(proc)
        seen: list[str] = []
        error_at = None
        deadline = time.monotonic() + HANG_S
        while error_at is None:
            got = lines.get(timeout=max(1.0, deadline - time.monotonic()))
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
    assert plan.hits > 0, "the fault never started"
    assert rc == EXIT_STORAGE_FAULT, "\n".join(seen[-40:])
    errors = [ln for ln in seen if ln.startswith("error: ")]
    assert len(errors) == 1 and "HTTP 503" in errors[0], "\n".join(seen[-40:])
    # gcsfs's own report of the request it gave up on (an ERROR with a traceback) is not shown:
    # the sentence says it.
    noise = [ln for ln in seen if "Traceback" in ln or ln.startswith(("ERROR", "E0000"))]
    assert not noise, "\n".join(seen[-40:])
    assert exited_at - error_at < EXIT_AFTER_ERROR_S

    # The records were written before it left.
    from jobspec.run_store import ArtifactStore

    store = ArtifactStore(f"{orbax_gs_run_uri}/up")
    failures = [e for e in store.read_jsonl("events.jsonl") if e["event"] == "failure"]
    assert len(failures) == 1 and failures[0]["exit_code"] == EXIT_STORAGE_FAULT, failures
    assert store.read_json("manifest.json")["status"] == "failed"
    assert not store.exists("owner.json")  # the claim was released, not left to expire
