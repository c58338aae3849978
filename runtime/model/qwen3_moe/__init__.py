"""The "qwen3_moe" family (Qwen3-MoE): `decoder.py` the Qwen3 decoder with sparse MoE MLPs,
`hf_names.py` its HF name map, `counts.py` its parameter counts and FLOPs; `SPECS` is what the
runtime reads of it. Its contract is jobspec/families/qwen3_moe.py."""

from runtime.model.qwen3_moe.counts import flops_per_token, mlp_activations, param_count
from runtime.model.qwen3_moe.decoder import build
from runtime.model.qwen3_moe.hf_names import hf_names
from runtime.model.spec import ModelSpec

SPECS = {"qwen3_moe": ModelSpec(build, hf_names, param_count, flops_per_token, mlp_activations)}
