"""Readers of model files: Hugging Face folders (safetensors) and GGUF."""
