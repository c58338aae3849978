"""On a machine without an accelerator, a command's stderr is what it means to say, nothing more.

The dev environment has libtpu and the CUDA plugin installed, which used to log CUDA probing,
a plugin traceback and libtpu's host-bounds warnings on every command. Each command here runs
as a user runs it: JAX_PLATFORMS unset (the test process sets it for itself), so `runtime`
chooses the platform (runtime/host/platform.py).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.host import platform

from runs import ROOT, tiny_config, user_env, write_config

NOISE = re.compile(r"Traceback|cudart|InitializeLog|libtpu|TPU_|plugin configuration|CUDA")


def runtime(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "runtime", *args], cwd=ROOT, env=user_env(),
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def test_bad_output_dir_is_one_sentence(tmp_path, prepared):
    cfg = write_config(tmp_path / "c.toml", tiny_config(prepared, "/proc/no-such-dir"))
    res = runtime("local", str(cfg))
    assert res.returncode == 2, res.stderr
    assert res.stderr.splitlines() == [
        "error: cannot create output directory /proc/no-such-dir/t: No such file or directory; "
        "choose a writable run.output_uri"
    ], res.stderr


def test_config_check_prints_no_probing(tmp_path, prepared):
    cfg = write_config(tmp_path / "c.toml", tiny_config(prepared, str(tmp_path / "runs")))
    res = runtime("config", "check", str(cfg))
    assert res.returncode == 0 and res.stderr == "", res.stderr
    assert "tensor=1 (1 device)\n" in res.stdout, res.stdout  # one device, not "1 devices"
    bad = tmp_path / "bad.toml"
    bad.write_text(cfg.read_text().replace("hidden_size = 32", "hidden_size = -4"))
    res = runtime("config", "check", str(bad))
    assert res.returncode == 2
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "hidden_size" in lines[0], lines
    assert not NOISE.search(res.stderr)


@pytest.mark.slow
def test_a_short_run_prints_only_its_own_lines(tmp_path, prepared):
    cfg = write_config(tmp_path / "c.toml", tiny_config(prepared, str(tmp_path / "runs")))
    res = runtime("local", str(cfg), "--max-steps", "2")
    assert res.returncode == 0, res.stderr
    # stderr: the closing line alone (start-up lines show on a terminal only).
    assert res.stderr.splitlines() == [
        f"run t stopped: step 2 of 20, final loss {_final_loss(tmp_path)}; "
        f"{tmp_path / 'runs' / 't'}"
    ], res.stderr


def _final_loss(tmp_path: Path) -> str:
    import json

    return format(
        json.loads((tmp_path / "runs/t/summaries/final.json").read_text())["final_loss"], ".4g"
    )


# A plan for a GPU target prints no probing either: tests/test_plan_fit.py's `--fit` for an
# H100 runs as a user runs it (user_env) and checks that its stderr is empty.


def test_platform_follows_the_devices(tmp_path):
    def fake_root(*paths: str) -> str:
        root = tmp_path / f"root{len(list(tmp_path.iterdir()))}"
        for p in paths:
            (root / p).parent.mkdir(parents=True, exist_ok=True)
            (root / p).touch()
        root.mkdir(exist_ok=True)
        return str(root)

    # The dev extra installs libtpu and the CUDA plugin, so only the devices decide here.
    assert platform.detect(fake_root()) == "cpu"
    assert platform.detect(fake_root("dev/vfio/vfio")) == "cpu"  # the control node alone
    assert platform.detect(fake_root("dev/vfio/0")) == "tpu,cpu"
    assert platform.detect(fake_root("dev/accel0")) == "tpu,cpu"
    assert platform.detect(fake_root("dev/nvidia0")) == "cuda,cpu"
    env = {"JAX_PLATFORMS": "cuda"}
    assert platform.choose(env) == "cuda"  # the user's choice is kept
