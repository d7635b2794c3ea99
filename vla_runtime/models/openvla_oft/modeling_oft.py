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

Variants: FiLM (OFT+, ``film.py``) conditions the vision towers on ``language(prompt)``; the diffusion
variant (``diffusion_oft.py``, ``denoise``) adds a timestep token after the observation and puts projected
noisy actions at the action positions instead of zeros, one whole forward per DDIM step; in history mode
(``denoise_history``) each DDIM step is a query block ``[timestep] + ids("\nOut:") + 29871 + noisy tokens +
</s>`` over the held history, rolled back like the L1 one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn as nn

from ...kv.bidirectional import BidirectionalPass
from ...kv.slot_cache import SlotCache
from ..prismatic.modeling_prismatic import PrismaticVLM, ProprioProjector
from ..prismatic.prompt_prismatic import PromptIds
from .configuration_oft import HEAD_BLOCKS, STOP_TOKEN_ID, OFTConfig
from .diffusion_oft import OFTDDIM, DiffusionActionHead, NoisyActionProjector, sinusoidal_time
from .film import VisionFiLM, average_language_embedding
from .mlp_resnet import MLPResNet

Decoder = Callable[..., torch.Tensor]  # LlamaModel.forward's signature: (input_ids, inputs_embeds, *, cache, pin)


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

    def __init__(self, vla: PrismaticVLM, cfg: OFTConfig) -> None:
        super().__init__()
        if cfg.llm_dim != vla.cfg.llm.dim:
            raise ValueError(f"OFTConfig.llm_dim {cfg.llm_dim} != the OpenVLA backbone's LLM width {vla.cfg.llm.dim}")
        self.cfg = cfg
        self.vla = vla
        self.action_head = DiffusionActionHead(cfg) if cfg.diffusion else L1RegressionActionHead(cfg)
        self.noisy_action_projector = NoisyActionProjector(cfg.llm_dim) if cfg.diffusion else None
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

    def denoise(
        self, prompt: PromptIds, image_tokens: torch.Tensor, proprio: torch.Tensor | None, noise: torch.Tensor,
        decoder: Decoder | None = None,
    ) -> torch.Tensor:
        """The diffusion variant's chunk (upstream ``_run_diffusion_prediction``): noise [B, K, A] -> normalised
        actions [B, K, A] (float32) after ``diffusion_steps`` DDIM steps.

        The sequence is ``sequence``'s with one more token after the observation, the timestep embedding
        (``sinusoidal_time(t, llm_dim)``), and the action positions holding ``noisy_action_projector`` of the
        current sample's entries (row-major, one token per entry) instead of zeros. Each step re-runs the whole
        bidirectional forward; the image tokens are computed once. image_tokens: [B, num_images * N, dim];
        proprio: [B, 1, dim] or None. ``decoder``: as in ``action_hidden``.
        """
        observation = image_tokens if proprio is None else torch.cat([image_tokens, proprio], dim=1)
        slot = observation.new_zeros(observation.shape[0], 1, observation.shape[2])  # [B, 1, dim], the timestep token's place
        embeds, start = self.sequence(prompt, observation, slot)  # [B, T, dim]
        forward = lambda step: self.action_hidden(step, start, decoder)  # noqa: E731  a whole bidirectional forward
        return self._sample(embeds, noise, time_index=1 + observation.shape[1], start=start, hidden=forward)

    def _sample(
        self, embeds: torch.Tensor, noise: torch.Tensor, *, time_index: int, start: int,
        hidden: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """The DDIM loop over a template embeds [B, T, dim]: each step writes ``sinusoidal_time(t)`` at
        ``time_index`` and the projected entries of x_t at the K * A positions from ``start`` into a copy,
        ``hidden`` maps it to the head's rows [B, K * A, dim], the head predicts eps and ``OFTDDIM`` steps.
        noise: [B, K, A] -> normalised actions [B, K, A] (float32)."""
        if self.noisy_action_projector is None:
            raise ValueError("this OFT checkpoint is the L1-regression variant (no noisy_action_projector--*checkpoint.pt)")
        b, k, a = noise.shape
        scheduler = OFTDDIM(self.cfg.diffusion_train_steps, self.cfg.diffusion_steps)
        x = noise.float()
        for t in scheduler.timesteps:
            step = embeds.clone()
            step[:, time_index] = sinusoidal_time(torch.full((b,), float(t), device=x.device), self.cfg.llm_dim).to(embeds.dtype)
            step[:, start : start + k * a] = self.noisy_action_projector(x.reshape(b, k * a, 1).to(embeds.dtype))  # [B, K * A, dim]
            eps = self.action_head(hidden(step)).float()  # [B, K, A]
            x = scheduler.step(eps, t, x)
        return x

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

    def denoise_history(
        self, prompt: PromptIds, noise: torch.Tensor, cache: SlotCache, decoder: Decoder | None = None
    ) -> torch.Tensor:
        """The diffusion variant in history mode, after the step's observation is kept: noise [B, K, A] ->
        normalised actions [B, K, A] (float32). Each DDIM step evaluates a fresh query block
        ``[timestep token] + ids("\nOut:") + 29871 + noisy_action_projector(x_t entries) + embed(</s>)`` inside
        ``cache.bidirectional_block()`` (the timestep token right after the newest observation, as upstream
        places it after the observation; the block is rolled back, so the cache keeps observations only); the
        head reads eps from the rows ``query_block``'s head reads, one later for the timestep token. ``decoder``: as
        in ``action_hidden``."""
        block, first = self.query_block(prompt, noise.shape[0])
        block = torch.cat([block.new_zeros(block.shape[0], 1, block.shape[2]), block], dim=1)  # [B, 1 + Q, dim]
        decoder = self.vla.language_model.model if decoder is None else decoder

        def hidden(step: torch.Tensor) -> torch.Tensor:
            with cache.bidirectional_block():
                return self.head_input(decoder(inputs_embeds=step, cache=cache), first + 1)

        return self._sample(block, noise, time_index=0, start=first + 1, hidden=hidden)

    def head_input(self, hidden: torch.Tensor, start: int) -> torch.Tensor:
        """Final-normed hidden states [B, T, dim] -> the head's rows [B, K * A, dim] (from ``start - 1``, as
        upstream slices them: the state before an action position predicts it)."""
        return hidden[:, start - 1 : start - 1 + self.cfg.action_tokens]

    def action_hidden(self, embeds: torch.Tensor, start: int, decoder: Decoder | None = None) -> torch.Tensor:
        """Bidirectional forward of embeds [B, T, dim] -> the head's input [B, K * A, dim] (final-normed
        hidden states of positions ``start - 1 .. start - 2 + K * A``). ``decoder``: what runs the LLaMA's
        forward (default the model itself; a session's compiled one, ``policies.compiled.CompiledDecoder``)."""
        llm = self.vla.language_model.model
        decoder = llm if decoder is None else decoder
        hidden = decoder(inputs_embeds=embeds, cache=BidirectionalPass(llm.cfg.rope, embeds.device))  # [B, T, dim]
        return self.head_input(hidden, start)

    def predict(
        self, prompt: PromptIds, pixels: Sequence[torch.Tensor], state: torch.Tensor | None = None,
        noise: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One chunk: pixels[i] [B, 3 * towers, S, S], state [B, proprio_dim] (normalised) or None ->
        normalised actions [B, chunk_size, action_dim] (float32). The diffusion variant starts from
        ``noise`` [B, chunk_size, action_dim] (required there)."""
        image_tokens = self.embed_images(pixels, self.language(prompt, pixels[0].shape[0]))
        proprio = None if state is None else self.embed_proprio(state)
        if self.cfg.diffusion:
            if noise is None:
                raise ValueError("the diffusion variant needs `noise` [B, chunk_size, action_dim] to start from")
            return self.denoise(prompt, image_tokens, proprio, noise)
        embeds, start = self.sequence(prompt, image_tokens, proprio)
        return self.action_head(self.action_hidden(embeds, start)).float()
