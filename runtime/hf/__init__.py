"""Hugging Face interop: safetensors files (`files`), an export's output folder (`export_dir`),
parameter name maps (`names`) and parameter <-> HF tensor conversion (`convert`). No commands,
no restore."""
