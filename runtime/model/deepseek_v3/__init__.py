"""The "deepseek_v3" family (DeepSeek-V3's decoder): `decoder.py` its modules (over `mla.py`, the
latent attention and its RoPE, and `moe.py`, the routing over runtime/model/moe/layer.py's experts),
`hf_names.py` its HF name map, `counts.py` its parameter counts and FLOPs; `SPECS` is what the
runtime reads of it. Its contract is jobspec/families/deepseek_v3.py."""

from runtime.model.deepseek_v3.counts import flops_per_token, mlp_activations, param_count
from runtime.model.deepseek_v3.decoder import build
from runtime.model.deepseek_v3.hf_names import hf_ignored, hf_names
from runtime.model.spec import ModelSpec

SPECS = {
    "deepseek_v3": ModelSpec(
        build, hf_names, param_count, flops_per_token, mlp_activations, hf_ignored=hf_ignored
    )
}
