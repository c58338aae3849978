"""The "llama" (Llama 3) and "mistral" families: `decoder.py` the Qwen3 decoder with Llama's
attention, MLP and RoPE (and Mistral's sliding window), `hf_names.py` their HF name map,
`counts.py` their parameter counts and FLOPs; `SPECS` is what the runtime reads of them. Their
contract is jobspec/families/llama.py."""

from runtime.model.llama.counts import flops_per_token, param_count
from runtime.model.llama.decoder import build
from runtime.model.llama.hf_names import hf_names
from runtime.model.qwen3.counts import mlp_activations
from runtime.model.spec import ModelSpec

_SPEC = ModelSpec(build, hf_names, param_count, flops_per_token, mlp_activations)
SPECS = {"llama": _SPEC, "mistral": _SPEC}
