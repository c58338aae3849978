"""`runtime preflight`: everything a run would fail on in its first minute, checked up front."""

from __future__ import annotations

from typing import Any

import jax

from jobspec.errors import JaxjobError
from jobspec.run_config import RunConfig
from jobspec.run_store import ArtifactStore
from jobspec.storage import join, url_to_fs
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
    block input under remat "full"; the family spec's `mlp_activations` gives the MLP term (for
    an MoE, 3 x num_experts x moe_intermediate: the dense dispatch runs every expert on every
    token). An estimate to catch gross misfits, not an allocator trace.
    """
    m, t = cfg.model, cfg.training
    n = parameter_counts(m)["total"]
    shards = cfg.mesh.fsdp * cfg.mesh.tensor
    pbytes = _BYTES[m.param_dtype]
    cbytes = _BYTES[m.compute_dtype]
    params = n * pbytes / shards
    grads = n * 4 / shards
    adam = 2 * n * 4 / shards
    # The batch is split over slice x data x expert x fsdp (runtime/model/sharding.py, "batch").
    rows = t.global_batch_size / cfg.mesh.batch_shards
    # MLP values per token and layer, per family (an MoE's dense dispatch keeps every expert's).
    mlp = spec_for(m).mlp_activations(m)
    per_token_layer = {
        "none": 16 * m.hidden_size + mlp + m.num_heads * t.seq_len / max(cfg.mesh.tensor, 1),
        "block": 8 * m.hidden_size + mlp,
        "full": m.hidden_size,
    }[m.remat]
    activations = rows * t.seq_len * m.num_layers * per_token_layer * cbytes
    logits = rows * t.seq_len * m.vocab_size * 4 / cfg.mesh.tensor
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


def preflight(cfg: RunConfig) -> dict[str, Any]:
    checks: list[dict[str, Any]] = []

    def check(name: str, fn) -> Any:
        try:
            detail, value = fn()
            checks.append({"name": name, "ok": True, "detail": detail})
            return value
        except JaxjobError as e:
            checks.append({"name": name, "ok": False, "detail": str(e)})
            return None

    devices = jax.devices()
    check(
        "devices",
        lambda: (
            f"{len(devices)} x {devices[0].device_kind} ({jax.default_backend()}), "
            f"{jax.process_count()} process(es)",
            None,
        ),
    )
    check(
        "mesh",
        lambda: (
            f"slices={cfg.mesh.slices} data={cfg.mesh.data} expert={cfg.mesh.expert} "
            f"fsdp={cfg.mesh.fsdp} "
            f"tensor={cfg.mesh.tensor} fits "
            f"{len(build_mesh(cfg.mesh).devices.flat)} devices",
            None,
        ),
    )

    def data():
        if cfg.data.sources is not None:  # a mixture: every source exists and they fit together
            mix = open_data(cfg.data)
            check_for_run(mix, cfg.data, cfg.model.vocab_size, cfg.training)
            shares = ", ".join(f"{d.name} {d.share:.0%}" for d in cfg.data.datasets)
            return (
                f"mixture of {shares}: {mix.split('train').tokens:,} train tokens, "
                f"tokenizer {mix.tokenizer.id}",
                None,
            )
        assert cfg.data.manifest is not None  # exactly one of manifest / sources
        fs, path = url_to_fs(cfg.data.manifest)
        if not fs.exists(path):
            if cfg.data.prepare is None:
                raise JaxjobError(
                    f"data.manifest {cfg.data.manifest} does not exist and no [data.prepare] is set"
                )
            return (
                f"{cfg.data.manifest} absent; will be prepared on first use from {cfg.data.prepare.inputs}",
                None,
            )
        m = load_manifest(cfg.data.manifest)
        check_for_run(m, cfg.data, cfg.model.vocab_size, cfg.training)
        train = m.split("train")
        return (
            f"{cfg.data.manifest}: {train.tokens:,} train tokens, tokenizer {m.tokenizer.id}",
            None,
        )

    check("data", data)

    def evals():
        from runtime.data.eval_rows import check_evals_of_config

        if not cfg.evals:
            return "none configured", None
        small = check_evals_of_config(cfg)  # an eval whose split gives no row: FAIL
        names = ", ".join(f"{e.name} ({e.split})" for e in cfg.evals)
        if small is None:
            return f"{names}: the data is not readable yet, checked again at the start", None
        if small:
            return f"{names} can run; warning: " + "; ".join(w["message"] for w in small), None
        return f"{names} can run", None

    check("evals", evals)

    def output():
        store = ArtifactStore(join(cfg.run.output_uri, cfg.run.id))
        store.check_writable()
        return f"{store.uri('')} writable", None

    check("output", output)

    def sinks():
        from runtime.observe.sinks import sink_check

        try:
            return f"{sink_check(cfg.metrics) or 'none configured'}", None
        except RuntimeError as e:
            raise JaxjobError(str(e)) from None

    check("metric sinks", sinks)
    est = memory_estimate(cfg, len(devices))
    limit = _device_limit()
    compiled = compiled_memory(cfg, devices, limit)
    if compiled is not None and compiled["source"] == "compiled":
        mem, per_device = compiled, compiled["peak_bytes"]
        detail = (
            f"{per_device / 2**30:.2f} GiB per device, compiled (params "
            f"{compiled['arguments']['parameters'] / 2**30:.2f}, optimizer "
            f"{compiled['arguments']['optimizer_state'] / 2**30:.2f}, temporaries "
            f"{compiled['temp_bytes'] / 2**30:.2f} GiB)"
        )
        fits = compiled["fits"] is not False
    elif compiled is not None:  # the compiler itself ran out of memory
        mem, fits = compiled, False
        detail = f"does not compile on these devices: {compiled['message']}"
    else:
        mem, per_device = {"source": "estimate", **est}, est["per_device_bytes"]
        fits = limit is None or per_device < limit
        detail = f"~{per_device / 2**30:.2f} GiB per device, estimated (the step did not compile)"
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
