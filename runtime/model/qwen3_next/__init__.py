"""The "qwen3_next" family (Qwen3-Next's hybrid decoder): `decoder.py` its modules (over
runtime/model/deltanet.py and moe/), `hf_names.py` its HF name map, `counts.py` its parameter
counts and FLOPs; `SPECS` is what the runtime reads of it. Its contract is
jobspec/families/qwen3_next.py."""

from runtime.model.qwen3_next.counts import flops_per_token, mlp_activations, param_count
from runtime.model.qwen3_next.decoder import build
from runtime.model.qwen3_next.hf_names import HF_IGNORED_PREFIXES, hf_names
from runtime.model.spec import ModelSpec

SPECS = {
    "qwen3_next": ModelSpec(
        build,
        hf_names,
        param_count,
        flops_per_token,
        mlp_activations,
        hf_ignored_prefixes=HF_IGNORED_PREFIXES,
    )
}
