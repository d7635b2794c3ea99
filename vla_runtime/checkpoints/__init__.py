"""Read and write real on-disk checkpoint formats."""
