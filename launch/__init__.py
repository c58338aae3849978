"""The operator's CLI (`launch`) and the backends that are not Kubernetes (local, slurm)."""
