"""Compile the run's train step for a target and report what each chip would hold and do.

`plan(cfg, target)` lowers `runtime.train.program.abstract_program` (the step `runtime worker`
jits, with its shardings, donation and accumulation) on the target's mesh, compiles it and
reads the compiled program: memory per chip (XLA's own accounting), matmul FLOPs and
collectives counted over every loop iteration (`runtime.plan.hlo`), and the largest buffers.
A TPU compile that runs out of HBM raises; the report then carries the compiler's message and
the largest buffers of the dumped buffer assignment. A GPU compile never fails on memory: peak
is compared with HBM here.
"""

from __future__ import annotations

import glob
import os
import re
import tempfile
import time
from typing import Any

import jax

from jobspec.run_config import RunConfig
from runtime.model.flops import flops_per_token, parameter_counts
from runtime.model.moe import dispatch as moe_dispatch
from runtime.model.sharding import build_mesh
from runtime.plan import hlo, steptime
from runtime.plan.targets import Target, check_mesh
from runtime.train.program import OUT_OF_MEMORY as _OOM
from runtime.train.program import AbstractProgram, abstract_program, compile_first_fitting


def _shard_bytes(tree: Any) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        n = 1
        for d in shape:
            n *= d
        total += n * leaf.dtype.itemsize
    return total


def memory_report(
    compiled: Any, prog: AbstractProgram, hbm: int | None, *, compiler_checked: bool = False
) -> dict[str, Any]:
    """Per-device bytes of a compiled step.

    peak is XLA's own peak of live memory over the program (`peak_memory_in_bytes`: arguments,
    outputs and temporaries by liveness, donated buffers reused). `bound` = arguments +
    temporaries + outputs - aliased outputs is what the separate totals add up to; it overstates
    the peak, since the temporaries' allocation can reuse what donated arguments free. Measured
    on a TPU v5e chip: Qwen3-0.6B, seq 2,048 x 8 has a bound of 18.72 GiB and a peak of 14.00,
    and it trains in the chip's 15.75 GiB. Where XLA gives no peak the bound stands in.
    `compiler_checked`: the compiler itself placed the program in the device's HBM (a TPU
    compile fails when it cannot), so it fits whatever the arithmetic says. Generated code is
    reported apart (small).
    """
    ma = compiled.memory_analysis()
    args, out = int(ma.argument_size_in_bytes), int(ma.output_size_in_bytes)
    alias, temp = int(ma.alias_size_in_bytes), int(ma.temp_size_in_bytes)
    params = _shard_bytes(prog.state.params)
    opt = _shard_bytes(prog.state.opt_state)
    bound = args + temp + out - alias
    xla_peak = int(getattr(ma, "peak_memory_in_bytes", 0) or 0)
    peak = xla_peak or bound
    rep: dict[str, Any] = {
        "source": "compiled",
        "argument_bytes": args,
        "arguments": {
            "parameters": params,
            "optimizer_state": opt,
            "other": max(args - params - opt, 0),
        },  # fmt: skip
        "output_bytes": out,
        "alias_bytes": alias,
        "temp_bytes": temp,
        "generated_code_bytes": int(ma.generated_code_size_in_bytes),
        "peak_bytes": peak,
        "peak_source": "xla" if xla_peak else "bound",
        "bound_bytes": bound,
    }
    rep.update(_fit(peak, hbm))
    if compiler_checked and hbm is not None:
        rep["fits"] = True
    return rep


def _fit(peak: int | None, hbm: int | None) -> dict[str, Any]:
    if hbm is None or peak is None:
        return {"hbm_bytes": hbm, "fits": None, "headroom": None}
    return {"hbm_bytes": hbm, "fits": peak <= hbm, "headroom": round(1 - peak / hbm, 4)}


def _gib(text: str) -> int | None:
    m = re.match(r"([0-9.]+)\s*([KMGT]?)i?B?", text)
    if not m:
        return None
    return int(float(m.group(1)) * 1024 ** "_KMGT".index(m.group(2) or "_"))


