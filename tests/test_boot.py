"""Boot, writer election, coordinated stop and host loss: the env contract in-process, and real
2-process CPU clusters (gloo) through the multi-host harness."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
from multihost import REPO, HostResult, free_port, host_env, run_hosts, start_hosts

from jobspec.errors import ConfigError
from runtime.host import boot
from runtime.host.boot import EXIT_CLUSTER_TIMEOUT, BootContract, detect_cluster
from runtime.host.coordination import EXIT_HOST_LOST

WORKER = REPO / "tests" / "_mh_worker.py"


def mh(result: HostResult, kind: str) -> dict:
    rows = [json.loads(line) for line in result.lines("MH ")]
    found = [r for r in rows if r["kind"] == kind]
    assert found, f"host {result.process_id} printed no {kind!r} line:\n{result.output[-3000:]}"
    return found[-1]


# ---- the contract ----------------------------------------------------------------------------

DIST = {
    "JAXJOB_COORDINATOR": "10.0.0.1:8476",
    "JAXJOB_NUM_PROCESSES": "2",
    "JAXJOB_PROCESS_ID": "1",
}

BAD_CONTRACTS = [
    (
        {"JAXJOB_COORDINATOR": "10.0.0.1:8476"},
        "JAXJOB_COORDINATOR is set but JAXJOB_NUM_PROCESSES and JAXJOB_PROCESS_ID are not",
    ),
    ({"JAXJOB_NUM_PROCESSES": "2", "JAXJOB_PROCESS_ID": "0"}, "but JAXJOB_COORDINATOR is not"),
    ({**DIST, "JAXJOB_PROCESS_ID": ""}, "but JAXJOB_PROCESS_ID is not"),
    ({**DIST, "JAXJOB_NUM_PROCESSES": "two"}, "JAXJOB_NUM_PROCESSES='two' is not an integer"),
    ({**DIST, "JAXJOB_PROCESS_ID": "1.5"}, "JAXJOB_PROCESS_ID='1.5' is not an integer"),
    ({**DIST, "JAXJOB_PROCESS_ID": "2"}, "JAXJOB_PROCESS_ID=2 is outside 0..1"),
    ({**DIST, "JAXJOB_PROCESS_ID": "-1"}, "JAXJOB_PROCESS_ID=-1 is outside 0..1"),
    ({**DIST, "JAXJOB_NUM_PROCESSES": "0"}, "JAXJOB_NUM_PROCESSES=0 must be at least 1"),
    ({**DIST, "JAXJOB_COORDINATOR": "10.0.0.1"}, "JAXJOB_COORDINATOR='10.0.0.1' is not host:port"),
    ({**DIST, "JAXJOB_COORDINATOR": "10.0.0.1:99999"}, "is not host:port"),
    ({**DIST, "JAXJOB_COORDINATOR": ":8476"}, "is not host:port"),
    ({"JAXJOB_ATTEMPT": "x"}, "JAXJOB_ATTEMPT='x' is not an integer"),
    ({"JAXJOB_ATTEMPT": "-1"}, "JAXJOB_ATTEMPT=-1 is negative"),
    ({"JAXJOB_RUN_ID": "My_Run"}, "JAXJOB_RUN_ID='My_Run' is not a DNS-1123 label"),
]


@pytest.mark.parametrize(("env", "message"), BAD_CONTRACTS)
def test_bad_contract_is_one_sentence(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        BootContract.from_env(env)
    assert message in str(e.value)
    assert "\n" not in str(e.value) and "validation error" not in str(e.value)


@pytest.mark.parametrize(
    ("env", "distributed", "coordinator"),
    [
        ({}, False, None),
        ({"JAXJOB_NUM_PROCESSES": "1", "JAXJOB_PROCESS_ID": "0"}, False, None),
        (DIST, True, "10.0.0.1:8476"),
        ({**DIST, "JAXJOB_COORDINATOR": "[::1]:8476"}, True, "[::1]:8476"),
    ],
)
def test_good_contract(env: dict[str, str], distributed: bool, coordinator: str | None) -> None:
    c = BootContract.from_env({**env, "JAXJOB_RUN_ID": "r1", "JAXJOB_ATTEMPT": "3"})
    assert (c.distributed, c.coordinator, c.run_id, c.attempt) == (
        distributed,
        coordinator,
        "r1",
        3,
    )


def test_slurm_detection(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n1", "SLURM_NTASKS": "2",
                 "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}.items():  # fmt: skip
        monkeypatch.setenv(k, v)
    assert detect_cluster() == "slurm"
    monkeypatch.setenv("SLURM_NTASKS", "1")  # one task: nothing to coordinate
    assert detect_cluster() is None


def test_single_process_boot() -> None:
    info = boot.boot(timeout_s=5, heartbeat_timeout_s=10, env={"JAXJOB_RUN_ID": "solo"})
    try:
        assert (info.mode, info.process_count, info.process_index) == ("single-process", 1, 0)
        assert info.coordinator is None and info.run_id == "solo"
        from runtime.host.writer import elect_writer

        assert elect_writer(0) == 0 and info.writer_election == "single-process"
    finally:
        boot.shutdown()


# ---- real clusters ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def contract_cluster() -> list[HostResult]:
    """One 2-host cluster on the env contract, read by the tests below: attempt 2, inside a
    SLURM allocation (the contract must win over JAX's SLURM detection), electing the writer of
    attempts 0, 2 and 3."""
    slurm = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n1", "SLURM_NTASKS": "2",
             "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}  # fmt: skip
    env = {"JAXJOB_ATTEMPT": "2", **slurm}
    args = ["cluster", "--attempts", "0,2,3"]
    results = run_hosts(args, 2, 2, env=env, script=WORKER, timeout=120)
    for r in results:
        assert r.returncode == 0, r.output[-3000:]
    return results


def test_two_processes_form_one_cluster_and_agree_on_the_writer(contract_cluster) -> None:
    for r in contract_cluster:
        out = mh(r, "cluster")
        info = out["info"]
        assert info["mode"] == "contract" and info["run_id"] == "mh-test"
        assert (info["process_index"], info["process_count"]) == (r.process_id, 2)
        assert (info["local_device_count"], info["global_device_count"]) == (2, 4)
        assert info["platform"] == "cpu" and info["cpu_collectives"] == "gloo"
        assert info["coordinator"].startswith("127.0.0.1:")
        assert info["writer_index"] == 0 and out["writers"]["0"]["writer"] == 0
        assert all(got == want for got, want in out["sums"]), out["sums"]


def test_writer_is_reagreed_per_attempt(contract_cluster) -> None:
    writers = []
    for r in contract_cluster:
        out = mh(r, "cluster")
        assert out["info"]["attempt"] == 2 and out["info"]["mode"] == "contract"
        assert out["writers"]["2"]["key"] == "jaxjob/mh-test/writer/2"
        assert out["writers"]["3"]["key"] == "jaxjob/mh-test/writer/3"
        assert out["info"]["writer_election"] == "kv-claim:jaxjob/mh-test/writer/3"
        writers.append(out["writers"])
    assert writers[0] == writers[1]


def _run_alone(process_id: int, timeout_s: int) -> tuple[subprocess.CompletedProcess[str], float]:
    """One host of a 2-host cluster whose other host (and for process 1, coordinator) is absent,
    and the seconds from its boot's start (after Python and jax were imported, which a loaded
    machine makes slow) until it had ended."""
    env = host_env(process_id, 2, 1, f"127.0.0.1:{free_port()}")
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run(
        [sys.executable, str(WORKER), "cluster", "--timeout", str(timeout_s)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s + 120,
    )  # fmt: skip
    ended = time.monotonic()  # CLOCK_MONOTONIC: the same clock in every process here
    booting = [json.loads(ln[3:]) for ln in proc.stdout.splitlines() if ln.startswith("MH ")]
    starts = [r["monotonic"] for r in booting if r["kind"] == "booting"]
    assert starts, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, ended - starts[0]


def test_unreachable_coordinator_is_one_sentence() -> None:
    proc, elapsed = _run_alone(1, 5)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "could not reach the coordinator at 127.0.0.1:" in proc.stderr
    assert "within 5 s (JAXJOB_COORDINATOR); check that process 0 is running" in proc.stderr
    assert "Check failure" not in proc.stderr and "Traceback" not in proc.stderr
    # From boot's start: its 5 s, before JAX's own deadline (10 s later) would have come.
    assert elapsed < 5 + 10, elapsed


def test_missing_peer_ends_the_coordinator_cleanly() -> None:
    proc, elapsed = _run_alone(0, 5)
    assert proc.returncode == EXIT_CLUSTER_TIMEOUT, proc.stderr[-3000:]
    assert "the cluster of 2 processes did not form within 5 s" in proc.stderr
    assert "Check failure" not in proc.stderr
    assert elapsed < 5 + 10, elapsed


class SignalRuns:
    """Per signal, one 2-host loop that the signal on host 1 stops, run the first time a test
    asks for it. After SIGTERM's stop host 0 lingers (writing its files) for longer than the
    watchdog's timeout while host 1 is done and waiting in JAX's shutdown barrier."""

    WATCHDOG_S, LINGER_S = 3, 5

    def __init__(self) -> None:
        self.runs: dict[signal.Signals, list[HostResult]] = {}

    def __getitem__(self, sig: signal.Signals) -> list[HostResult]:
        if sig not in self.runs:
            linger = self.LINGER_S if sig == signal.SIGTERM else 0
            args = ["loop", "--watchdog", str(self.WATCHDOG_S), "--linger", str(linger)]
            with start_hosts(args, 2, 2, script=WORKER) as hosts:
                for i in (0, 1):
                    hosts.wait_for_output(i, "READY", timeout=60)
                hosts.signal(1, sig)  # both are in the loop of 100,000 steps: it cannot end first
                self.runs[sig] = hosts.wait(timeout=60)
        return self.runs[sig]


@pytest.fixture(scope="module")
def signal_runs() -> SignalRuns:
    return SignalRuns()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_on_one_host_stops_all_at_the_same_step(
    signal_runs: SignalRuns, sig: signal.Signals
) -> None:
    stops = []
    for r in signal_runs[sig]:
        assert r.returncode == 0, r.output[-3000:]
        stopped = mh(r, "stopped")
        assert stopped["reason"] == sig.name
        stops.append(stopped["step"])
    print(f"{sig.name} on host 1: both hosts stopped at step {stops}")
    assert stops[0] == stops[1]


def test_sigkill_of_a_host_ends_the_survivor_with_a_named_host() -> None:
    bound = 10
    with start_hosts(["loop", "--watchdog", str(bound)], 2, 2, script=WORKER) as hosts:
        for i in (0, 1):
            hosts.wait_for_output(i, "READY", timeout=60)
        killed = time.monotonic()
        hosts.kill(1)
        (survivor,) = hosts.wait(timeout=bound + 30, only=[0])
    took = survivor.elapsed - (killed - hosts.started)
    print(f"host 0 exited {took:.1f} s after host 1 was killed (rc {survivor.returncode})")
    assert survivor.returncode == EXIT_HOST_LOST, survivor.output[-3000:]
    assert "host 1 of 2 stopped responding (no heartbeat for 10 s); exiting" in survivor.stderr
    # Our watchdog's bound, not JAX's heartbeat timeout (120 s), with room for a loaded machine.
    assert took < bound + 20


def test_sigkill_of_the_coordinator_host_ends_the_others() -> None:
    # Host 0 runs the coordination service: JAX itself aborts the others (exit 134) at once,
    # before any Python runs; what matters is that they end, non-zero, instead of hanging.
    with start_hosts(["loop", "--watchdog", "10"], 2, 1, script=WORKER) as hosts:
        for i in (0, 1):
            hosts.wait_for_output(i, "READY", timeout=60)
        killed = time.monotonic()
        hosts.kill(0)
        (survivor,) = hosts.wait(timeout=40, only=[1])
    took = survivor.elapsed - (killed - hosts.started)
    print(f"host 1 exited {took:.1f} s after host 0 was killed (rc {survivor.returncode})")
    assert survivor.returncode not in (None, 0), survivor.output[-3000:]
    assert took < 30  # at once, give or take a loaded machine; a hang is cut at 40 s


def test_a_host_that_finished_is_not_reported_lost(signal_runs: SignalRuns) -> None:
    # Host 0 lingers past the watchdog's timeout after host 1 is done and waiting in JAX's
    # shutdown barrier: neither may call the other lost.
    assert SignalRuns.LINGER_S > SignalRuns.WATCHDOG_S
    for r in signal_runs[signal.SIGTERM]:
        assert r.returncode == 0, r.output[-3000:]
        assert "stopped responding" not in r.stderr
        mh(r, "exit")


def test_jax_slurm_detection_without_the_contract() -> None:
    # What `srun` gives each task; JAX derives the cluster from it (coordinator: the first node).
    slurm = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "localhost", "SLURM_NTASKS": "2",
             "SLURM_LOCALID": "0", "JAX_COORDINATOR_PORT": str(free_port())}  # fmt: skip
    env = {**slurm, "JAXJOB_COORDINATOR": "", "JAXJOB_NUM_PROCESSES": "", "JAXJOB_PROCESS_ID": ""}
    results = run_hosts(
        ["cluster"], 2, 1, env=env, script=WORKER, timeout=120,
        per_host_env=[{"SLURM_PROCID": "0"}, {"SLURM_PROCID": "1"}],
    )  # fmt: skip
    for r in results:
        assert r.returncode == 0, r.output[-3000:]
        info = mh(r, "cluster")["info"]
        assert info["mode"] == "auto:slurm" and info["process_count"] == 2
        assert info["process_index"] == r.process_id and info["global_device_count"] == 2
        assert info["coordinator"] == f"localhost:{slurm['JAX_COORDINATOR_PORT']}"
