"""The contract: run configs (cfg.toml) and job specs as pydantic models."""
