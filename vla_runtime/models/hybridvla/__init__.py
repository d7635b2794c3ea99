"""HybridVLA: diffusion and autoregressive action generation inside one LLM (PKU-HMI-Lab/Hybrid-VLA)."""
