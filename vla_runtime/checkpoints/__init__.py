"""Reading and writing real on-disk checkpoint formats (HF safetensors directories, GGUF), and tiny random
checkpoints for tests."""
