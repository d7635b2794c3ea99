"""Upstream's ``MLPResNet`` (``prismatic/models/action_heads.py``), shared by the L1 and diffusion heads."""

from __future__ import annotations

import torch
import torch.nn as nn


class MLPResNetBlock(nn.Module):
    """Pre-norm residual MLP block: x + ReLU(Linear(LayerNorm(x))). ``ffn.0`` LayerNorm, ``ffn.1`` Linear."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ffn = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., dim] -> [..., dim]."""
        return x + self.ffn(x)


class MLPResNet(nn.Module):
    """LayerNorm -> fc1 -> ReLU -> blocks -> LayerNorm -> fc2 (upstream ``action_heads.MLPResNet``)."""

    def __init__(self, num_blocks: int, input_dim: int, hidden_dim: int, output_dim: int) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(input_dim)
        self.fc1 = nn.Linear(input_dim, hidden_dim)
        self.relu = nn.ReLU()
        self.mlp_resnet_blocks = nn.ModuleList(MLPResNetBlock(hidden_dim) for _ in range(num_blocks))
        self.layer_norm2 = nn.LayerNorm(hidden_dim)
        self.fc2 = nn.Linear(hidden_dim, output_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., input_dim] -> [..., output_dim]."""
        x = self.relu(self.fc1(self.layer_norm1(x)))
        for block in self.mlp_resnet_blocks:
            x = block(x)
        return self.fc2(self.layer_norm2(x))
