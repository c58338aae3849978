"""Hugging Face interop: parameter name maps (`names`) and safetensors import/export (`io`)."""
