"""`runtime plan CFG --accelerator NAME`: compile the train step for hardware this machine lacks.

The process never looks for chips: JAX_PLATFORMS defaults to cpu before jax starts (compile-only
TPU and GPU devices need no platform), so the command starts as quickly as any other.
Exit codes: 0 the plan fits (or the cpu target, which reports no HBM), 1 it does not fit (the
report is printed all the same), 2 bad input (one sentence).

The other checks of a config before a run are click commands here too: `runtime config
check|schema` (what CONFIG resolves to, with no device) and `runtime preflight` (this machine's
devices, the data, the output and memory: runtime/commands/preflight.py, imported when it runs).
"""

from __future__ import annotations

import contextlib
import json
import sys

import click

from jobspec.errors import ConfigError
from jobspec.exit_codes import EXIT_FAILED
from runtime.commands.common import SET_OPTION, load_config, print_json
from runtime.plan.environment import is_gpu as _is_gpu
from runtime.plan.environment import prepare_environment


def _gib(n: int | float | None) -> str:
    if n is None:
        return "?"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{int(n)} B"


def _flops(n: float | None) -> str:
    return "?" if n is None else f"{n:.3e}"


def _dispatch(d: dict) -> str:
    """The MoE dispatch in a line: dropless ragged_all_to_all + megablox over 8 expert shards."""
    cf = "" if d["capacity_factor"] is None else f" {d['capacity_factor']}"
    if d["kind"] == "dense":
        return "dense (every expert on every token)"
    exchange = "no exchange" if d["exchange"] == "none" else d["exchange"]
    return f"{d['kind']}{cf}: {exchange} + {d['matmul']} over {d['expert_shards']} expert shard(s)"


def _setup_lines(report: dict) -> list[str]:
    """What was compiled: target, mesh, MoE dispatch, compile time."""
    t, mesh = report["target"], report["mesh"]
    return [
        f"target      {t['accelerator']} x {t['hosts']} host(s) x {t['slices']} slice(s) = "
        f"{t['devices']} x {report['device_kind']} ({t['topology']})",
        f"mesh        slices={mesh['slices']} data={mesh['data']} "
        f"expert={mesh['expert']} fsdp={mesh['fsdp']} context={mesh['context']} "
        f"tensor={mesh['tensor']}",
        *(
            [f"moe         {_dispatch(report['moe_dispatch'])}"]
            if report.get("moe_dispatch")
            else []
        ),
        f"compile     {report['compile_seconds']:.1f} s"
        + ("" if report["compiled"] else " (failed: out of memory)"),
    ]


def _memory_lines(m: dict, compiled: bool) -> list[str]:
    """Peak against HBM, its parts per chip (or the compiler's message), the largest buffers."""
    fits = {True: "fits", False: "DOES NOT FIT", None: "no HBM figure"}[m["fits"]]
    head = "" if m["headroom"] is None else f", headroom {m['headroom']:.1%}"
    lines = [
        f"memory      peak {_gib(m['peak_bytes'])} of {_gib(m['hbm_bytes'])}: {fits}{head}"
        + (
            f" (XLA's live peak; the totals add up to {_gib(m['bound_bytes'])})"
            if m.get("peak_source") == "xla" and m.get("bound_bytes") != m["peak_bytes"]
            else ""
        )
    ]
    if compiled:
        a = m["arguments"]
        lines += [
            "  per chip  "
            + "  ".join(
                f"{k} {_gib(v)}"
                for k, v in (
                    ("params", a["parameters"]),
                    ("opt", a["optimizer_state"]),
                    ("other args", a["other"]),
                    ("temp", m["temp_bytes"]),
                    ("out", m["output_bytes"]),
                    ("alias", m["alias_bytes"]),
                )
            )  # fmt: skip
        ]
    else:
        lines.append(f"  compiler  {m['message']}")
    if m.get("largest_buffers"):
        lines.append("  largest buffers")
        for b in m["largest_buffers"][:5]:
            lines.append(f"    {_gib(b['bytes']):>12}  {b['shape']}  {b['name']}")
    return lines


