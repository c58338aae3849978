"""Mixture of experts: `layer.py` the router, top-k and expert MLP block (`SparseMoE`) with its
stats, `dispatch.py` the sparse dispatch (sort, exchange over `mesh.expert`, grouped matmuls)."""
