"""The "qwen2" family's decoder: the Qwen3 decoder with Qwen2's attention, computing what HF
`Qwen2ForCausalLM` does: q/k/v projections with a bias (`{q,k,v}_proj.bias`, zero at init as
HF's), o_proj without, and no q/k norm; everything else is
`runtime.model.qwen3.decoder.Qwen3Decoder` (scanned or unrolled layers, SwiGLU MLPs)."""

from __future__ import annotations

from flax import nnx

from jobspec.families.model_config import ModelConfig
from runtime.model.qwen3.decoder import Attention, Qwen3Decoder


class Qwen2Attention(Attention):
    """Qwen3's GQA attention with biased q/k/v projections and no q/k norm."""

    qkv_bias = True
    qk_norm = False


def build(cfg: ModelConfig, *, rngs: nnx.Rngs, eager_sharding: bool = False) -> Qwen3Decoder:
    """The Qwen3 decoder with `Qwen2Attention` in every layer."""
    return Qwen3Decoder(
        cfg, rngs=rngs, eager_sharding=eager_sharding, attention_factory=Qwen2Attention
    )
