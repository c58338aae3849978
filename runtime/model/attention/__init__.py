"""Attention: `kernels.py` the `model.attention` kernels and their dispatch (`attend`),
`blockwise.py` the einsum path a block of keys at a time, `context_parallel.py` the sequence
layout under `mesh.context`."""
