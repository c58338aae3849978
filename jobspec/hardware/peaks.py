"""Peak dense bf16 FLOP/s per chip, looked up by JAX's `device.device_kind`.

An unknown device (CPU included) gets None, never a guessed peak: MFU is then not reported.
Figures are the vendors' dense (no sparsity) bf16 numbers per chip.
"""

from __future__ import annotations

import re

# (pattern over device_kind, lowercase; catalogue name; peak bf16 FLOP/s per chip)
_PEAKS: tuple[tuple[str, str, float], ...] = (
    (r"^tpu v4$", "tpu-v4", 275e12),
    (r"^tpu v5 ?lite|^tpu v5e", "tpu-v5e", 197e12),
    (r"^tpu v5p?$", "tpu-v5p", 459e12),
    (r"^tpu v6 ?lite|^tpu v6e", "tpu-v6e", 918e12),
    (r"a100.*40gb|^nvidia a100$", "a100-40gb", 312e12),
    (r"a100.*80gb", "a100-80gb", 312e12),
    (r"h100.*pcie", "h100-pcie", 756e12),
    (r"h100", "h100-80gb", 989e12),
    (r"h200", "h200", 989e12),
)


def peak_bf16_flops(device_kind: str) -> tuple[str, float] | None:
    """(catalogue name, peak FLOP/s) for a known accelerator, else None."""
    kind = device_kind.strip().lower()
    for pattern, name, peak in _PEAKS:
        if re.search(pattern, kind):
            return name, peak
    return None
