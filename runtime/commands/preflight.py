"""`runtime preflight`: everything a run would fail on in its first minute, checked up front."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from jobspec.errors import JaxjobError
from jobspec.run_config import RunConfig
from runfolder.storage import join, url_to_fs
from runfolder.store import ArtifactStore
from runtime.data.loader import check_for_run
from runtime.data.manifest import load_manifest
from runtime.data.mixture import open_data
from runtime.model.flops import parameter_counts
from runtime.model.registry import spec_for
from runtime.model.sharding import build_mesh

_BYTES = {"float32": 4, "bfloat16": 2}


def memory_estimate(cfg: RunConfig, devices: int) -> dict[str, Any]:
    """Per-device bytes, assuming parameters and optimizer state are spread over fsdp x tensor.

    Parameters, gradients (fp32 accumulators), AdamW moments (2 x fp32) and an activation
    estimate per microbatch: per token and layer, roughly 16 x hidden + 3 x intermediate values
    kept for the backward pass (plus the attention probabilities, heads x seq_len), or only the
    block input under remat "full" (and "attention_host"), plus the attention output under
    "attention"; the family spec's `mlp_activations` gives the MLP term (for
    an MoE, 3 x num_experts x moe_intermediate: the dense dispatch runs every expert on every
    token). An estimate to catch gross misfits, not an allocator trace.
    """
    m, t = cfg.model, cfg.training
    n = parameter_counts(m)["total"]
    # Parameters shard over fsdp x context along embed and over tensor (runtime/model/sharding.py).
    shards = cfg.mesh.fsdp * cfg.mesh.context * cfg.mesh.tensor
    pbytes = _BYTES[m.param_dtype]
    cbytes = _BYTES[m.compute_dtype]
    params = n * pbytes / shards
    grads = n * 4 / shards
    adam = 2 * n * 4 / shards
    # The batch is split over slice x data x expert x fsdp (runtime/model/sharding.py, "batch"),
    # and each row over context: a device holds `tokens` of them (its queries' scores span the
    # whole sequence's keys: the seq_len term of "none" stays whole).
    rows = t.global_batch_size / cfg.mesh.batch_shards
    tokens = rows * t.seq_len / cfg.mesh.context
    # MLP values per token and layer, per family (an MoE's dense dispatch keeps every expert's).
    mlp = spec_for(m).mlp_activations(m)
    per_token_layer = {
        "none": 16 * m.hidden_size + mlp + m.num_heads * t.seq_len / max(cfg.mesh.tensor, 1),
        "block": 8 * m.hidden_size + mlp,
        # The block input and the attention kernel's output (its log-sum-exp is 1/head_dim of it).
        "attention": m.hidden_size + m.num_heads * m.resolved_head_dim / max(cfg.mesh.tensor, 1),
        "attention_host": m.hidden_size,  # the kernel's output is kept in host memory
        "full": m.hidden_size,
        "auto": m.hidden_size,  # full where attention does not fit: the least it needs
    }[m.remat]
    activations = tokens * m.num_layers * per_token_layer * cbytes
    logits = tokens * m.vocab_size * 4 / cfg.mesh.tensor
    total = params + grads + adam + activations + logits
    return {
        "per_device_bytes": int(total),
        "parts": {
            k: int(v)
            for k, v in {
                "params": params,
                "grads": grads,
                "adam": adam,
                "activations": activations,
                "logits": logits,
            }.items()
        },
        "devices": devices,
    }


def _device_limit() -> int | None:
    try:
        stats = jax.local_devices()[0].memory_stats() or {}
    except Exception:  # CPU and some plugins do not report memory
        return None
    return stats.get("bytes_limit")


def _checked(name: str, detail: Callable[..., str], *args: Any) -> dict[str, Any]:
    """One check's row: ok with what `detail` says, or failed with the sentence it raised."""
    try:
        return {"name": name, "ok": True, "detail": detail(*args)}
    except JaxjobError as e:
        return {"name": name, "ok": False, "detail": str(e)}


def _devices_detail(devices: list) -> str:
    return (
        f"{len(devices)} x {devices[0].device_kind} ({jax.default_backend()}), "
        f"{jax.process_count()} process(es)"
    )


def _mesh_detail(cfg: RunConfig) -> str:
    return (
        f"slices={cfg.mesh.slices} data={cfg.mesh.data} expert={cfg.mesh.expert} "
        f"fsdp={cfg.mesh.fsdp} context={cfg.mesh.context} "
        f"tensor={cfg.mesh.tensor} fits "
        f"{len(build_mesh(cfg.mesh).devices.flat)} devices"
    )


