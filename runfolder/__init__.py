"""The run folder, `<output_uri>/<run_id>/`, and its storage: what `launch` and `runtime` both
read and write there (jax-free; above jobspec, below launch and runtime)."""
