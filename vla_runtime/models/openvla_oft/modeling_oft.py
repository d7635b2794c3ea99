"""OpenVLA-OFT's parallel decoding, native PyTorch under upstream's parameter names.

One forward decodes a whole chunk (upstream ``OpenVLAForActionPrediction.predict_action`` with an
``L1RegressionActionHead``, ``prismatic/extern/hf/modeling_prismatic.py``). The input sequence is::

    [BOS] + image tokens (num_images x N) + [proprio] + prompt ids (ending in 29871)
          + chunk_size * action_dim zero embeddings + embed(</s> = 2)

Upstream appends placeholder ids for the action positions and multiplies their embeddings by
``~all_actions_mask``, so they enter as exact zeros; the stop token keeps its embedding. The LLaMA attends
**bidirectionally** over the whole sequence (every token sees every token; ``kv.bidirectional``) at
positions ``0 .. T-1``. The head reads the final-normed hidden states of ``chunk_size * action_dim``
positions starting **one before** the first action position (upstream slices
``NUM_PATCHES + NUM_PROMPT_TOKENS :``, i.e. from the prompt's last token, 29871, as in training, where the
state before a token predicts it), reshapes them to one row per action and regresses normalised actions.

History mode (ours, not upstream's; the session drives the cache): ``history_prompt`` is pinned once, each
step appends its ``observation`` (images + proprio, kept, causal) and evaluates ``query_block``
(``ids("\nOut:") + 29871 + zeros + </s>``) bidirectionally over the history, then drops it; the head reads
the block's rows from the position before its first zero, as above (``head_input``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn

from ...kv.bidirectional import BidirectionalPass
from ..openvla.modeling_openvla import OpenVLA, ProprioProjector
from ..openvla.prompt_openvla import PromptIds
from .configuration_oft import HEAD_BLOCKS, STOP_TOKEN_ID, OFTConfig
from .film import VisionFiLM, average_language_embedding


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


class L1RegressionActionHead(nn.Module):
    """The chunk's action hidden states -> normalised actions. Parameters ``model.*`` as upstream's file."""

    def __init__(self, cfg: OFTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = MLPResNet(HEAD_BLOCKS, cfg.llm_dim * cfg.action_dim, cfg.head_hidden, cfg.action_dim)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [B, chunk_size * action_dim, llm_dim] -> normalised actions [B, chunk_size, action_dim]."""
        b = hidden.shape[0]
        rows = hidden.reshape(b, self.cfg.chunk_size, -1)  # [B, chunk, action_dim * llm_dim]
        return self.model(rows)


