"""Training windows laid out exactly as the runtime feeds them (cross-team contract 2), flattened.

``history`` windows come from ``history_sequence`` (the pinned prompt, then per step its frame forward
and ``action_dim - 1`` single-token forwards); ``single`` windows are one step of stock OpenVLA
(``single_layout``) followed by the same decode forwards. ``flatten`` turns the forwards into position
tables shared by every window of a bucket (same prompt length, same steps, same start kind) plus each
window's own text ids, so a batch embeds its ids once and scatters image/proprio tokens in.

Targets: the last position of each step's frame forward predicts the step's first action token; the
position of action token k (fed by a decode forward) predicts token k + 1. So a step has
``action_dim`` targets at ``end - 1 .. end + action_dim - 2`` of its frame forward. No EOS target:
the runtime always decodes exactly ``action_dim`` tokens, and in history mode the position after the
last action token starts the next frame.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vla_runtime.models.openvla.processing_openvla import history_sequence, single_layout
from vla_runtime.models.prismatic.processing_prismatic import Forward, Segment, SegmentKind
from vla_runtime.models.prismatic.prompt_prismatic import PromptIds


@dataclass(frozen=True)
class FlatLayout:
    """Where every token of a window sits in the flattened sequence (shared by a bucket).

    Args:
        boundaries: tokens per streaming forward (the parallel form's schedule).
        pinned: tokens of the pinned prompt (0 in single mode).
        kept: per forward, whether the cache keeps it (``HistoryMode.OBSERVATIONS`` rolls each step's decode
            forwards back); empty = every forward is kept.
        text_pos: [Nt] positions of text tokens (ids per window in ``WindowTokens.text_ids``).
        image_pos: [steps * n_image] positions of image tokens, step after step.
        proprio_pos: [steps] positions of proprio tokens (empty without a proprio projector).
        target_pos: [steps * action_dim] positions whose next-token logits are the action targets.
    """

    boundaries: tuple[int, ...]
    pinned: int
    text_pos: torch.Tensor
    image_pos: torch.Tensor
    proprio_pos: torch.Tensor
    target_pos: torch.Tensor
    kept: tuple[bool, ...] = ()

    @property
    def n_tokens(self) -> int:
        return sum(self.boundaries)

    @property
    def keeps_all(self) -> bool:
        return all(self.kept)


def window_forwards(
    prompt: PromptIds,
    action_ids: Sequence[Sequence[int]],
    *,
    history: bool,
    has_proprio: bool,
    prev_token: int | None,
    keep_actions: bool = True,
) -> list[Forward]:
    """The forwards the runtime runs for these steps. action_ids: [steps, action_dim] token ids."""
    if history:
        return history_sequence(prompt, action_ids, has_proprio=has_proprio, prev_token=prev_token, keep_actions=keep_actions)
    if len(action_ids) != 1:
        raise ValueError(f"a single-mode window is one step, got {len(action_ids)}")
    decodes = [Forward((Segment(SegmentKind.TEXT, (int(t),)),)) for t in action_ids[0][:-1]]
    return [single_layout(prompt, has_proprio=has_proprio), *decodes]


def flatten(
    forwards: Sequence[Forward], *, n_image_tokens: int, action_dim: int, keep_actions: bool = True
) -> tuple[FlatLayout, list[int]]:
    """Forwards -> (the position tables, this window's text ids in ``text_pos`` order). ``keep_actions``
    ``False``: the decode forwards after each frame forward are marked not kept (``FlatLayout.kept``)."""
    text_pos, text_ids, image_pos, proprio_pos, target_pos, boundaries, kept = [], [], [], [], [], [], []
    pinned = 0
    pos = 0
    for fwd in forwards:
        start = pos
        has_image = False
        for seg in fwd.segments:
            n = seg.length(n_image_tokens)
            if seg.kind is SegmentKind.TEXT:
                text_pos.extend(range(pos, pos + n))
                text_ids.extend(seg.ids)
            elif seg.kind is SegmentKind.IMAGE:
                image_pos.extend(range(pos, pos + n))
                has_image = True
            else:
                proprio_pos.append(pos)
            pos += n
        boundaries.append(pos - start)
        kept.append(keep_actions or has_image or fwd.pin)
        if fwd.pin:
            pinned = pos
        if has_image:
            target_pos.extend(range(pos - 1, pos - 1 + action_dim))
    if target_pos and target_pos[-1] >= pos:
        raise ValueError(f"the window's last step has fewer than {action_dim - 1} decode forwards")

    def as_tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long)

    layout = FlatLayout(
        tuple(boundaries),
        pinned,
        as_tensor(text_pos),
        as_tensor(image_pos),
        as_tensor(proprio_pos),
        as_tensor(target_pos),
        tuple(kept),
    )
    return layout, text_ids


def same_positions(a: FlatLayout, b: FlatLayout) -> bool:
    return (
        a.boundaries == b.boundaries
        and a.pinned == b.pinned
        and a.kept == b.kept
        and all(
            torch.equal(getattr(a, f), getattr(b, f)) for f in ("text_pos", "image_pos", "proprio_pos", "target_pos")
        )
    )
