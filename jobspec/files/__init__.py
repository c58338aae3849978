"""Reading what a user writes: the run config TOML (run_toml), job.yaml (job_yaml), their nesting
bound (nesting) and the credentials refused in them (secrets)."""
