"""Hugging Face interop: safetensors files (`files`), parameter name maps (`names`) and
parameter <-> HF tensor conversion (`convert`). No commands, no restore."""
