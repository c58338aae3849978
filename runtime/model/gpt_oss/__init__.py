"""The "gpt_oss" family (OpenAI's gpt-oss): `decoder.py` its modules (attention sinks, sliding
and full layers, the biased router and clamped-SwiGLU experts over runtime/model/moe/layer.py),
`hf_names.py` its HF name map, `counts.py` its parameter counts and FLOPs; `SPECS` is what the
runtime reads of it. Its contract is jobspec/families/gpt_oss.py."""

from runtime.model.gpt_oss.counts import flops_per_token, mlp_activations, param_count
from runtime.model.gpt_oss.decoder import build
from runtime.model.gpt_oss.hf_names import hf_names
from runtime.model.spec import ModelSpec

SPECS = {"gpt_oss": ModelSpec(build, hf_names, param_count, flops_per_token, mlp_activations)}
