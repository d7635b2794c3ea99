"""Readers and writers of real on-disk checkpoint formats (safetensors HF directories, GGUF)."""
