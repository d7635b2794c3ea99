"""A small tokenizer in LLaMA-2's id layout, built offline with ``tokenizers`` for tiny checkpoints.

The files are what an OpenVLA directory ships (``tokenizer.json``, ``tokenizer_config.json``,
``special_tokens_map.json``, ``added_tokens.json``) and the ids sit where LLaMA-2's do, so tiny
checkpoints exercise the ids real ones use: vocabulary 32000, ``<unk>`` 0, ``<s>`` 1, ``</s>`` 2, byte
fallback ``<0x00>``..``<0xFF>`` at 3..258, BPE merges from 259, the lone ``▁`` at 29871 followed by
the single characters, the 256 action tokens (rare single characters) at 31744..31999, and ``<PAD>``
added as 32000. The merges are learned from robot-instruction text; unused ids are placeholders.
The pipeline is LLaMA-2's ``tokenizer.json``: normaliser prepend ``▁`` + spaces -> ``▁``, no
pre-tokeniser, BPE with byte fallback, ``<s> $A`` post-processor. ``tokenizer.json`` is written with
merges as ``"a b"`` strings, so that tokenizers 0.19.1 (upstream OpenVLA's pin) reads it too.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from .tokenizer_json import merge_pairs, save_tokenizer_json

VOCAB_SIZE = 32000
UNK, BOS, EOS, PAD = "<unk>", "<s>", "</s>", "<PAD>"
SPACE = "▁"
SPACE_ID = 29871
N_ACTION_TOKENS = 256
ACTION_CODEPOINT = 0x4E00  # action tokens are 256 consecutive CJK ideographs, as rare in text as LLaMA-2's

_VERBS = ("pick up", "put", "place", "open", "close", "push", "pull", "move", "lift", "stack", "wipe",
          "turn on", "turn off", "slide", "press", "grasp", "reach", "insert", "pour", "drop")  # fmt: skip
_OBJECTS = ("the red cube", "the blue bowl", "the cup", "the drawer", "the black bowl", "the plate",
            "the sponge", "the mug", "the can", "the green block", "the towel", "the door", "the button",
            "the window", "the peg", "the lever", "the faucet", "the basket", "the bottle", "the puck")  # fmt: skip
_PLACES = ("on the plate", "in the drawer", "into the basket", "on the table", "next to the cup",
           "on top of the cabinet", "to the left", "to the right", "in the sink", "onto the shelf", "")  # fmt: skip


def training_corpus() -> list[str]:
    """OpenVLA prompts over a small grid of instructions (the text the merges are learned from)."""
    out = []
    for verb in _VERBS:
        for obj in _OBJECTS:
            for place in _PLACES:
                instruction = " ".join(p for p in (verb, obj, place) if p)
                out.append(f"In: What action should the robot take to {instruction}?\nOut:")
    return out


def _learn_merges(corpus: list[str], alphabet: list[str]) -> list[tuple[str, str]]:
    trainer_tok = Tokenizer(models.BPE())
    trainer_tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
    # merges stay inside words and never swallow punctuation, as SentencePiece's do in LLaMA-2
    trainer_tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="never", split=True), pre_tokenizers.Punctuation("isolated")]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=4000, min_frequency=2, initial_alphabet=alphabet, limit_alphabet=len(alphabet), show_progress=False
    )
    trainer_tok.train_from_iterator(corpus, trainer)
    return merge_pairs(json.loads(trainer_tok.to_str())["model"]["merges"])


def build_llama_tokenizer() -> Tokenizer:
    """The tokenizer, deterministic (same files every time)."""
    alphabet = [SPACE] + [chr(c) for c in range(33, 127)]
    merges = _learn_merges(training_corpus(), alphabet)
    vocab: dict[str, int] = {UNK: 0, BOS: 1, EOS: 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})

    def fill(until: int) -> None:  # placeholders up to (excluding) id `until`
        for i in range(len(vocab), until):
            vocab[f"<unused{i}>"] = i

    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    if len(vocab) > SPACE_ID:
        raise ValueError(f"{len(vocab) - 259} merges do not fit below id {SPACE_ID}")
    fill(SPACE_ID)
    for ch in alphabet:
        vocab[ch] = len(vocab)
    fill(VOCAB_SIZE - N_ACTION_TOKENS)
    for k in range(N_ACTION_TOKENS):
        vocab[chr(ACTION_CODEPOINT + k)] = len(vocab)
    assert len(vocab) == VOCAB_SIZE and vocab[SPACE] == SPACE_ID

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=UNK, fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
    tok.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (UNK, BOS, EOS, PAD)])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS}:1 $B:1", special_tokens=[(BOS, vocab[BOS])]
    )
    return tok


def _token(content: str, *, special: bool) -> dict:
    entry = {"content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
    return {**entry, "special": True} if special else entry


def save_llama_tokenizer(tokenizer: Tokenizer, out: str | Path, *, model_max_length: int = 2048) -> None:
    """Write the four tokenizer files of an OpenVLA directory (transformers 4.40's LlamaTokenizerFast layout;
    ``tokenizer.json`` in the form tokenizers 0.19.1, upstream's pin, reads, see ``tokenizer_json``)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_tokenizer_json(tokenizer, out / "tokenizer.json")
    ids = {t: tokenizer.token_to_id(t) for t in (UNK, BOS, EOS, PAD)}
    config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": {str(ids[t]): _token(t, special=True) for t in (UNK, BOS, EOS, PAD)},
        "bos_token": BOS,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS,
        "legacy": False,
        "model_max_length": model_max_length,
        "pad_token": PAD,
        "padding_side": "right",
        "processor_class": "PrismaticProcessor",
        "sp_model_kwargs": {},
        "tokenizer_class": "LlamaTokenizer",
        "unk_token": UNK,
        "use_default_system_prompt": False,
    }
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK}
    files = {
        "tokenizer_config.json": config,
        "special_tokens_map.json": {k: _token(v, special=False) for k, v in special.items()},
        "added_tokens.json": {PAD: ids[PAD]},
    }
    for name, data in files.items():
        (out / name).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
