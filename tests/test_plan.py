"""`runtime plan` and `launch plan`: the train step compiled for TPU, GPU and CPU targets.

Tiny model (vocab 512, hidden 64, 2 layers, seq 64), compile-only TPU and GPU devices; the CPU
checks that need 8 host devices run in a subprocess (the device count is fixed at import).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
import tomli_w
import yaml

from jobspec.errors import ConfigError
from jobspec.files.run_toml import parse_run_config

from runs import ROOT, run_cli, xla_flags

MODEL = {"vocab_size": 512, "hidden_size": 64, "num_layers": 2, "num_heads": 4,
         "num_kv_heads": 2, "intermediate_size": 128, "max_position_embeddings": 64}  # fmt: skip


def tiny(fsdp: int = 1, batch: int = 8, **model) -> dict:
    return {
        "run": {"id": "plan", "output_uri": "/tmp/jaxjob-plan-test"},
        "model": {**MODEL, **model},
        "data": {"manifest": "/nonexistent/manifest.json"},
        "training": {"seq_len": 64, "global_batch_size": batch, "target_tokens": 64 * batch * 10},
        "mesh": {"fsdp": fsdp},
    }


@pytest.fixture
def cfg_path(tmp_path: Path) -> Path:
    p = tmp_path / "tiny.toml"
    p.write_text(tomli_w.dumps(tiny()))
    return p


def _plan_json(cfg_path: Path, *args: str) -> dict:
    r = run_cli("plan", str(cfg_path), "--json", *args)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)


def _check_report(rep: dict, devices: int) -> None:
    assert rep["compiled"] is True and rep["target"]["devices"] == devices
    m = rep["memory"]
    for key in ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "peak_bytes"):
        assert isinstance(m[key], int) and m[key] >= 0, key
    a = m["arguments"]
    assert a["parameters"] > 0 and a["optimizer_state"] > a["parameters"]  # AdamW: 2 moments
    assert (
        m["bound_bytes"]
        == m["argument_bytes"] + m["temp_bytes"] + m["output_bytes"] - m["alias_bytes"]
    )
    # XLA's liveness peak: at least every argument (live all step), at most the sum of totals.
    assert m["peak_source"] == "xla"
    assert m["argument_bytes"] <= m["peak_bytes"] <= m["bound_bytes"]
    assert m["fits"] is True and 0 < m["headroom"] <= 1 and m["hbm_bytes"] > 2**30
    st = rep["step_time"]
    assert st["step_seconds"] > 0 and st["bound"] in ("compute", "memory", "communication")
    assert st["tokens_per_s_per_chip"] > 0 and st["largest"]
    assert m["largest_buffers"] and all(b["bytes"] > 0 and b["shape"] for b in m["largest_buffers"])
    f = rep["flops"]
    assert f["analytic"]["per_step"] == pytest.approx(f["analytic"]["per_chip"] * devices)
    # Every matmul of the step, sharded over the mesh: the analytic 6N + attention per chip.
    assert 0.9 < f["compiled_over_analytic"] < 1.1, f
    assert f["peak_flops_per_chip"] > 1e14 and f["seconds_at_peak"] > 0
    c = rep["collectives"]
    assert c["total"]["count"] > 0 and c["by_kind"]["all-gather"]["count"] > 0
    assert c["by_kind"]["all-gather"]["bytes"] > 0
    assert rep["compile_seconds"] > 0
    json.dumps(rep)


def test_plan_tpu_v5p_8_fsdp_4(cfg_path: Path) -> None:
    rep = _plan_json(cfg_path, "--accelerator", "tpu-v5p-8", "--set", "mesh.fsdp=4")
    assert rep["device_kind"] == "TPU v5" and rep["target"]["topology"] == "2x2x1"
    _check_report(rep, 4)
    assert rep["memory"]["hbm_bytes"] == int(95.74 * 2**30)  # what the compiler offers


def test_plan_deviceless_h100_node_fsdp_8(cfg_path: Path) -> None:
    rep = _plan_json(cfg_path, "--accelerator", "h100-80gb", "--hosts", "1", "--set", "mesh.fsdp=8")
    assert "H100" in rep["device_kind"] and rep["target"]["topology"] == "1x1x8"
    _check_report(rep, 8)


def test_plan_of_a_tiny_moe_with_expert_parallelism_holds_the_ragged_all_to_all(
    tmp_path: Path,
) -> None:
    moe = {"family": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2,
           "moe_intermediate_size": 64, "compute_dtype": "bfloat16"}  # fmt: skip
    cfg = tmp_path / "moe.toml"
    cfg.write_text(tomli_w.dumps(tiny(**moe)))
    rep = _plan_json(
        cfg, "--accelerator", "tpu-v5p-8", "--set", "mesh.expert=2", "--set", "mesh.fsdp=2"
    )
    assert rep["compiled"] is True and rep["mesh"]["expert"] == 2
    assert rep["moe_dispatch"] == {"kind": "dropless", "exchange": "ragged_all_to_all",
                                   "matmul": "megablox", "expert_shards": 2,
                                   "capacity_factor": None}  # fmt: skip
    ragged = rep["collectives"]["ragged_all_to_all"]
    # 2 scanned layers, no remat: out and back in the forward, and again in the backward.
    assert ragged["count"] >= 8 and ragged["bytes"] > 0
    assert rep["collectives"]["by_kind"]["all-to-all"]["count"] >= ragged["count"]


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (("--accelerator", "tpu-v9-8"), "--accelerator"),
        (("--accelerator", "tpu-v5p-8", "--set", "mesh.fsdp=8"), "mesh.fsdp"),
        (
            (
                "--accelerator",
                "h100-80gb",
                "--slices",
                "2",
                "--set",
                "mesh.fsdp=16",
                "--set",
                "training.global_batch_size=16",
            ),
            "--slices",
        ),
        (
            (
                "--accelerator",
                "tpu-v5p-32",
                "--hosts",
                "2",
                "--set",
                "mesh.fsdp=16",
                "--set",
                "training.global_batch_size=16",
            ),
            "--hosts",
        ),
    ],
)
def test_bad_targets_are_one_sentence_and_exit_2(cfg_path: Path, capsys, args, names) -> None:
    from runtime.commands.cli import main

    with pytest.raises(SystemExit) as e:
        main(["plan", str(cfg_path), *args])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and names in err, err


def test_resolve_target_shapes() -> None:
    from runtime.plan.targets import resolve_target

    t = resolve_target("tpu-v5p-256", slices=2)
    assert (t.hosts, t.chips_per_host, t.device_count, t.topology) == (32, 4, 256, "4x4x8")
    g = resolve_target("h200", hosts=4)
    assert (g.device_count, g.topology, g.hbm_bytes) == (32, "1x4x8", 141 * 10**9)
    with pytest.raises(ConfigError, match="--hosts"):
        resolve_target("cpu", hosts=2)


_SCALING = textwrap.dedent(
    """
    import json, sys
    from jobspec.files.run_toml import parse_run_config
    from runtime.plan.compile import plan
    from runtime.plan.targets import resolve_target
    base = json.loads(sys.argv[1])
    out = {}
    for fsdp in (1, 2, 4, 8):
        raw = dict(base, mesh={"fsdp": fsdp, "data": 8 // fsdp})
        rep = plan(parse_run_config(raw, "tiny"), resolve_target("cpu"))
        out[fsdp] = {"temp": rep["memory"]["temp_bytes"],
                     "all_gathers": rep["collectives"]["by_kind"]["all-gather"]["count"],
                     "buffers": rep["memory"]["largest_buffers"]}
    print(json.dumps(out))
    """
)


def _cpu8(script: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "XLA_FLAGS": xla_flags(8),
           "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}  # fmt: skip
    return subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip


def test_fsdp_shrinks_per_device_temporaries_and_shards_the_batch() -> None:
    """On 8 CPU devices (data x fsdp = 8, so the batch is always split 8 ways): as fsdp grows,
    parameters and optimizer state shard further and temporaries fall; no per-device buffer
    carries the global batch (24 rows; every chip should hold 3)."""
    batch = 24
    r = _cpu8(_SCALING, json.dumps(tiny(batch=batch)))
    assert r.returncode == 0, r.stderr[-3000:]
    out = {int(k): v for k, v in json.loads(r.stdout.strip().splitlines()[-1]).items()}
    temps = [out[f]["temp"] for f in (1, 2, 4, 8)]
    assert all(a > b for a, b in zip(temps, temps[1:], strict=False)), temps
    assert out[8]["all_gathers"] > 0
    for fsdp, o in out.items():
        full = [b for b in o["buffers"] if any(d and d[0] == batch for d in b["dims"])]
        assert not full, (fsdp, full)


def test_matmul_flops_agree_with_cost_analysis_and_count_every_loop_iteration() -> None:
    """Unrolled, the HLO count equals XLA's cost analysis (a chain of matmuls has no other
    work); scanned, cost analysis counts the loop body once, the HLO count every iteration."""
    from runtime.plan.hlo import analyse

    w = jax.ShapeDtypeStruct((6, 64, 64), jnp.float32)
    x = jax.ShapeDtypeStruct((32, 64), jnp.float32)

    def unrolled(w, x):
        for i in range(6):
            x = x @ w[i]
        return x

    def scanned(w, x):
        return jax.lax.scan(lambda h, wi: (h @ wi, None), x, w)[0]

    expected = 6 * 2 * 32 * 64 * 64
    cu = jax.jit(unrolled).lower(w, x).compile()
    assert cu.cost_analysis()["flops"] == pytest.approx(expected)
    assert analyse(cu.as_text())["matmul_flops"] == pytest.approx(expected)
    cs = jax.jit(scanned).lower(w, x).compile()
    rep = analyse(cs.as_text())
    assert rep["loops"] and rep["loops"][0]["trip_count"] == 6
    assert rep["matmul_flops"] == pytest.approx(expected)


def test_tiny_model_flops_match_cost_analysis_unrolled() -> None:
    """The tiny model's step on one CPU device (no loops): matmul FLOPs from the HLO are the
    bulk of cost analysis' total (which also counts elementwise work) and match 6N + attention."""
    from runtime.model.sharding import build_mesh
    from runtime.plan.compile import analytic_flops
    from runtime.plan.hlo import analyse
    from runtime.train.program import abstract_program

    # Unrolled layers: cost analysis counts a loop body once, so only a loop-free step compares.
    cfg = parse_run_config(tiny(scan_layers=False), "tiny")
    prog = abstract_program(cfg, build_mesh(cfg.mesh, jax.devices()[:1]))
    compiled = prog.step.lower(prog.state, prog.batch).compile()
    rep = analyse(compiled.as_text())
    total = compiled.cost_analysis()["flops"]
    assert not rep["loops_of_unknown_trip_count"]
    assert 0.7 * total < rep["matmul_flops"] <= total, (rep["matmul_flops"], total)
    analytic = analytic_flops(cfg, 1)["per_chip"]
    assert rep["matmul_flops"] == pytest.approx(analytic, rel=0.05)
    # The same step with its layers scanned: the HLO count multiplies the loop body by its trip
    # count, so it finds the unrolled step's FLOPs (cost analysis would count one layer).
    scanned = parse_run_config(tiny(scan_layers=True), "tiny")
    prog = abstract_program(scanned, build_mesh(scanned.mesh, jax.devices()[:1]))
    rep_scan = analyse(prog.step.lower(prog.state, prog.batch).compile().as_text())
    assert any(loop["trip_count"] == scanned.model.num_layers for loop in rep_scan["loops"])
    assert rep_scan["matmul_flops"] == pytest.approx(rep["matmul_flops"], rel=0.01)


def test_replica_groups_forms() -> None:
    from runtime.plan.hlo import replica_groups

    assert replica_groups("replica_groups={{0,1},{2,3}}, x") == [[0, 1], [2, 3]]
    assert replica_groups("replica_groups=[2,2]<=[4]") == [[0, 1], [2, 3]]
    assert replica_groups("replica_groups=[2,2]<=[2,2]T(1,0)") == [[0, 2], [1, 3]]
    assert replica_groups("replica_groups=mesh['a'=2,'b'=2] {'a'}, d") == [[0, 2], [1, 3]]


def test_launch_plan_runs_runtime_plan_for_the_job(tmp_path: Path) -> None:
    job = {"name": "plan-job", "accelerator": "cpu", "hosts": 1, "run": tiny(fsdp=2),
           "local": {"processes": 1, "devices_per_process": 2}}  # fmt: skip
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state")}
    r = subprocess.run([sys.executable, "-m", "launch.cli", "plan", str(path), "--json"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads(r.stdout)
    assert rep["target"] == {**rep["target"], "accelerator": "cpu", "devices": 2}
    assert rep["compiled"] and rep["memory"]["temp_bytes"] > 0 and rep["memory"]["fits"] is None


# Plans for one v5e chip in one process, as `runtime plan --fit` compiles its candidates; each
# row also counts how often the plan parsed its compiled program's text.
_V5E = textwrap.dedent(
    """
    import json, sys
    from runtime.host import platform
    platform.choose()
    from runtime.plan.environment import prepare_environment
    prepare_environment("tpu-v5e-1")
    from jobspec.files.run_toml import parse_run_config
    from runtime.plan import hlo
    from runtime.plan.compile import plan
    from runtime.plan.targets import resolve_target

    parse, parses = hlo.Module.parse, []
    def counted(text):
        parses.append(len(text))
        return parse(text)
    hlo.Module.parse = counted
    out = {}
    for name, raw in json.loads(sys.argv[1]).items():
        parses.clear()
        rep = plan(parse_run_config(raw, name), resolve_target("tpu-v5e-1"))
        out[name] = {"peak": rep["memory"]["peak_bytes"], "parses": len(parses),
                     "step_seconds": rep["step_time"]["step_seconds"]}
    print(json.dumps(out))
    """
)
# Half the float32 logits is what the bfloat16 ones save: 2 MiB here, 8% of the step's peak.
_LOGITS = {"batch": 8, "seq": 64, "vocab": 2048}


@pytest.fixture(scope="module")
def v5e_plans() -> dict[str, dict]:
    """The whole-sequence loss with float32 and with bfloat16 logits, planned for tpu-v5e-1."""
    raws = {}
    for dtype in ("float32", "bfloat16"):
        raw = tiny(batch=_LOGITS["batch"], vocab_size=_LOGITS["vocab"])
        raw["training"] |= {"loss_chunk_size": 0, "logits_dtype": dtype}
        raws[dtype] = raw
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", _V5E, json.dumps(raws)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_bf16_whole_logits_save_half_the_logits_on_tpu(v5e_plans: dict) -> None:
    """`training.logits_dtype = "bfloat16"` with the whole-sequence loss, compiled for a v5e chip:
    the step's peak falls by half the float32 [B, T, V] logits, to within 1% (with no float32
    copy, which XLA would otherwise keep between the matmul, the softmax's reductions and the
    gradient, the peak would not fall at all)."""
    peaks = {dtype: v5e_plans[dtype]["peak"] for dtype in ("float32", "bfloat16")}
    half = _LOGITS["batch"] * _LOGITS["seq"] * _LOGITS["vocab"] * 2
    assert peaks["float32"] - peaks["bfloat16"] >= 0.99 * half, peaks


def test_a_plan_parses_its_compiled_program_once(v5e_plans: dict) -> None:
    """The FLOPs, collectives and predicted step time all come from one parse of the compiled
    program's text (a real model's runs to hundreds of thousands of lines)."""
    for dtype, row in v5e_plans.items():
        assert row["step_seconds"] > 0, dtype
        assert row["parses"] == 1, (dtype, row)
