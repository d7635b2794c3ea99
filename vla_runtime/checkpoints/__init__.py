"""Reading and writing real on-disk checkpoint formats, and tiny random checkpoints for tests."""