def _work_lines(report: dict) -> list[str]:
    """What a compiled step does per chip: FLOPs, the predicted step time, collectives."""
    f = report["flops"]
    lines = [
        f"FLOPs/chip  compiled {_flops(f['compiled']['per_chip'])}, analytic "
        f"{_flops(f['analytic']['per_chip'])} (ratio {f['compiled_over_analytic']})"
        + (f", {f['seconds_at_peak'] * 1e3:.2f} ms at peak" if f["seconds_at_peak"] else "")
    ]
    st = report.get("step_time")
    if st:
        sec = st["seconds"]
        lines.append(
            f"step time   ~{st['step_seconds']:.3f} s predicted, "
            f"{st.get('tokens_per_s_per_chip', 0):,} tokens/s per chip ({st['bound']}-bound: "
            f"compute {sec['compute']:.3f} s, memory {sec['memory']:.3f} s, "
            f"communication {sec['communication']:.3f} s; a roofline estimate)"
        )
    c = report["collectives"]
    kinds = ", ".join(
        f"{k} {v['count']} ({_gib(v['bytes'])})" for k, v in c["by_kind"].items() if v["count"]
    )
    across = c["total"]["count"] - sum(v["count"] for v in c["within_slice"].values())
    lines.append(f"collectives {c['total']['count']}: {kinds or 'none'}; {across} across slices")
    return lines


def render(report: dict) -> str:
    """The plan report as `runtime plan` prints it without --json."""
    lines = _setup_lines(report) + _memory_lines(report["memory"], report["compiled"])
    if "compiled" in report["flops"]:
        lines += _work_lines(report)
    return "\n".join(lines)


def run_plan(cfg, accelerator: str, hosts: int | None, slices: int, as_json: bool) -> None:
    """`runtime plan`: print the report; exit 1 when it does not fit."""
    from runtime.host import platform

    if not _is_gpu(accelerator):
        return _run_plan(cfg, accelerator, hosts, slices, as_json)
    # Without a GPU, the CUDA plugin's libraries log that they found no driver as they load.
    with platform.dropping_native_lines():
        _run_plan(cfg, accelerator, hosts, slices, as_json)


def _run_plan(cfg, accelerator: str, hosts: int | None, slices: int, as_json: bool) -> None:
    from runtime.plan.compile import plan
    from runtime.plan.targets import check_mesh, resolve_target

    target = resolve_target(accelerator, hosts, slices)
    check_mesh(cfg.mesh.size, cfg.mesh.slices, target)
    report = plan(cfg, target)
    click.echo(json.dumps(report, indent=2) if as_json else render(report))
    if report["memory"]["fits"] is False:
        sys.exit(EXIT_FAILED)


def _fit_row(r: dict) -> str:
    c = r["candidate"]
    what = f"{c.attention:6} {c.remat:14} chunk {c.loss_chunk_size:>4} x{c.accumulation:<2}"
    if c.context > 1:
        what += f" context {c.context}"
    if r.get("error"):
        return f"  {what}  error: {r['error']}"
    peak = _gib(r.get("peak_bytes"))
    if not r.get("compiled", True) or r.get("fits") is False:
        return f"  {what}  peak {peak:>10}  does not fit"
    tps = r.get("predicted_tokens_per_s")
    head = "" if r.get("headroom") is None else f"  headroom {r['headroom']:.1%}"
    return f"  {what}  peak {peak:>10}{head}  ~{tps or 0:,} tokens/s ({r.get('bound')})"


