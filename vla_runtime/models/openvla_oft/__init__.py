"""OpenVLA-OFT (Kim, Finn, Liang 2025, arXiv 2502.19645; github moojink/openvla-oft): a fine-tuned OpenVLA
that decodes a whole action chunk in one bidirectional forward and regresses continuous actions with an
MLP head. ``configuration_oft`` (platforms, sizes, detection), ``normalization_oft`` (BOUNDS / BOUNDS_Q99),
``modeling_oft`` (the action head and the parallel-decoding forward).
"""