def oom_report(message: str, dump_dir: str, hbm: int | None) -> dict[str, Any]:
    """What a failed (out of memory) TPU compile says: its message, the figures in it, and the
    largest buffers of the buffer assignment it dumped, if any."""
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    head = next((ln for ln in lines if _OOM.search(ln)), lines[0] if lines else message)
    rep: dict[str, Any] = {"source": "compiler error", "message": head[:600], "peak_bytes": None}
    m = re.search(r"Used\s+([0-9.]+[KMGT]?)\s+of\s+([0-9.]+[KMGT]?)\s+hbm", message)
    if m:
        rep["peak_bytes"], rep["compiler_hbm_bytes"] = _gib(m.group(1)), _gib(m.group(2))
    m = re.search(r"required for ([\w ]+?) \(([0-9.]+[KMGT]?)\)", message)
    if m:
        # What the compiler could not place (e.g. "HLO temporaries"): a lower bound on peak.
        rep["required_for"], rep["required_bytes"] = m.group(1), _gib(m.group(2))
        rep["peak_bytes"] = rep["peak_bytes"] or rep["required_bytes"]
    m = re.search(r"exceeds available HBM \(([0-9.]+[KMGT]?)\)", message)
    if m:
        rep["compiler_hbm_bytes"] = _gib(m.group(1))
    rep.update(_fit(rep["peak_bytes"], hbm))
    rep["fits"] = False
    rep["largest_buffers"] = _dumped_buffers(dump_dir)
    return rep


def _dumped_buffers(dump_dir: str, top: int = 10) -> list[dict[str, Any]]:
    """The largest buffers of the last optimized module XLA dumped before it gave up."""
    if not dump_dir:
        return []
    texts = sorted(glob.glob(os.path.join(dump_dir, "*after_optimizations.txt")))
    texts = texts or sorted(glob.glob(os.path.join(dump_dir, "*before_optimizations.txt")))
    if not texts:
        return []
    with open(texts[-1]) as f:
        return hlo.analyse(f.read(), top=top)["largest_buffers"]


def analytic_flops(cfg: RunConfig, devices: int) -> dict[str, float]:
    t = cfg.training
    f = flops_per_token(cfg.model, t.seq_len)
    per_step = f["total"] * t.tokens_per_step
    return {
        "per_step": per_step,
        "per_chip": per_step / devices,
        # 6N and 12LHQT apart: a fused attention kernel is a custom call whose FLOPs the HLO
        # count cannot see, so its program is compared with the dense part alone.
        "dense_per_chip": f["dense"] * t.tokens_per_step / devices,
        "attention_per_chip": f["attention"] * t.tokens_per_step / devices,
    }


def compile_program(cfg: RunConfig, devices: list, dump_dir: str | None = None):
    """(abstract program, compiled step or the exception, seconds): the step on `devices`; for
    remat "auto", the first of its choices that fits (`prog.cfg` says which)."""
    mesh = build_mesh(cfg.mesh, devices)
    options = {}
    if dump_dir is not None:
        # The optimized module and its buffer assignment are dumped even when the compile
        # then fails on memory, which is how an out-of-memory plan still names its buffers.
        options = {"xla_dump_to": dump_dir}

    def compile_one(c: RunConfig):
        prog = abstract_program(c, mesh)
        lowered = prog.step.lower(prog.state, prog.batch)
        try:
            return prog, lowered.compile(options or None)
        except Exception as e:  # XlaRuntimeError (and JaxRuntimeError) carry the message
            if not _OOM.search(str(e)):
                raise
            return prog, e

    t0 = time.perf_counter()
    prog, compiled = compile_first_fitting(cfg, devices[0].platform, compile_one)
    return prog, mesh, compiled, time.perf_counter() - t0


def _model_summary(cfg: RunConfig, asked: RunConfig) -> dict[str, Any]:
    """What was compiled; `asked` is the config before remat "auto" was resolved."""
    m = cfg.model
    counts = parameter_counts(m)
    auto = {"remat_asked": "auto"} if asked.model.remat == "auto" else {}
    return {
        "family": m.family,
        "parameters": counts["total"],
        "num_layers": m.num_layers,
        "hidden_size": m.hidden_size,
        "param_dtype": m.param_dtype,
        "compute_dtype": m.compute_dtype,
        "remat": m.remat,
        **auto,
        "scan_layers": m.scan_layers,
        "attention": m.attention,
    }


def _setup(
    cfg: RunConfig, target: Target, mesh: Any, seconds: float, asked: RunConfig
) -> dict[str, Any]:
    """The head of the report: what was compiled, for what, and how long it took."""
    devices = target.devices
    return {
        "target": target.describe(),
        "mesh": {
            "slices": cfg.mesh.slices,
            "data": cfg.mesh.data,
            "expert": cfg.mesh.expert,
            "fsdp": cfg.mesh.fsdp,
            "context": cfg.mesh.context,
            "tensor": cfg.mesh.tensor,
        },  # fmt: skip
        "device_kind": devices[0].device_kind,
        "model": _model_summary(cfg, asked),
        "moe_dispatch": moe_dispatch.describe(cfg.model, mesh),
        "training": {
            "seq_len": cfg.training.seq_len,
            "global_batch_size": cfg.training.global_batch_size,
            "gradient_accumulation_steps": cfg.training.gradient_accumulation_steps,
            "sequences_per_chip": cfg.training.global_batch_size / len(devices),
            "loss_chunk_size": cfg.training.loss_chunk_size,
        },
        "compile_seconds": round(seconds, 3),
        "tokens_per_step": cfg.training.tokens_per_step,
    }


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b else None