def run_fit(cfg, config_path: str, accelerator: str, hosts, slices: int, as_json: bool,
            overlay: str | None, jobs: int | None) -> None:  # fmt: skip
    """`runtime plan --fit`: the table of what was tried, the pick, and the overlay."""
    from runtime.host import platform

    with platform.dropping_native_lines() if _is_gpu(accelerator) else contextlib.nullcontext():
        from runtime.plan.fit import MIN_HEADROOM, fit, overlay_toml

        def progress(r: dict) -> None:
            if not as_json:
                click.echo(_fit_row(r))

        if not as_json:
            click.echo(
                "attention remat           loss chunk x accumulation  (compiled for "
                + accelerator
                + ")"
            )
        result = fit(cfg, accelerator, hosts, slices, jobs=jobs, progress=progress)
    pick = result["pick"]
    if pick is None:
        smallest = result["smallest_peak_bytes"]
        raise_no_fit = (
            f"nothing fits {accelerator} with {MIN_HEADROOM:.0%} headroom: the smallest peak "
            f"found was {_gib(smallest)} per chip of {_gib(result['target']['hbm_bytes_per_chip'])}"
            if smallest
            else f"nothing compiled for {accelerator}"
        )
        if as_json:
            click.echo(json.dumps(_jsonable(result), indent=2))
        click.echo(f"error: {raise_no_fit}; use more chips or a smaller batch", err=True)
        sys.exit(EXIT_FAILED)
    c = pick["candidate"]
    text = overlay_toml(c, result["sequences_per_step"], config_path, overlay or config_path,
                        accelerator, (cfg.mesh.context, cfg.mesh.fsdp))  # fmt: skip
    if overlay:
        with open(overlay, "w") as f:
            f.write(text)
    if as_json:
        click.echo(json.dumps(_jsonable(result) | {"overlay": text}, indent=2))
        return
    tps = pick["predicted_tokens_per_s"]
    click.echo(
        f"pick: attention {c.attention}, remat {c.remat}, loss_chunk_size {c.loss_chunk_size}, "
        f"gradient_accumulation_steps {c.accumulation}"
        + (
            f", mesh.context {c.context} x mesh.fsdp {c.fsdp}"
            if c.context != cfg.mesh.context
            else ""
        )
        + (f" (~{tps:,} tokens/s per chip predicted)" if tps else "")
        + f"; {len(result['tried'])} compiled, {len(result['skipped'])} not compiled (they need "
        f"the memory of one that did not fit), {len(result['not_compiled_slower'])} not compiled "
        "(more accumulation of a setting that fits)" + _unranked(result, accelerator)
    )
    click.echo(f"wrote {overlay}: runtime local {overlay}" if overlay else text.rstrip())


def _unranked(result: dict, accelerator: str) -> str:
    """The candidates a target with no step time (cpu) leaves uncompiled after its pick."""
    n = len(result["not_compiled_unranked"])
    return f", {n} not compiled (no step time on {accelerator} to rank them by)" if n else ""


def _jsonable(result: dict) -> dict:
    def row(r: dict) -> dict:
        return {**r, "candidate": r["candidate"].__dict__}

    return {**result, "tried": [row(r) for r in result["tried"]],
            "pick": row(result["pick"]) if result["pick"] else None}  # fmt: skip


@click.group("config")
def config_group() -> None:
    """Check run configs and print their schema."""