class OpenVLAOFT(nn.Module):
    """``vla`` (the OpenVLA backbone, our module tree) + ``action_head`` (+ ``proprio_projector``).

    Weights only; one ``predict`` is one stand-alone forward (no cache, no episode state).
    """

    def __init__(self, vla: OpenVLA, cfg: OFTConfig) -> None:
        super().__init__()
        if cfg.llm_dim != vla.cfg.llm.dim:
            raise ValueError(f"OFTConfig.llm_dim {cfg.llm_dim} != the OpenVLA backbone's LLM width {vla.cfg.llm.dim}")
        self.cfg = cfg
        self.vla = vla
        self.action_head = L1RegressionActionHead(cfg)
        self.proprio_projector = ProprioProjector(cfg.proprio_dim, cfg.llm_dim) if cfg.proprio_dim else None
        self.film = VisionFiLM(vla.vision_backbone, cfg.llm_dim) if cfg.film else None

    def language(self, prompt: PromptIds, batch: int = 1) -> torch.Tensor | None:
        """FiLM's conditioning for ``prompt``: the mean input embedding of BOS + prompt ids + ``</s>`` (every
        non-action position of upstream's sequence) -> [B, llm_dim]; ``None`` without FiLM."""
        if self.film is None:
            return None
        embed = self.vla.language_model.model.embed_tokens
        return average_language_embedding(embed, [*prompt.input_ids, STOP_TOKEN_ID], batch)

    def embed_images(self, pixels: Sequence[torch.Tensor], language: torch.Tensor | None = None) -> torch.Tensor:
        """pixels[i]: [B, 3 * towers, S, S], one per camera (third-person first) -> [B, num_images * N, dim].

        language: [B, llm_dim] (``language(prompt)``), required with FiLM, ignored without. Upstream
        featurizes each image separately (FiLM'd by the same language) and concatenates the patch tokens; the
        projector is per token, so projecting each image apart is the same computation.
        """
        if len(pixels) != self.cfg.num_images:
            raise ValueError(f"this OFT policy takes {self.cfg.num_images} image(s) per step, got {len(pixels)}")
        if self.film is None:
            return torch.cat([self.vla.embed_image(p) for p in pixels], dim=1)  # [B, num_images * N, dim]
        if language is None:
            raise ValueError("this OFT checkpoint is FiLM-conditioned (vision_backbone--*checkpoint.pt): pass `language` (OpenVLAOFT.language(prompt))")
        backbone = self.vla.vision_backbone
        return torch.cat([self.vla.projector(self.film(backbone, p, language)) for p in pixels], dim=1)  # [B, num_images * N, dim]

    def embed_proprio(self, state: torch.Tensor) -> torch.Tensor:
        """state: [B, proprio_dim] (normalised) -> the proprio token [B, 1, dim]."""
        if self.proprio_projector is None:
            raise ValueError("this OFT checkpoint has no proprio projector (no proprio_projector--*checkpoint.pt)")
        return self.proprio_projector(state)

    def sequence(self, prompt: PromptIds, image_tokens: torch.Tensor, proprio: torch.Tensor | None) -> tuple[torch.Tensor, int]:
        """The forward's input embeddings [B, T, dim] and the index of the first action position.

        image_tokens: [B, num_images * N, dim]; proprio: [B, 1, dim] or None.
        """
        embed = self.vla.language_model.model.embed_tokens
        b, device = image_tokens.shape[0], image_tokens.device
        text = embed(torch.tensor([prompt.input_ids], device=device)).expand(b, -1, -1)  # [B, 1 + P, dim]
        zeros = image_tokens.new_zeros(b, self.cfg.action_tokens, image_tokens.shape[2])  # [B, K * A, dim]
        stop = embed(torch.tensor([[STOP_TOKEN_ID]], device=device)).expand(b, -1, -1)  # [B, 1, dim]
        observation = [image_tokens] if proprio is None else [image_tokens, proprio]
        parts = [text[:, :1], *observation, text[:, 1:]]
        start = sum(p.shape[1] for p in parts)
        return torch.cat([*parts, zeros, stop], dim=1), start

    # ---- history mode (one cache per episode; the session drives the cache) ---------------------------
    def history_prompt(self, prompt: PromptIds, batch: int = 1) -> torch.Tensor:
        """Pinned once per episode: ``[BOS] + ids("In: What action should the robot take to {instruction}?")``
        -> [B, 1 + P, dim]."""
        embed = self.vla.language_model.model.embed_tokens
        device = embed.weight.device
        return embed(torch.tensor([[prompt.bos, *prompt.instruction]], device=device)).expand(batch, -1, -1)

    @staticmethod
    def observation(image_tokens: torch.Tensor, proprio: torch.Tensor | None) -> torch.Tensor:
        """What a history-mode step appends and keeps: image tokens [B, num_images * N, dim] (+ the proprio
        token [B, 1, dim]) -> [B, num_images * N (+ 1), dim]."""
        return image_tokens if proprio is None else torch.cat([image_tokens, proprio], dim=1)

    def query_block(self, prompt: PromptIds, batch: int = 1) -> tuple[torch.Tensor, int]:
        """A history-mode step's action query, evaluated bidirectionally and never kept:
        ``ids("\nOut:") + [29871] + chunk_size * action_dim zeros + embed(</s>)`` -> ([B, Q, dim], the index in
        it of the first action position)."""
        embed = self.vla.language_model.model.embed_tokens
        device = embed.weight.device
        text = embed(torch.tensor([[*prompt.out, prompt.empty]], device=device)).expand(batch, -1, -1)  # [B, O + 1, dim]
        zeros = text.new_zeros(batch, self.cfg.action_tokens, text.shape[2])  # [B, K * A, dim]
        stop = embed(torch.tensor([[STOP_TOKEN_ID]], device=device)).expand(batch, -1, -1)  # [B, 1, dim]
        return torch.cat([text, zeros, stop], dim=1), text.shape[1]

    def head_input(self, hidden: torch.Tensor, start: int) -> torch.Tensor:
        """Final-normed hidden states [B, T, dim] -> the head's rows [B, K * A, dim] (from ``start - 1``, as
        upstream slices them: the state before an action position predicts it)."""
        return hidden[:, start - 1 : start - 1 + self.cfg.action_tokens]

    def action_hidden(self, embeds: torch.Tensor, start: int) -> torch.Tensor:
        """Bidirectional forward of embeds [B, T, dim] -> the head's input [B, K * A, dim] (final-normed
        hidden states of positions ``start - 1 .. start - 2 + K * A``)."""
        decoder = self.vla.language_model.model
        hidden = decoder(inputs_embeds=embeds, cache=BidirectionalPass(decoder.cfg.rope))  # [B, T, dim]
        return self.head_input(hidden, start)

    def predict(
        self, prompt: PromptIds, pixels: Sequence[torch.Tensor], state: torch.Tensor | None = None
    ) -> torch.Tensor:
        """One chunk: pixels[i] [B, 3 * towers, S, S], state [B, proprio_dim] (normalised) or None ->
        normalised actions [B, chunk_size, action_dim] (float32)."""
        image_tokens = self.embed_images(pixels, self.language(prompt, pixels[0].shape[0]))
        proprio = None if state is None else self.embed_proprio(state)
        embeds, start = self.sequence(prompt, image_tokens, proprio)
        return self.action_head(self.action_hidden(embeds, start)).float()
