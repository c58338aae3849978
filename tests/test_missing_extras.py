"""A command whose optional extra is not installed says which to install, in one sentence (exit 2).

Each command runs in a subprocess where the extra's modules cannot be imported: a
`sitecustomize` on PYTHONPATH puts a finder first on sys.meta_path that raises
ModuleNotFoundError for them, as a core install without them would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from runs import stderr_lines

ROOT = Path(__file__).resolve().parents[1]
BLOCKER = """import os, sys


class _Missing:
    \"\"\"A finder that says the blocked modules (and their submodules) are not installed.\"\"\"

    names = tuple(n for n in os.environ["JAXJOB_TEST_BLOCK"].split(",") if n)

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if any(name == n or name.startswith(n + ".") for n in cls.names):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _Missing)
"""


ENTRY = {"runtime": "runtime.commands.cli", "launch": "launch.cli"}


def _run(
    tmp_path: Path, blocked: str, *argv: str, cwd: Path = ROOT, env: dict | None = None
) -> subprocess.CompletedProcess:
    """`argv` (`runtime ...` or `launch ...`) with the `blocked` modules missing."""
    site = tmp_path / "blocker"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(BLOCKER)
    path = os.pathsep.join(p for p in (str(site), str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, **(env or {}), "PYTHONPATH": path, "JAXJOB_TEST_BLOCK": blocked}
    main = f"from {ENTRY[argv[0]]} import main; main()"
    return subprocess.run(
        [sys.executable, "-c", main, *argv[1:]],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


PLAN = ("runtime", "plan", "configs/tiny_plan.toml")


@pytest.mark.parametrize(
    "blocked, argv, needs",
    [
        ("libtpu", (*PLAN, "--accelerator", "tpu-v5p-8", "--set", "mesh.fsdp=4"), "libtpu"),
        (
            "jax_cuda12_plugin,jax_plugins.xla_cuda12",
            (*PLAN, "--accelerator", "h100-80gb", "--set", "mesh.fsdp=8"),
            "jax-cuda12-plugin and jax-cuda12-pjrt",
        ),
        ("libtpu", ("launch", "plan", "configs/jobs/qwen3-8b-v5p-256.yaml"), "libtpu"),
    ],
    ids=["runtime-plan-tpu", "runtime-plan-gpu", "launch-plan-tpu"],
)
def test_a_plan_without_its_compiler_names_the_plan_extra(tmp_path, blocked, argv, needs):
    proc = _run(tmp_path, blocked, *argv)
    assert proc.returncode == 2, proc.stderr
    acc = argv[argv.index("--accelerator") + 1] if "--accelerator" in argv else "tpu-v5p-256"
    assert stderr_lines(proc.stderr) == [
        f"error: runtime plan for {acc} needs {needs}, which "
        f"{'are' if ' and ' in needs else 'is'} not installed; install the plan extra: "
        "pip install 'jaxjob[plan]'"
    ]


def test_a_cpu_plan_needs_no_extra(tmp_path):
    blocked = "libtpu,jax_cuda12_plugin,jax_plugins.xla_cuda12"
    proc = _run(tmp_path, blocked, *PLAN, "--accelerator", "cpu", "--json")
    assert proc.returncode == 0, proc.stderr
    assert '"accelerator": "cpu"' in proc.stdout


def test_a_gs_run_without_gcsfs_names_the_gcs_extra(tmp_path):
    cfg = tmp_path / "gs.toml"
    cfg.write_text(
        f'include = ["{ROOT / "configs" / "smoke.toml"}"]\n[run]\noutput_uri = "gs://bucket/x"\n'
    )
    proc = _run(tmp_path, "gcsfs", "runtime", "local", str(cfg), "--max-steps", "1", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert stderr_lines(proc.stderr) == [
        "error: gs://bucket/x/smoke is a gs:// URI but gcsfs is not installed; install jaxjob "
        "with the 'gcs' extra (pip install 'jaxjob[gcs]')"
    ]


def test_a_k8s_submit_without_the_client_names_the_k8s_extra(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(
        "name: t\nimage: ghcr.io/me/jaxjob:1\nrun: run.toml\naccelerator: cpu\n"
        "output_uri: gs://bucket/runs\n"
    )
    (tmp_path / "run.toml").write_text(f'include = ["{ROOT / "configs" / "smoke.toml"}"]\n')
    state = {"XDG_STATE_HOME": str(tmp_path / "state")}  # this test's own run registry
    argv = ("launch", "submit", str(job), "--backend", "k8s")
    proc = _run(tmp_path, "kubernetes", *argv, env=state)
    assert proc.returncode == 2, proc.stderr
    assert stderr_lines(proc.stderr) == [
        "error: talking to a cluster (--backend k8s) needs kubernetes, which is not installed; "
        "install the k8s extra: pip install 'jaxjob[k8s]'"
    ]
    rendered = _run(tmp_path, "kubernetes", "launch", "render", str(job), "--backend", "k8s")
    assert rendered.returncode == 0 and "kind: JobSet" in rendered.stdout, rendered.stderr
