"""The "qwen2" family (Qwen2): `decoder.py` the Qwen3 decoder with Qwen2's biased attention,
`hf_names.py` its HF name map, `counts.py` its parameter counts and FLOPs. Below, what
runtime/model/registry.py reads of the family; its contract is jobspec/families/qwen2.py."""

from runtime.model.qwen2.counts import flops_per_token, param_count
from runtime.model.qwen2.decoder import build
from runtime.model.qwen2.hf_names import hf_names
from runtime.model.qwen3.counts import mlp_activations

__all__ = ["build", "flops_per_token", "hf_names", "mlp_activations", "param_count"]
