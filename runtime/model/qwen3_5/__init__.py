"""The "qwen3_5_text" and "qwen3_5_moe_text" families (Qwen3.5's hybrid decoder, dense and MoE):
`decoder.py` its modules (Qwen3-Next's, runtime/model/qwen3_next/, with Qwen3.5's DeltaNet
projections), `hf_names.py` its HF name map, `counts.py` its parameter counts and FLOPs; `SPECS`
is what the runtime reads of them. Their contract is jobspec/families/qwen3_5.py."""

from runtime.hf.experts import fuse_experts, split_fused_experts
from runtime.model.qwen3_5.counts import flops_per_token, mlp_activations, param_count
from runtime.model.qwen3_5.decoder import build
from runtime.model.qwen3_5.hf_names import HF_IGNORED_PREFIXES, hf_names
from runtime.model.spec import ModelSpec

_SPEC = ModelSpec(
    build,
    hf_names,
    param_count,
    flops_per_token,
    mlp_activations,
    hf_ignored_prefixes=HF_IGNORED_PREFIXES,
    # The released MoE checkpoints hold each layer's experts fused: read either layout, write it.
    hf_read=split_fused_experts,
    hf_write=fuse_experts,
)
SPECS = {"qwen3_5_text": _SPEC, "qwen3_5_moe_text": _SPEC}
