"""The ``tokenizer.json`` we write loads in tokenizers 0.19.1 (upstream OpenVLA's pin) and in ours, with the
same ids: merges as ``"a b"`` strings, no fields 0.19.1 does not know, and the shipped assets in that form.

The slow test installs tokenizers 0.19.1 into a throwaway venv and encodes there; the fast ones check the
JSON structure, so a regression to the pair form fails without the venv."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models

from vla_runtime.checkpoints.llama_tokenizer import build_llama_tokenizer, save_llama_tokenizer, training_corpus
from vla_runtime.checkpoints.tokenizer_json import legacy_tokenizer_json, merge_pairs
from vla_runtime.models.prismatic.prompt_prismatic import OUT, PROMPT

ASSETS = Path(__file__).resolve().parents[2] / "assets"
SHIPPED = sorted(ASSETS.glob("*/tokenizer.json"))

# The keys tokenizers 0.19.1 accepts (its serde structs); a newer version adding a field would break it.
TOP_KEYS_0191 = {"version", "truncation", "padding", "added_tokens", "normalizer", "pre_tokenizer", "post_processor",
                 "decoder", "model"}  # fmt: skip
BPE_KEYS_0191 = {"type", "dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix", "fuse_unk",
                 "byte_fallback", "ignore_merges", "vocab", "merges"}  # fmt: skip


def texts() -> list[str]:
    """OpenVLA prompts plus text that exercises byte fallback, action characters and special-token text."""
    prompts = [PROMPT.format(instruction=i) + OUT for i in ("pick up the red cube", "wipe the table", "Zebra 42!")]
    actions = "".join(chr(0x4E00 + k) for k in (0, 7, 255))
    return [*prompts, "\nä ü 😀", actions, "<s> </s> <PAD> <unk>", "  two  spaces ", ""]


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    save_llama_tokenizer(build_llama_tokenizer(), out)
    return out / "tokenizer.json"


def test_written_json_has_the_form_tokenizers_0191_reads(written):
    data = json.loads(written.read_text(encoding="utf-8"))
    assert set(data) <= TOP_KEYS_0191 and set(data["model"]) <= BPE_KEYS_0191
    merges = data["model"]["merges"]
    assert merges and all(isinstance(m, str) and m.count(" ") == 1 for m in merges)
    built = json.loads(build_llama_tokenizer().to_str())["model"]["merges"]
    assert merge_pairs(merges) == merge_pairs(built)  # the same merges, in the same (rank) order


def test_written_json_encodes_as_the_built_tokenizer(written):
    built, loaded = build_llama_tokenizer(), Tokenizer.from_file(str(written))
    assert loaded.get_vocab() == built.get_vocab()
    for text in [*texts(), *training_corpus()[::50]]:
        for special in (True, False):
            assert loaded.encode(text, add_special_tokens=special).ids == built.encode(text, add_special_tokens=special).ids


@pytest.mark.parametrize("shipped", SHIPPED, ids=lambda p: p.parent.name)
def test_shipped_tokenizer_is_what_we_write(shipped, written):
    # byte-identical to the writer's output: the legacy form, and (test above) the built tokenizer's encodings
    assert shipped.read_bytes() == written.read_bytes()


def test_assets_ship_tokenizers():
    assert SHIPPED, f"expected the shipped policies' tokenizer.json under {ASSETS}"


def test_a_merge_with_a_space_inside_a_piece_is_refused():
    tok = Tokenizer(models.BPE(vocab={"a b": 0, "c": 1, "a bc": 2}, merges=[("a b", "c")]))
    with pytest.raises(ValueError, match="space inside a piece"):
        legacy_tokenizer_json(tok)


# ---- tokenizers 0.19.1 itself, in a throwaway venv --------------------------------------------------

READ_0191 = """
import json, sys, tokenizers
from tokenizers import Tokenizer
job = json.load(sys.stdin)
out = {"version": tokenizers.__version__, "ids": {}}
for path in job["files"]:
    tok = Tokenizer.from_file(path)
    out["ids"][path] = [[tok.encode(t, add_special_tokens=s).ids for s in (True, False)] for t in job["texts"]]
print(json.dumps(out))
"""


def _interpreter() -> str | None:
    """A Python for which tokenizers 0.19.1 has wheels (3.8 to 3.12): ours, else python3.11/3.12 on PATH."""
    if (3, 8) <= sys.version_info[:2] <= (3, 12):
        return sys.executable
    return shutil.which("python3.11") or shutil.which("python3.12")


@pytest.fixture(scope="module")
def tokenizers_0191(tmp_path_factory) -> Path:
    """The python of a venv with tokenizers==0.19.1 (skips when pip cannot get it, e.g. no PyPI access)."""
    base = _interpreter()
    if base is None:
        pytest.skip("no Python 3.8-3.12 interpreter to install tokenizers 0.19.1 wheels into")
    venv = tmp_path_factory.mktemp("tokenizers-0.19.1") / "venv"
    subprocess.run([base, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=120)
    python = venv / "bin" / "python"
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q", "--only-binary", ":all:",
           "tokenizers==0.19.1"]  # fmt: skip
    try:
        done = subprocess.run(pip, capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        pytest.skip("pip install tokenizers==0.19.1 timed out (no PyPI access?)")
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        pytest.skip(f"pip could not install tokenizers==0.19.1 (no PyPI access?): {last}")
    return python


@pytest.mark.slow
def test_tokenizers_0191_reads_our_files_with_the_same_ids(tokenizers_0191, written):
    files = [written, *SHIPPED]
    job = json.dumps({"files": [str(f) for f in files], "texts": texts()})
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    done = subprocess.run(
        [str(tokenizers_0191), "-c", READ_0191], input=job, capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, f"tokenizers 0.19.1 failed to read our tokenizer.json:\n{done.stderr[-2000:]}"
    result = json.loads(done.stdout)
    assert result["version"] == "0.19.1"
    for f in files:
        ours = Tokenizer.from_file(str(f))
        expected = [[ours.encode(t, add_special_tokens=s).ids for s in (True, False)] for t in texts()]
        assert result["ids"][str(f)] == expected, f"{f}: tokenizers 0.19.1 encodes differently from ours"
