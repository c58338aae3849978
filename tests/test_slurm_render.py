"""The slurm backend without daemons: rendered scripts (golden files, `bash -n`, quoting), the
batch shell's verdict over the hosts' exit codes, and status/logs from scontrol text and files.

`JAXJOB_UPDATE_GOLDEN=1 python -m pytest tests/test_slurm_render.py` rewrites tests/golden/slurm/.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest
import tomli_w

from jobspec.errors import ConfigError
from jobspec.exit_codes import is_restartable
from jobspec.files.job_yaml import load_job, run_with_id
from jobspec.job_spec import JobSpec
from launch.backend import Handle, Submission
from launch.backends.slurm import SlurmBackend, submit
from launch.backends.slurm.render import CANCEL_MARK, render_script

HERE = Path(__file__).resolve().parent
SPECS, GOLDEN = HERE / "slurm_specs", HERE / "golden" / "slurm"
RUNDIR = Path("/home/ada/.local/state/jaxjob/runs")
WORKDIR = Path("/home/ada/jobs")


def _from_file(name: str, run_id: str) -> Submission:
    job = load_job(SPECS / name)
    run, toml = run_with_id(job, run_id)
    # As prepare_submission hands it over: a relative output_uri resolved where launch runs.
    output_uri = str(WORKDIR / run.run.output_uri)  # WORKDIR / "/abs" is "/abs"
    return Submission(job.spec, run_id, toml, job.spec_yaml, output_uri, WORKDIR)


def _from_dict(**doc) -> Submission:
    run = {"run": {"id": "q", "output_uri": "/out"}, "data": {"manifest": "/m.json"}}
    base = {"name": "quoting", "run": run, "accelerator": "cpu", "hosts": 2}
    spec = JobSpec.model_validate({**base, **doc})
    return Submission(spec, "quoting-1", tomli_w.dumps(run), "", "/out", WORKDIR)


def _bash_n(script: str) -> None:
    proc = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
    assert proc.returncode == 0, proc.stderr


def _directives(script: str) -> dict[str, str]:
    """`#SBATCH --opt=value` lines, values unquoted the way sbatch reads them (no backslashes
    reach it, so POSIX shlex agrees with sbatch's own parser)."""
    out = {}
    for line in script.splitlines():
        if line.startswith("#SBATCH "):
            (word,) = shlex.split(line.removeprefix("#SBATCH "))
            key, _, value = word.partition("=")
            out[key] = value
    return out


@pytest.mark.parametrize(
    ("spec", "run_id"), [("gpu.yaml", "llm-h100-abc12"), ("cpu.yaml", "cpu-small-x7k2q")]
)
def test_rendered_scripts_match_golden_and_parse(spec: str, run_id: str):
    files = SlurmBackend().render(_from_file(spec, run_id), rundir=RUNDIR / run_id, cwd=WORKDIR)
    assert [f.name for f in files] == ["job.sbatch", "cfg.toml", "job.yaml"]
    script = files[0].content
    _bash_n(script)
    golden = GOLDEN / spec.replace(".yaml", ".sbatch")
    if os.environ.get("JAXJOB_UPDATE_GOLDEN") == "1":
        golden.write_text(script)  # rewritten, so nothing was checked: say so rather than pass
        pytest.skip(f"{golden} rewritten; review the diff and run again")
    assert golden.exists(), f"{golden} is missing; run with JAXJOB_UPDATE_GOLDEN=1"
    assert script == golden.read_text(), f"{golden} differs; JAXJOB_UPDATE_GOLDEN=1 regenerates it"
    assert 'id = "' + run_id + '"' in files[1].content  # cfg.toml carries the run id


def test_gpu_directives_and_srun():
    script = SlurmBackend().render(_from_file("gpu.yaml", "g-1"), rundir=RUNDIR / "g-1")[0].content
    d = _directives(script)
    assert d["--nodes"] == "2" and d["--ntasks-per-node"] == "1" and d["--gres"] == "gpu:8"
    assert d["--signal"] == "TERM@300"  # to the steps: the hosts checkpoint, not the batch shell
    assert "--requeue" in d and d["--open-mode"] == "append" and d["--constraint"] == "h100&ib"
    assert "--cpus-per-task=32 \\" in script  # passed to srun too (22.05 no longer inherits it)
    assert "export JAX_PLATFORMS=cuda" in script
    # A secret reference comes from the submitting shell; the script only checks it is there.
    assert ': "${HF_TOKEN:?' in script and "export HF_TOKEN" not in script


def test_cpu_job_has_no_gpus_and_no_requeue():
    d = _directives(
        SlurmBackend()
        .render(_from_file("cpu.yaml", "c-1"), rundir=RUNDIR / "c-1", cwd=WORKDIR)[0]
        .content
    )
    assert "--gres" not in d and "--no-requeue" in d and "--requeue" not in d
    assert d["--nodes"] == "4" and d["--chdir"] == str(WORKDIR)


def test_hosts_per_node_packs_cpu_hosts():
    script = SlurmBackend(hosts_per_node=2).render(_from_file("cpu.yaml", "c-2"))[0].content
    d = _directives(script)
    assert d["--nodes"] == "2" and d["--ntasks-per-node"] == "2"
    with pytest.raises(ConfigError, match="only CPU jobs"):
        SlurmBackend(hosts_per_node=2).render(_from_file("gpu.yaml", "g-2"))
    with pytest.raises(ConfigError, match="do not divide"):
        SlurmBackend(hosts_per_node=3).render(_from_file("cpu.yaml", "c-3"))


def test_tpu_is_refused():
    with pytest.raises(ConfigError, match="k8s"):
        SlurmBackend().render(_from_dict(accelerator="tpu-v5e-8", hosts=None))


ODD = 'it\'s a "part" $(touch /tmp/jaxjob-pwned) `id` ; & | #x'


def test_odd_values_are_quoted_not_run(tmp_path):
    sub = _from_dict(
        slurm={
            "partition": ODD,
            "account": "a b",
            "setup": ["echo \"it's\" 'quoted' > /dev/null", "X='a b'; export X"],
        },
        env={"ODD_VALUE": ODD + " \\ back\nslash"},  # shell words may hold both
        output_uri=None,
    )
    script = render_script(sub, tmp_path / "run dir %j")
    _bash_n(script)
    d = _directives(script)
    assert d["--partition"] == ODD and d["--account"] == "a b"
    assert d["--output"] == f"{tmp_path}/run dir %%j/logs/batch.log"  # % escaped for SLURM
    for line in sub.spec.slurm.setup:
        assert f"\n{line}\n" in script  # setup lines are shell code, kept verbatim
    # The export lines evaluate to the literal value and run nothing.
    start = script.index("export ODD_VALUE=")
    export = script[start : script.index("\n", script.index("slash'", start))]
    out = subprocess.run(
        ["bash", "-c", export + '; printf %s "$ODD_VALUE"'], capture_output=True, text=True
    )
    assert out.stdout == sub.spec.env["ODD_VALUE"] and not Path("/tmp/jaxjob-pwned").exists()


@pytest.mark.parametrize("bad", ["a\\b", "a\nb"])
def test_backslash_or_newline_in_a_directive_is_refused(bad: str):
    with pytest.raises(ConfigError, match="slurm.partition"):
        SlurmBackend().render(_from_dict(slurm={"partition": bad}))


# ---- the batch shell's verdict (the rendered code, run with a stub scontrol) -----------------


def _verdict(tmp_path: Path, codes: list[int], *, rc: int, attempt: int = 0, cancel=False):
    script = render_script(_from_dict(max_restarts=2), tmp_path)
    helpers = [ln for ln in script.splitlines() if ln.startswith(("say()", "finish()"))]
    verdict = script.split("# ---- the verdict\n", 1)[1]
    exits = tmp_path / "exit"
    exits.mkdir(exist_ok=True)
    for i, c in enumerate(codes):
        (exits / f"host-{i}").write_text(f"{c}\n")
    if cancel:
        (tmp_path / "cancel-requested").touch()
    stub = f'scontrol() {{ echo "$*" >{tmp_path}/scontrol; }}'
    prelude = [f"rundir={tmp_path}", f"exits={exits}", f"rc={rc}", f"JAXJOB_ATTEMPT={attempt}"]
    code = "\n".join([*prelude, stub, *helpers, verdict])
    env = {**os.environ, "SLURM_JOB_ID": "9"}
    proc = subprocess.run(["bash", "-c", code], capture_output=True, text=True, env=env)
    requeued = (tmp_path / "scontrol").exists()
    return proc.returncode, requeued, proc.stdout


@pytest.mark.parametrize(
    ("codes", "rc", "attempt", "cancel", "want_exit", "want_requeue"),
    [
        ([0, 0], 0, 0, False, 0, False),  # done
        ([2, 143], 143, 0, False, 2, False),  # a user error, the peer SIGTERMed by srun
        ([42, 42], 42, 0, False, 0, True),  # checkpointed on SIGTERM: requeue
        ([43, 137], 137, 1, False, 0, True),  # a peer lost, one killed: requeue
        ([42, 42], 42, 2, False, 42, False),  # no restarts left
        ([42, 42], 42, 0, True, 42, False),  # launch cancel: never requeued
        ([], 1, 0, False, 1, False),  # srun failed before any host ran
        ([45, 143], 143, 0, False, 0, True),  # a storage fault: restartable everywhere
        ([134, 143], 143, 0, False, 0, True),  # SIGABRT (JAX lost host 0): requeue
        ([139, 0], 139, 0, False, 0, True),  # SIGSEGV: requeue
        ([128, 143], 143, 0, False, 128, False),  # 128 is no signal death: fails, as on k8s
        ([255, 143], 255, 0, False, 255, False),  # exit(-1): fails
    ],
)
def test_verdict(tmp_path, codes, rc, attempt, cancel, want_exit, want_requeue):
    exit_code, requeued, out = _verdict(tmp_path, codes, rc=rc, attempt=attempt, cancel=cancel)
    assert (exit_code, requeued) == (want_exit, want_requeue), out
    if not requeued:
        assert (tmp_path / "result").read_text().split() == [str(want_exit), str(attempt)]


def test_verdict_agrees_with_the_shared_exit_code_table(tmp_path):
    """Every exit code 1-255 of one host (the other exits 0): the batch shell requeues exactly
    when is_restartable says so, as the k8s failure policy and the local supervisor do. One
    bash runs all 255 verdicts, each in its own subshell and directory."""
    script = render_script(_from_dict(max_restarts=2), tmp_path)
    helpers = [ln for ln in script.splitlines() if ln.startswith(("say()", "finish()"))]
    verdict = script.split("# ---- the verdict\n", 1)[1]
    lines = []
    for code in range(1, 256):
        d = tmp_path / str(code)
        (d / "exit").mkdir(parents=True)
        (d / "exit" / "host-0").write_text(f"{code}\n")
        (d / "exit" / "host-1").write_text("0\n")
        stub = f'scontrol() {{ echo "$*" >{d}/scontrol; }}'
        prelude = f"rundir={d}; exits={d}/exit; rc={code}; JAXJOB_ATTEMPT=0"
        body = "\n".join([prelude, stub, *helpers, verdict])
        lines.append(f"( {body}\n) >/dev/null; echo {code} $?")
    env = {**os.environ, "SLURM_JOB_ID": "9"}
    proc = subprocess.run(["bash"], input="\n".join(lines), capture_output=True, text=True,
                          env=env, timeout=120)  # fmt: skip
    results = dict(tuple(map(int, ln.split())) for ln in proc.stdout.splitlines())
    assert sorted(results) == list(range(1, 256)), proc.stderr
    for code, exit_code in results.items():
        requeued = (tmp_path / str(code) / "scontrol").exists()
        assert requeued == is_restartable(code), code
        assert exit_code == (0 if requeued else code), code


# ---- status and logs from scontrol's text and the run directory -------------------------------

SCONTROL = (
    "JobId=7 JobName=slurm-cancel UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=1 "
    "Nice=0 Account=(null) QOS=(null) JobState={state} Reason={reason} Dependency=(null) "
    "Requeue=1 Restarts={restarts} BatchFlag=1 Reboot=0 ExitCode={code}:0 RunTime=00:00:31 "
    "NodeList=vm BatchHost=vm NumNodes=1 Comment=it's JobState=FAKE\n"
)


def _handle(tmp_path: Path) -> Handle:
    (tmp_path / "logs").mkdir(exist_ok=True)
    return Handle("slurm", {"job_id": "7", "workdir": str(tmp_path), "hosts": 2})


def _fake_scontrol(monkeypatch, text: str | None) -> None:
    def run(cmd, *, check=True, timeout=60):
        if text is None:
            return subprocess.CompletedProcess(cmd, 1, "", "slurm_load_jobs error: Invalid job id")
        return subprocess.CompletedProcess(cmd, 0, text, "")

    monkeypatch.setattr(submit, "run_command", run)


@pytest.mark.parametrize(
    ("state", "reason", "restarts", "code", "mark", "want"),
    [
        ("PENDING", "Priority", 0, 0, False, "pending"),
        ("PENDING", "BeginTime", 1, 0, False, "pending"),  # requeued
        ("RUNNING", "None", 0, 0, False, "running"),
        ("COMPLETED", "None", 0, 0, False, "succeeded"),
        ("FAILED", "NonZeroExitCode", 0, 2, False, "failed"),
        ("FAILED", "NonZeroExitCode", 0, 42, True, "cancelled"),  # hosts checkpointed, then ended
        ("CANCELLED+", "None", 0, 0, False, "cancelled"),
        ("TIMEOUT", "TimeLimit", 0, 0, False, "failed"),
    ],
)
def test_status_from_scontrol(tmp_path, monkeypatch, state, reason, restarts, code, mark, want):
    h = _handle(tmp_path)
    if mark:
        (tmp_path / "cancel-requested").touch()
    text = SCONTROL.format(state=state, reason=reason, restarts=restarts, code=code)
    _fake_scontrol(monkeypatch, text)
    st = SlurmBackend().status(h)
    assert st["state"] == want, st
    assert st["attempt"] == restarts and st["exit_code"] == code


def test_status_after_slurm_forgot_the_job(tmp_path, monkeypatch):
    h = _handle(tmp_path)
    _fake_scontrol(monkeypatch, None)
    assert SlurmBackend().status(h)["state"] == "unknown"
    (tmp_path / "result").write_text("0 1\n")
    (tmp_path / "logs" / "batch.log").write_text("jaxjob: attempt 1: every host finished\n")
    st = SlurmBackend().status(h)
    assert (st["state"], st["attempt"], st["detail"]) == (
        "succeeded",
        1,
        "attempt 1: every host finished",
    )
    (tmp_path / "result").write_text("42 0\n")
    (tmp_path / "cancel-requested").touch()
    assert SlurmBackend().status(h)["state"] == "cancelled"


def test_logs_prefix_tail_and_follow(tmp_path, monkeypatch):
    h = _handle(tmp_path)
    (tmp_path / "logs" / "host-0.log").write_text("a\nb\nc\n")
    (tmp_path / "logs" / "host-1.log").write_text("x\ny")  # the last line has no newline yet
    backend = SlurmBackend(poll_s=0.01)
    assert list(backend.logs(h)) == ["[host 0] a", "[host 0] b", "[host 0] c", "[host 1] x",
                                     "[host 1] y"]  # fmt: skip
    assert list(backend.logs(h, host=0, tail=2)) == ["[host 0] b", "[host 0] c"]
    assert list(backend.logs(h, tail=0)) == []  # --tail 0: no lines, as kubectl and tail(1)

    states = iter(["RUNNING", "RUNNING", "COMPLETED"])
    texts = iter([SCONTROL.format(state=s, reason="None", restarts=0, code=0) for s in states])
    monkeypatch.setattr(
        submit, "run_command", lambda cmd, **_: subprocess.CompletedProcess(cmd, 0, next(texts), "")
    )
    lines = []
    for line in backend.logs(h, host=1, follow=True):
        lines.append(line)
        if line == "[host 1] x":
            with (tmp_path / "logs" / "host-1.log").open("a") as f:
                f.write("z\nlast")
    assert lines == ["[host 1] x", "[host 1] yz", "[host 1] last"]


def test_cancel_sends_term_and_leaves_the_escalation_to_a_detached_process(tmp_path, monkeypatch):
    h = _handle(tmp_path)
    h.data["grace_s"] = 60
    calls: list[list[str]] = []

    def run(cmd, *, check=True, timeout=60):
        calls.append(cmd)
        text = SCONTROL.format(state="RUNNING", reason="None", restarts=0, code=0)
        return subprocess.CompletedProcess(cmd, 0, text if cmd[0] == "scontrol" else "", "")

    spawned: list[dict] = []

    class Popen:
        def __init__(self, cmd, **kw):
            spawned.append({"cmd": cmd, **kw})

    monkeypatch.setattr(submit, "run_command", run)
    monkeypatch.setattr(submit.subprocess, "Popen", Popen)
    SlurmBackend().cancel(h)  # `launch cancel` without --wait: returns at once
    assert [c[0] for c in calls] == ["scontrol", "scancel"] and calls[1][1] == "--signal=TERM"
    assert (tmp_path / CANCEL_MARK).exists()
    (p,) = spawned
    assert p["cmd"][2:4] == ["launch.backends.slurm", "escalate"] and p["cmd"][-1] == "60.0"
    assert p["start_new_session"] and json.loads(p["cmd"][4])["job_id"] == "7"

    # The detached process (or wait=True): the job outlives the grace, so it is scancelled.
    calls.clear()
    SlurmBackend(poll_s=0.01).escalate(h, 0.05)
    assert calls[-1] == ["scancel", "7"] and len(spawned) == 1


def test_cancel_without_grace_scancels_at_once(tmp_path, monkeypatch):
    calls: list[list[str]] = []

    def run(cmd, *, check=True, timeout=60):
        calls.append(cmd)
        text = SCONTROL.format(state="RUNNING", reason="None", restarts=0, code=0)
        return subprocess.CompletedProcess(cmd, 0, text if cmd[0] == "scontrol" else "", "")

    monkeypatch.setattr(submit, "run_command", run)
    SlurmBackend().cancel(_handle(tmp_path), grace_s=0)
    assert calls[-2:] == [["scancel", "--signal=TERM", "7"], ["scancel", "7"]]


def test_cluster_runs_are_the_users_jobs_with_jaxjobs_comment(monkeypatch, tmp_path):
    """`launch list --backend slurm` reads squeue: only jobs whose comment is `jaxjob:<run>`,
    the run folder from the batch script's path (which may hold the separator)."""
    odd = tmp_path / "a|b" / "run-x"
    odd.mkdir(parents=True)
    squeue = (
        f"12|RUNNING|2026-12-07T10:00:00|jaxjob:run-x|{odd}/job.sbatch\n"
        "13|PENDING|2026-12-07T11:00:00|(null)|/home/u/other.sh\n"
        f"14|PENDING|2026-12-07T12:00:00|jaxjob:run-y|{tmp_path}/run-y/job.sbatch\n"
    )
    asked = []

    def run(cmd, *, check=True, timeout=60):
        asked.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, squeue, "")

    from launch.backends.slurm import queue

    monkeypatch.setattr(queue, "run_command", run)
    seen = []

    def status_of(handle: Handle) -> dict:
        seen.append(handle.data)
        return {"state": "running", "detail": "as scontrol says"}

    # squeue prints the controller's local time: Berlin's 12:00 in December is 11:00 UTC.
    import time

    monkeypatch.setenv("TZ", "Europe/Berlin")
    time.tzset()
    try:
        runs = queue.cluster_runs(status_of)
    finally:
        monkeypatch.undo()
        time.tzset()
    assert asked[0][0] == "squeue" and "--noheader" in asked[0]
    assert [(r.run_id, r.submitted, r.where) for r in runs] == [
        ("run-y", "2026-12-07T11:00:00Z", "slurm job 14"),
        ("run-x", "2026-12-07T09:00:00Z", "slurm job 12"),
    ]
    assert {d["job_id"]: d["workdir"] for d in seen} == {"12": str(odd), "14": f"{tmp_path}/run-y"}
