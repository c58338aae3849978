"""What runs on every host: host/ (boot, writer), data/, model/, train/, run/ (store, checkpoints,
artifacts), hf/ (safetensors interop) and commands/ (the `runtime` CLI)."""
