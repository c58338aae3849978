"""The "gemma4_text" family (Gemma 4's text decoder): `decoder.py` its modules, `hf_names.py` its
HF name map, `counts.py` its parameter counts and FLOPs; `SPECS` is what the runtime reads of
it. Its contract is jobspec/families/gemma4_text.py."""

from runtime.model.gemma4_text.counts import flops_per_token, mlp_activations, param_count
from runtime.model.gemma4_text.decoder import build
from runtime.model.gemma4_text.hf_names import hf_ignored, hf_names
from runtime.model.spec import ModelSpec

SPECS = {
    "gemma4_text": ModelSpec(
        build, hf_names, param_count, flops_per_token, mlp_activations, hf_ignored=hf_ignored
    )
}
