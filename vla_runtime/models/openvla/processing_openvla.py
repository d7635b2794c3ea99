"""OpenVLA's own processing on the Prismatic VLM (``models.prismatic``): its step layouts and its action tokens.

- Token layout (cross-team contract 2): ``single_layout`` (stock) and ``history_frame`` / ``history_sequence``
  (history mode after ``processing_prismatic.history_prompt``, shared by the runtime session and training).
- ``ActionTokenizer``: bins <-> the last ``n_bins`` text ids, un-normalisation with ``ActionStats``.
No ``nn.Module`` here.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..prismatic.processing_prismatic import ActionStats, Forward, Segment, SegmentKind, history_prompt, text_segment
from ..prismatic.prompt_prismatic import PromptIds


def _observation(step: int, has_proprio: bool) -> list[Segment]:
    segs = [Segment(SegmentKind.IMAGE, step=step)]
    if has_proprio:
        segs.append(Segment(SegmentKind.PROPRIO, step=step))
    return segs


def single_layout(prompt: PromptIds, *, has_proprio: bool) -> Forward:
    """Stock OpenVLA: ``[BOS] + image (+ proprio) + ids(prompt) + [29871]`` in one forward, fresh cache."""
    return Forward((text_segment([prompt.bos]), *_observation(0, has_proprio), text_segment([*prompt.instruction, *prompt.out, prompt.empty])))


def history_frame(prompt: PromptIds, *, step: int, prev_token: int | None, has_proprio: bool) -> Forward:
    """History mode, per control step: ``[previous step's last action token, if any] + image (+ proprio)
    + ids("\\nOut:") + [29871]``. Its last logits give the step's first action token; then
    ``action_dim - 1`` single-token forwards feed the generated tokens (the last one is fed next step)."""
    head = [text_segment([prev_token])] if prev_token is not None else []
    return Forward((*head, *_observation(step, has_proprio), text_segment([*prompt.out, prompt.empty])))


def history_sequence(
    prompt: PromptIds,
    action_ids: Sequence[Sequence[int]],
    *,
    has_proprio: bool,
    prev_token: int | None = None,
    keep_actions: bool = True,
) -> list[Forward]:
    """The whole history-mode episode as the runtime runs it, for ``len(action_ids)`` steps.

    action_ids[s]: the ``action_dim`` tokens generated at step s. Flattened, the forwards are the
    training parallel form's sequence; each non-pinned forward's last position predicts the next token.
    prev_token: the last action token of the step before ``action_ids[0]`` (a window that starts
    mid-episode: the runtime feeds it at the start of that step's frame); ``None`` = the episode's start.
    keep_actions: ``False`` (``HistoryMode.OBSERVATIONS``): the decode forwards are rolled back after each
    step, so no frame starts with the previous action token (``prev_token`` is ignored).
    """
    forwards = [history_prompt(prompt)]
    for step, ids in enumerate(action_ids):
        prev = (int(action_ids[step - 1][-1]) if step else prev_token) if keep_actions else None
        forwards.append(history_frame(prompt, step=step, prev_token=prev, has_proprio=has_proprio))
        forwards.extend(Forward((text_segment([t]),)) for t in ids[:-1])
    return forwards


# ---- actions ------------------------------------------------------------------------------------


class ActionTokenizer:
    """Actions <-> the last ``n_bins`` ids of the text vocabulary (OpenVLA's discretisation).

    ``bins = linspace(-1, 1, n_bins)``; encoding is ``vocab_size - digitize(a, bins)``; decoding maps
    ``vocab_size - id - 1`` (clipped) to one of the ``n_bins - 1`` bin centres, then un-normalises with
    ``stats`` when given.
    """

    def __init__(self, n_bins: int = 256, vocab_size: int = 32000, stats: ActionStats | None = None) -> None:
        self.n_bins, self.vocab_size, self.stats = n_bins, vocab_size, stats
        self.bins = np.linspace(-1.0, 1.0, n_bins)
        self.centers = (self.bins[:-1] + self.bins[1:]) / 2.0
        self.first_id, self.last_id = vocab_size - n_bins, vocab_size - 1

    def encode(self, actions: np.ndarray) -> np.ndarray:
        """Normalised actions [..., D] in [-1, 1] -> token ids [..., D] (int64)."""
        return self.vocab_size - np.digitize(np.clip(actions, -1.0, 1.0), self.bins).astype(np.int64)

    def normalized(self, ids: np.ndarray) -> np.ndarray:
        """Token ids [..., D] -> bin centres [..., D] in [-1, 1]."""
        idx = np.clip(self.vocab_size - np.asarray(ids, dtype=np.int64) - 1, 0, len(self.centers) - 1)
        return self.centers[idx]

    def decode(self, ids: np.ndarray) -> np.ndarray:
        """Token ids [B, D] -> actions [B, D] in robot units (normalised when there are no stats)."""
        x = self.normalized(ids)
        return x if self.stats is None else self.stats.unnormalize(x)