def _flops_report(
    analysis: dict[str, Any], analytic: dict[str, float], kernels: bool, peak: float | None, n: int
) -> dict[str, Any]:
    """The compiled matmul FLOPs per chip against the analytic count and the chip's peak."""
    per_chip = analysis["matmul_flops"]
    return {
        "compiled": {"per_chip": per_chip, "per_step": per_chip * n},
        "analytic": analytic,
        "compiled_over_analytic": _ratio(per_chip, analytic["per_chip"]),
        "uncounted_custom_calls": analysis["uncounted_custom_calls"],
        # With a fused attention kernel (splash: tpu_custom_call; cudnn: __cudnn$fmha*) the
        # compiled count holds no attention matmuls: this compares it with 6N alone.
        "attention_in_kernels": kernels,
        "compiled_over_analytic_dense": _ratio(per_chip, analytic["dense_per_chip"]),
        "loops": analysis["loops"],
        "peak_flops_per_chip": peak,
        # The matmul time of one step at peak: a lower bound on its step time.
        "seconds_at_peak": per_chip / peak if peak else None,
    }


def plan(cfg: RunConfig, target: Target) -> dict[str, Any]:
    """The compiled plan of cfg's train step on `target`: JSON-serialisable, per chip."""
    check_mesh(cfg.mesh.size, cfg.mesh.slices, target)
    devices = target.devices
    n = len(devices)
    with tempfile.TemporaryDirectory(prefix="jaxjob-plan-") as tmp:
        # Only a TPU compile fails on memory; its dump then still names the largest buffers.
        dump = tmp if target.kind == "tpu" else None
        prog, mesh, compiled, seconds = compile_program(cfg, devices, dump)
        asked, cfg = cfg, prog.cfg  # remat "auto" resolved
        report = _setup(cfg, target, mesh, seconds, asked)
        analytic = analytic_flops(cfg, n)
        if isinstance(compiled, Exception):
            report["compiled"] = False
            report["memory"] = oom_report(str(compiled), tmp, target.hbm_bytes)
            report["flops"] = {"analytic": analytic}
            return report
    report["compiled"] = True
    report["memory"] = memory_report(
        compiled, prog, target.hbm_bytes, compiler_checked=target.kind == "tpu"
    )
    slice_of = [getattr(d, "slice_index", 0) or 0 for d in mesh.devices.flat]
    # One text and one parse of the compiled program serve the FLOPs, collectives and step time.
    module = hlo.Module.parse(compiled.as_text())
    analysis = hlo.analyse(module, slice_of=slice_of)
    kernels = any(
        k == "tpu_custom_call" or k.startswith("__cudnn$fmha")
        for k in analysis["uncounted_custom_calls"]
    )
    report["flops"] = _flops_report(analysis, analytic, kernels, target.peak_flops, n)
    report["collectives"] = analysis["collectives"]
    report["memory"]["largest_buffers"] = analysis["largest_buffers"]
    report["step_time"] = predicted_step_time(cfg, target, module, analytic, kernels, n)
    return report


def kernel_attention_flops(cfg: RunConfig, analytic: dict[str, float]) -> float:
    """The attention FLOPs a fused kernel does per chip and step: the analytic count (forward +
    backward, 12LTHD) less the causal blocks it skips (of n x n query/key blocks of the kernel's
    block size, it runs n(n+1)/2), plus the forward again when blocks are rematerialised and
    the policy does not keep the kernel's outputs."""
    from runtime.model.attention.kernels import splash_block
    from runtime.model.layers import KEEPS_ATTENTION_KERNEL

    n = max(1, cfg.training.seq_len // splash_block(cfg.training.seq_len))
    causal = (n + 1) / (2 * n)
    recompute = 1.0 if cfg.model.remat in KEEPS_ATTENTION_KERNEL else 4 / 3
    return analytic["attention_per_chip"] * causal * recompute


def predicted_step_time(
    cfg: RunConfig, target: Target, module: hlo.Module, analytic: dict, kernels: bool, n: int
) -> dict[str, Any] | None:
    """runtime.plan.steptime's estimate for the target's chip, or None without its figures."""
    c = steptime.chip(target.catalogue_name, target.peak_flops) if target.kind != "cpu" else None
    if c is None:
        return None
    return steptime.estimate(
        module,
        c,
        kernel_flops=kernel_attention_flops(cfg, analytic) if kernels else 0.0,
        tokens_per_step=cfg.training.tokens_per_step,
        devices=n,
    )
