"""The "qwen3_moe" family (Qwen3-MoE): `decoder.py` the Qwen3 decoder with sparse MoE MLPs,
`hf_names.py` its HF name map, `counts.py` its parameter counts and FLOPs. Below, what
runtime/model/registry.py reads of the family; its contract is jobspec/families/qwen3_moe.py."""

from runtime.model.qwen3_moe.counts import flops_per_token, mlp_activations, param_count
from runtime.model.qwen3_moe.decoder import build
from runtime.model.qwen3_moe.hf_names import hf_names

__all__ = ["build", "flops_per_token", "hf_names", "mlp_activations", "param_count"]
