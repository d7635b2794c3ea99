"""OpenVLA's prompt as token ids: ``In: What action should the robot take to {instruction}?\\nOut:`` + ``▁`` (29871).

``PromptTokenizer`` encodes it with the checkpoint's own ``tokenizer.json`` (the ``tokenizers`` library);
``PromptIds`` keeps the pieces apart, because history mode feeds them at different times (see the token
layout in ``processing_openvla``). No ``nn.Module`` here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

PROMPT = "In: What action should the robot take to {instruction}?"
OUT = "\nOut:"
EMPTY_PIECE = "▁"  # the lone SentencePiece space, id 29871 in LLaMA-2: what "Out: " ends with in training


@dataclass(frozen=True)
class PromptIds:
    """The prompt's pieces as token ids.

    Args:
        bos: BOS id. instruction: ids of ``PROMPT`` (no BOS). out: ids of ``OUT`` continuing it.
        empty: the ``▁`` id appended before the action tokens.
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
    """Encodes OpenVLA's prompt with the checkpoint's own ``tokenizer.json`` (the ``tokenizers`` library)."""

    def __init__(self, tokenizer, *, bos_id: int) -> None:
        self.tokenizer = tokenizer
        self.bos_id = bos_id
        empty = tokenizer.token_to_id(EMPTY_PIECE)
        if empty is None:
            raise ValueError(f"the tokenizer has no {EMPTY_PIECE!r} token; OpenVLA needs a LLaMA-style vocabulary")
        self.empty_id = empty

    @classmethod
    def from_pretrained_dir(cls, path: str | Path, *, bos_id: int) -> "PromptTokenizer":
        from tokenizers import Tokenizer

        file = Path(path) / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"{file} does not exist (the checkpoint's tokenizer is needed for the prompt)")
        return cls(Tokenizer.from_file(str(file)), bos_id=bos_id)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def prompt(self, instruction: str) -> PromptIds:
        head = PROMPT.format(instruction=instruction.lower())
        head_ids, full_ids = self.encode(head), self.encode(head + OUT)
        if full_ids[: len(head_ids)] != head_ids:
            raise ValueError(f"the tokenizer merges across the prompt/{OUT!r} boundary; cannot split the prompt")
        return PromptIds(self.bos_id, tuple(head_ids), tuple(full_ids[len(head_ids) :]), self.empty_id)
