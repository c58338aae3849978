"""MXFP4 checkpoint tensors (gpt-oss's experts on the Hub) dequantized to a float dtype.

The OCP Microscaling format: blocks of 32 values share one E8M0 scale (a power of two,
2^(s - 127) for the stored byte s) and each value is an E2M1 float (4 bits: sign, 2 exponent
bits, 1 mantissa bit, so one of 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives). A tensor `X` is
stored as `X_blocks` (uint8 [..., R, G, 16]: two E2M1 codes a byte, the even element in the
low nibble) and `X_scales` (uint8 [..., R, G]); the values of row r are its G blocks of 32 in
order, and the dequantized tensor has its last two axes swapped ([..., G * 32, R]), which is
transformers' layout (`integrations/mxfp4.py`, `convert_moe_packed_tensors`): gpt-oss's
`gate_up_proj_blocks` [E, 2I, D/32, 16] becomes `gate_up_proj` [E, D, 2I].

Every E2M1 value times a power of two is exact in float32 and bfloat16 (normal or subnormal),
so dequantizing to either dtype is exact.
"""

from __future__ import annotations

import sys
from typing import Any

import ml_dtypes
import numpy as np

#: A config's dtype name -> the numpy dtype a dequantized tensor gets.
DTYPES: dict[str, Any] = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
#: E2M1 code -> value (bit 3 is the sign).
E2M1 = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    np.float32,
)
BLOCK = 32
SCALE_BIAS = 127


def dequantize(blocks: np.ndarray, scales: np.ndarray, dtype: Any) -> np.ndarray:
    """`X_blocks` [..., R, G, 16], `X_scales` [..., R, G] -> X [..., G * 32, R] in `dtype`,
    one leading slice at a time (a float32 copy of the whole tensor is never held)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(
            f"MXFP4 blocks {blocks.shape} and scales {scales.shape} do not pair "
            f"([..., G, {BLOCK // 2}] with [..., G])"
        )
    *lead, rows, groups, _ = blocks.shape
    out = np.empty((*lead, groups * BLOCK, rows), dtype)
    for i in np.ndindex(*lead):
        b, s = blocks[i].astype(np.uint8), scales[i].astype(np.int32) - SCALE_BIAS
        codes = np.stack([b & 0x0F, b >> 4], axis=-1)  # [R, G, 16, 2]: low nibble first
        values = E2M1[codes].reshape(rows, groups, BLOCK)
        values = np.ldexp(values, s[..., None]).reshape(rows, groups * BLOCK)
        out[i] = values.T.astype(dtype)
    return out


def dequantize_checkpoint(tensors: dict[str, np.ndarray], dtype_name: str) -> dict[str, np.ndarray]:
    """`tensors` with every `X_blocks` + `X_scales` pair replaced by X in the dtype named
    `dtype_name` (a config's param_dtype); the same dict when there is none. Says so in one
    `note:` line on stderr."""
    pairs = sorted(
        name[: -len("_blocks")]
        for name in tensors
        if name.endswith("_blocks") and name[: -len("_blocks")] + "_scales" in tensors
    )
    if not pairs:
        return tensors
    out = dict(tensors)
    for base in pairs:
        blocks, scales = out.pop(base + "_blocks"), out.pop(base + "_scales")
        out[base] = dequantize(blocks, scales, DTYPES[dtype_name])
    print(
        f"note: the checkpoint holds {len(pairs)} MXFP4 tensors (quant_method 'mxfp4', e.g. "
        f"{pairs[0]}); dequantized them to {dtype_name} (model.param_dtype)",
        file=sys.stderr,
    )
    return out
