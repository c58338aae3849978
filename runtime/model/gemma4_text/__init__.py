"""The "gemma4_text" family (Gemma 4's text decoder): `decoder.py` its modules, `hf_names.py` its
HF name map, `counts.py` its parameter counts and FLOPs. Below, what runtime/model/registry.py
reads of the family; its contract is jobspec/families/gemma4_text.py."""

from runtime.model.gemma4_text.counts import flops_per_token, mlp_activations, param_count
from runtime.model.gemma4_text.decoder import build
from runtime.model.gemma4_text.hf_names import hf_ignored, hf_names

__all__ = ["build", "flops_per_token", "hf_ignored", "hf_names", "mlp_activations", "param_count"]
