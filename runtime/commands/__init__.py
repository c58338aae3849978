"""The `runtime` CLI and the commands that compose the packages (offline eval/sample, HF import/export, preflight)."""