def _data_detail(cfg: RunConfig) -> str:
    if cfg.data.sources is not None:  # a mixture: every source exists and they fit together
        mix = open_data(cfg.data)
        check_for_run(mix, cfg.data, cfg.model.vocab_size, cfg.training)
        shares = ", ".join(f"{d.name} {d.share:.0%}" for d in cfg.data.datasets)
        return (
            f"mixture of {shares}: {mix.split('train').tokens:,} train tokens, "
            f"tokenizer {mix.tokenizer.id}"
        )
    assert cfg.data.manifest is not None  # exactly one of manifest / sources
    fs, path = url_to_fs(cfg.data.manifest)
    if not fs.exists(path):
        if cfg.data.prepare is None:
            raise JaxjobError(
                f"data.manifest {cfg.data.manifest} does not exist and no [data.prepare] is set"
            )
        return f"{cfg.data.manifest} absent; will be prepared on first use from {cfg.data.prepare.inputs}"
    m = load_manifest(cfg.data.manifest)
    check_for_run(m, cfg.data, cfg.model.vocab_size, cfg.training)
    train = m.split("train")
    return f"{cfg.data.manifest}: {train.tokens:,} train tokens, tokenizer {m.tokenizer.id}"


def _evals_detail(cfg: RunConfig) -> str:
    from runtime.data.eval_rows import check_evals_of_config

    if not cfg.evals:
        return "none configured"
    small = check_evals_of_config(cfg)  # an eval whose split gives no row: FAIL
    names = ", ".join(f"{e.name} ({e.split})" for e in cfg.evals)
    if small is None:
        return f"{names}: the data is not readable yet, checked again at the start"
    if small:
        return f"{names} can run; warning: " + "; ".join(w["message"] for w in small)
    return f"{names} can run"


def _output_detail(cfg: RunConfig) -> str:
    store = ArtifactStore(join(cfg.run.output_uri, cfg.run.id))
    store.check_writable()
    return f"{store.uri('')} writable"


def _sinks_detail(cfg: RunConfig) -> str:
    from runtime.observe.sinks import sink_check

    try:
        return f"{sink_check(cfg.metrics) or 'none configured'}"
    except RuntimeError as e:
        raise JaxjobError(str(e)) from None


def _memory(
    cfg: RunConfig, devices: list, est: dict[str, Any], limit: int | None
) -> tuple[dict[str, Any], bool, str]:
    """(memory report, whether it fits, what to say): compiled for these devices where the step
    compiles here, else the estimate."""
    compiled = compiled_memory(cfg, devices, limit)
    if compiled is not None and compiled["source"] == "compiled":
        per_device = compiled["peak_bytes"]
        detail = (
            f"{per_device / 2**30:.2f} GiB per device, compiled (params "
            f"{compiled['arguments']['parameters'] / 2**30:.2f}, optimizer "
            f"{compiled['arguments']['optimizer_state'] / 2**30:.2f}, temporaries "
            f"{compiled['temp_bytes'] / 2**30:.2f} GiB)"
        )
        return compiled, compiled["fits"] is not False, detail
    if compiled is not None:  # the compiler itself ran out of memory
        return compiled, False, f"does not compile on these devices: {compiled['message']}"
    per_device = est["per_device_bytes"]
    fits = limit is None or per_device < limit
    detail = f"~{per_device / 2**30:.2f} GiB per device, estimated (the step did not compile)"
    return {"source": "estimate", **est}, fits, detail


def preflight(cfg: RunConfig) -> dict[str, Any]:
    """Every check's row (name, ok, detail), in order, and the step's memory per device."""
    devices = jax.devices()
    checks = [
        _checked("devices", _devices_detail, devices),
        _checked("mesh", _mesh_detail, cfg),
        _checked("data", _data_detail, cfg),
        _checked("evals", _evals_detail, cfg),
        _checked("output", _output_detail, cfg),
        _checked("metric sinks", _sinks_detail, cfg),
    ]
    est = memory_estimate(cfg, len(devices))
    limit = _device_limit()
    mem, fits, detail = _memory(cfg, devices, est, limit)
    checks.append(
        {
            "name": "memory",
            "ok": fits,
            "detail": detail
            + (f" of {limit / 2**30:.1f} GiB" if limit else " (device reports no limit)"),
        }
    )
    return {"checks": checks, "memory": mem, "memory_estimate": est}


def compiled_memory(cfg: RunConfig, devices: list, limit: int | None) -> dict[str, Any] | None:
    """The train step compiled for this job's own devices: per-device bytes as XLA accounts them
    (`runtime.plan.compile.memory_report`), the compiler's out-of-memory report, or None when it
    cannot be compiled here (say, a mesh that does not match the devices) and the estimate must do.
    """
    from runtime.plan.compile import compile_program, memory_report, oom_report

    try:
        prog, _, compiled, _ = compile_program(cfg, devices)
    except Exception:  # any failure to build or compile: the estimate is the fallback
        return None
    if isinstance(compiled, Exception):
        return oom_report(str(compiled), "", limit)
    # A TPU compile fails when the program cannot be placed in the chip's HBM: one that
    # compiled on this job's own TPU devices fits, whatever a sum of XLA's totals says.
    return memory_report(compiled, prog, limit, compiler_checked=devices[0].platform == "tpu")
