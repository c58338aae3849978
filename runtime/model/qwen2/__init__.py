"""The "qwen2" family (Qwen2): `decoder.py` the Qwen3 decoder with Qwen2's biased attention,
`hf_names.py` its HF name map, `counts.py` its parameter counts and FLOPs; `SPECS` is what the
runtime reads of it. Its contract is jobspec/families/qwen2.py."""

from runtime.model.qwen2.counts import flops_per_token, param_count
from runtime.model.qwen2.decoder import build
from runtime.model.qwen2.hf_names import hf_names
from runtime.model.qwen3.counts import mlp_activations
from runtime.model.spec import ModelSpec

SPECS = {"qwen2": ModelSpec(build, hf_names, param_count, flops_per_token, mlp_activations)}
