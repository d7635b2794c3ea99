"""The Prismatic VLAs' prompt as token ids (OpenVLA's; CogACT and HybridVLA reuse it):
``In: What action should the robot take to {instruction}?\\nOut:`` + ``▁`` (29871).

``PromptTokenizer`` encodes it with the checkpoint's own ``tokenizer.json`` (the ``tokenizers`` library);
``PromptIds`` keeps the pieces apart, because history mode feeds them at different times (see the token
layout in ``processing_prismatic`` and ``models.openvla.processing_openvla``). No ``nn.Module`` here.

The "empty token" before the action tokens is the tokenizer's ``▁`` entry. Upstream's ``predict_action``
does not look it up: it appends the literal id 29871 when the prompt's last id is not 29871. So a
LLaMA-2 tokenizer without a ``▁`` entry gets 29871 here too, and a prompt whose ids already end with the
empty token does not get a second one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

PROMPT = "In: What action should the robot take to {instruction}?"
OUT = "\nOut:"
EMPTY_PIECE = "▁"  # the lone SentencePiece space, id 29871 in LLaMA-2: what "Out: " ends with in training
EMPTY_TOKEN_ID = 29871  # the id upstream's predict_action appends (it never looks "▁" up)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PromptIds:
    """The prompt's pieces as token ids.

    Args:
        bos: BOS id. instruction: ids of ``PROMPT`` (no BOS). out: ids of ``OUT`` continuing it.
        empty: the empty token's id (``▁``, 29871 in LLaMA-2) fed before the action tokens.
    """

    bos: int
    instruction: tuple[int, ...]
    out: tuple[int, ...]
    empty: int

    @property
    def input_ids(self) -> tuple[int, ...]:
        """What upstream feeds (before the image tokens are spliced in after BOS)."""
        return (self.bos, *self.instruction, *self.out, self.empty)


class PromptTokenizer:
    """Encodes OpenVLA's prompt with the checkpoint's own ``tokenizer.json`` (the ``tokenizers`` library).

    The empty token is the vocabulary's ``▁`` entry, else upstream's literal id 29871 (which must then be
    inside the vocabulary).
    """

    def __init__(self, tokenizer, *, bos_id: int) -> None:
        self.tokenizer = tokenizer
        self.bos_id = bos_id
        empty = tokenizer.token_to_id(EMPTY_PIECE)
        if empty is None:
            vocab = tokenizer.get_vocab_size(with_added_tokens=True)
            if EMPTY_TOKEN_ID >= vocab:
                raise ValueError(
                    f"the tokenizer has no {EMPTY_PIECE!r} token and only {vocab} ids, so upstream's empty token id "
                    f"{EMPTY_TOKEN_ID} does not exist; OpenVLA needs a LLaMA-2 vocabulary (32000 ids)"
                )
            log.info("the tokenizer has no %r token; the prompt ends with id %d, as upstream's", EMPTY_PIECE, EMPTY_TOKEN_ID)
            empty = EMPTY_TOKEN_ID
        self.empty_id = empty

    @classmethod
    def from_pretrained_dir(cls, path: str | Path, *, bos_id: int) -> "PromptTokenizer":
        from tokenizers import Tokenizer

        file = Path(path) / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"{file} does not exist (the checkpoint's tokenizer is needed for the prompt)")
        try:
            tokenizer = Tokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises plain Exception for unreadable, invalid or inconsistent JSON
            raise ValueError(f"{file} is not a tokenizers tokenizer.json (corrupt or truncated?): {e}") from e
        return cls(tokenizer, bos_id=bos_id)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def prompt(self, instruction: str) -> PromptIds:
        """The ids of ``instruction``'s prompt; ``input_ids`` is upstream's ``tokenizer(prompt)`` plus the
        empty token unless the ids already end with it."""
        head = PROMPT.format(instruction=instruction.lower())
        head_ids, full_ids = self.encode(head), self.encode(head + OUT)
        if full_ids[: len(head_ids)] != head_ids:
            raise ValueError(f"the tokenizer merges across the prompt/{OUT!r} boundary; cannot split the prompt")
        out = full_ids[len(head_ids) :]
        if out and out[-1] == self.empty_id:  # upstream appends the empty token only when it is not already last
            out = out[:-1]
        return PromptIds(self.bos_id, tuple(head_ids), tuple(out), self.empty_id)
