"""Triton kernels for the chunked attention, each with a torch reference beside it."""
