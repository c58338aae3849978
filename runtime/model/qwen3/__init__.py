"""The "qwen3" family (dense Qwen3): `decoder.py` the Qwen3 decoder (also built by qwen3_moe and
qwen2), `hf_names.py` its HF name map, `counts.py` its parameter counts and FLOPs; `SPECS` is what
the runtime reads of it. Its contract (config and HF config.json) is jobspec/families/qwen3.py."""

from runtime.model.qwen3.counts import flops_per_token, mlp_activations, param_count
from runtime.model.qwen3.decoder import build
from runtime.model.qwen3.hf_names import hf_names
from runtime.model.spec import ModelSpec

SPECS = {"qwen3": ModelSpec(build, hf_names, param_count, flops_per_token, mlp_activations)}
