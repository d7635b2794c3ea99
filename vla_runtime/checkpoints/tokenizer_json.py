"""``tokenizer.json`` written in the form that tokenizers 0.19.1 reads (the version upstream OpenVLA pins).

tokenizers 0.20 and later save BPE merges as pairs (``"merges": [["▁", "t"], ...]``). tokenizers 0.19.1,
which upstream OpenVLA pins next to transformers 4.40.1, reads merges only in the older form, one
``"▁ t"`` string per merge, and fails on pairs with "data did not match any variant of untagged enum
ModelWrapper". Every later version still reads the string form, so we write that form and both
versions load the file with the same encodings (``tests/checkpoints/test_tokenizer_json.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer


def legacy_tokenizer_json(tokenizer: Tokenizer) -> dict:
    """``tokenizer``'s ``tokenizer.json`` content with BPE merges as ``"a b"`` strings (tokenizers 0.19 form).

    Raises ``ValueError`` when a merge piece contains a space: the string form splits on the space, so
    such a merge cannot be written that way.
    """
    data = json.loads(tokenizer.to_str())
    model = data.get("model") or {}
    if model.get("type") != "BPE":
        return data  # only BPE has merges; other models serialise the same way in both versions
    merges = []
    for merge in model.get("merges", []):
        if isinstance(merge, str):  # already the string form (tokenizers < 0.20 wrote it)
            merges.append(merge)
            continue
        left, right = merge
        if " " in left or " " in right:
            raise ValueError(
                f"BPE merge {merge!r} has a space inside a piece; tokenizers 0.19's 'a b' merge strings cannot hold it"
            )
        merges.append(f"{left} {right}")
    model["merges"] = merges
    return data


def save_tokenizer_json(tokenizer: Tokenizer, path: str | Path) -> None:
    """Write ``tokenizer`` to ``path`` (a ``tokenizer.json``) in the form tokenizers 0.19.1 and later read."""
    text = json.dumps(legacy_tokenizer_json(tokenizer), indent=2, ensure_ascii=False)
    Path(path).write_text(text + "\n", encoding="utf-8")


def merge_pairs(merges: list) -> list[tuple[str, str]]:
    """BPE merges in either serialised form (``"a b"`` strings or ``["a", "b"]`` pairs) -> pairs."""
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else (m[0], m[1]) for m in merges]
