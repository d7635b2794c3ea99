"""The prompt's ids are upstream's: ``tokenizer(prompt)`` with BOS, then id 29871 appended unless already last,
also for a LLaMA-2 tokenizer that has no ``▁`` entry (upstream appends the literal id, never looks ``▁`` up)."""

import json
import shutil
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer, models
from upstream_reference import greedy_ids

from vla_runtime.api import Observation, load_policy
from vla_runtime.models.prismatic.prompt_prismatic import OUT, PROMPT, PromptTokenizer

INSTRUCTIONS = ("Pick up the red cube", "put the cup in the drawer", "Stack 3 blocks, then WIPE the table!")


def upstream_input_ids(tokenizer: Tokenizer, instruction: str) -> list[int]:
    """``predict_action``: ``tokenizer(prompt).input_ids``, then 29871 appended if the last id is not 29871."""
    ids = tokenizer.encode(PROMPT.format(instruction=instruction.lower()) + OUT).ids
    return ids if ids[-1] == 29871 else [*ids, 29871]


def without_empty_piece(tokenizer_json: str) -> str:
    """The same LLaMA-2-layout tokenizer with its ``▁`` entry (id 29871) renamed to a placeholder; merges whose
    pieces are no longer in the vocabulary go too (a space then falls back to the bytes of U+2581)."""
    data = json.loads(tokenizer_json)
    vocab = data["model"]["vocab"]
    vocab["<unused29871>"] = vocab.pop("▁")
    data["model"]["merges"] = [m for m in data["model"]["merges"] if all(p in vocab for p in m.split(" "))]
    return json.dumps(data, ensure_ascii=False)


@pytest.fixture(scope="module")
def no_empty_ckpt(tiny_openvla, tmp_path_factory):
    """``tiny_openvla`` with a tokenizer.json that has no ``▁`` entry."""
    out = tmp_path_factory.mktemp("no-empty") / "ckpt"
    shutil.copytree(tiny_openvla, out)
    path = out / "tokenizer.json"
    path.write_text(without_empty_piece(path.read_text(encoding="utf-8")), encoding="utf-8")
    return out


@pytest.mark.parametrize("variant", ["llama2", "no_empty_piece"])
def test_prompt_ids_are_upstreams(variant, tiny_openvla, no_empty_ckpt):
    path = tiny_openvla if variant == "llama2" else no_empty_ckpt
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert (tok.token_to_id("▁") is None) == (variant == "no_empty_piece")
    assert tok.get_vocab_size(with_added_tokens=False) == 32000
    ours = PromptTokenizer(tok, bos_id=1)
    assert ours.empty_id == 29871
    for instruction in INSTRUCTIONS:
        assert list(ours.prompt(instruction).input_ids) == upstream_input_ids(tok, instruction)


def test_a_tokenizer_without_the_empty_piece_loads_and_predicts_upstreams_tokens(no_empty_ckpt, frame):
    policy = load_policy(no_empty_ckpt, device="cpu", dtype="float32")
    tok = Tokenizer.from_file(str(no_empty_ckpt / "tokenizer.json"))
    session = policy.new_session(INSTRUCTIONS[0])
    assert list(session.prompt.input_ids) == upstream_input_ids(tok, INSTRUCTIONS[0])
    image = frame(3)
    session.step(Observation(images={"primary": image}))
    pixels = policy.image_processor(image)[None]
    expected = greedy_ids(policy, pixels, upstream_input_ids(tok, INSTRUCTIONS[0]), 7, full_vocab=False)
    assert session.last_tokens[0].tolist() == expected


class EndsWithEmpty:
    """A stand-in tokenizer whose encodings of text ending in ``OUT`` already end with the empty token."""

    def token_to_id(self, token: str) -> int | None:
        return 29871 if token == "▁" else None

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return 32000

    def encode(self, text: str, add_special_tokens: bool = True) -> SimpleNamespace:
        ids = [3 + ord(c) % 200 for c in text] + ([29871] if text.endswith(OUT) else [])
        return SimpleNamespace(ids=([1] if add_special_tokens else []) + ids)


def test_the_empty_token_is_not_appended_twice():
    tok = EndsWithEmpty()
    prompt = PromptTokenizer(tok, bos_id=1).prompt("open the drawer")
    full = tok.encode(PROMPT.format(instruction="open the drawer") + OUT).ids
    assert full[-1] == 29871 and list(prompt.input_ids) == full  # upstream appends nothing
    assert prompt.out[-1] != 29871 and prompt.empty == 29871


def test_a_small_vocabulary_without_the_empty_piece_is_refused():
    small = Tokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[]))
    with pytest.raises(ValueError, match="no '▁' token and only 2 ids, so upstream's empty token id 29871"):
        PromptTokenizer(small, bos_id=1)


@pytest.mark.parametrize(
    "text",
    ["{\"version\": \"1.0\", \"model\": {\"type\": \"BPE\", \"vocab\"", "[]", json.dumps({"version": "1.0", "model": {"type": "Nope"}})],
)
def test_a_corrupt_tokenizer_json_is_a_value_error_naming_the_file(tiny_openvla, tmp_path, text):
    ckpt = shutil.copytree(tiny_openvla, tmp_path / "ckpt")
    (ckpt / "tokenizer.json").write_text(text)
    with pytest.raises(ValueError, match=rf"^{ckpt}/tokenizer\.json is not a tokenizers tokenizer\.json \(corrupt or truncated\?\): "):
        PromptTokenizer.from_pretrained_dir(ckpt, bos_id=1)
    with pytest.raises(ValueError, match="tokenizer.json is not a tokenizers tokenizer.json"):
        load_policy(ckpt, device="meta")