@config_group.command("check")
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@SET_OPTION
def config_check(config: str, as_json: bool, sets: tuple[str, ...]) -> None:
    """Validate CONFIG and show what it resolves to: sizes, FLOPs, tokens per step."""
    from jobspec.files.run_toml import resolved_dict
    from runtime.model.flops import flops_per_token, parameter_counts

    cfg, _ = load_config(config, sets)
    from runtime.data.eval_rows import check_evals_of_config

    # An eval whose split gives no row is an error (exit 2) when a local manifest says so.
    for small in check_evals_of_config(cfg, remote=False) or []:
        click.echo(f"warning: {small['message']}", err=True)
    t = cfg.training
    info = {
        "config": config,
        "resolved": resolved_dict(cfg),
        "parameters": parameter_counts(cfg.model),
        "flops_per_token": flops_per_token(cfg.model, t.seq_len),
        "tokens_per_step": t.tokens_per_step,
        "total_steps": t.total_steps,
        "mesh_devices": cfg.mesh.size,
        "run_dir": f"{cfg.run.output_uri.rstrip('/')}/{cfg.run.id}",
    }
    if as_json:
        print_json(info)
        return
    p = info["parameters"]
    click.echo(f"{config}: valid")
    click.echo(f"  run dir          {info['run_dir']}")
    click.echo(f"  parameters       {p['total']:,} ({p['non_embedding']:,} without the embedding)")
    click.echo(
        f"  FLOPs/token      {info['flops_per_token']['total']:,.0f} (6N + attention, no causal halving)"
    )
    click.echo(
        f"  tokens/step      {t.tokens_per_step:,} = {t.global_batch_size} x {t.gradient_accumulation_steps} x {t.seq_len}"
        " (global_batch_size x gradient_accumulation_steps x seq_len)"
    )
    click.echo(f"  steps            {t.total_steps:,} to reach {t.target_tokens:,} tokens")
    click.echo(
        f"  mesh             slices={cfg.mesh.slices} data={cfg.mesh.data} expert={cfg.mesh.expert} fsdp={cfg.mesh.fsdp} context={cfg.mesh.context} tensor={cfg.mesh.tensor} ({cfg.mesh.size} device{'' if cfg.mesh.size == 1 else 's'})"
    )


@config_group.command("schema")
def config_schema() -> None:
    """Print the JSON Schema of the run config (for editors)."""
    from jobspec.files.run_toml import run_config_schema

    print_json(run_config_schema())


@click.command("preflight")
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True)
@SET_OPTION
def preflight_cmd(config: str, as_json: bool, sets: tuple[str, ...]) -> None:
    """Check devices, mesh fit, data, output and memory before a run."""
    from runtime.commands.preflight import preflight

    cfg, _ = load_config(config, sets)
    report = preflight(cfg)
    if as_json:
        print_json(report)
    else:
        for check in report["checks"]:
            mark = "ok  " if check["ok"] else "FAIL"
            click.echo(f"{mark} {check['name']:<10} {check['detail']}")
    if not all(c["ok"] for c in report["checks"]):
        sys.exit(EXIT_FAILED)


@click.command("plan")
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("--accelerator", required=True, help="Catalogue name, e.g. tpu-v5p-256, h100-80gb.")
@click.option("--hosts", type=int, default=None, help="Hosts (GPU nodes); TPU: fixed by the slice.")
@click.option("--slices", type=int, default=1, show_default=True, help="TPU slices.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option(
    "--fit",
    is_flag=True,
    help="Search remat, loss_chunk_size, gradient accumulation (within the step's global batch) "
    "and attention: compile the candidates, keep those that fit with 5% headroom, pick the best "
    "predicted tokens/s.",
)
@click.option(
    "-o",
    "--out",
    "overlay",
    type=click.Path(dir_okay=False),
    default=None,
    help="With --fit: write the pick as a run config that includes CONFIG (runtime local OUT).",
)
@click.option(
    "--jobs", type=click.IntRange(min=1), default=None, help="With --fit: compiles at once."
)
@SET_OPTION
def plan_cmd(
    config: str,
    accelerator: str,
    hosts: int | None,
    slices: int,
    as_json: bool,
    fit: bool,
    overlay: str | None,
    jobs: int | None,
    sets: tuple[str, ...],
) -> None:
    """Compile CONFIG's train step for an accelerator this machine need not have; report memory
    per chip, predicted step time, FLOPs and collectives. Exits 0 fits, 1 does not fit (report
    printed; with --fit: no candidate fits), 2 bad input."""
    if (overlay or jobs) and not fit:
        raise ConfigError("--out and --jobs go with --fit (runtime plan CFG --accelerator A --fit)")
    prepare_environment(accelerator)
    cfg, _ = load_config(config, sets)
    if fit:
        run_fit(cfg, config, accelerator, hosts, slices, as_json, overlay, jobs)
    else:
        run_plan(cfg, accelerator, hosts, slices, as_json)
