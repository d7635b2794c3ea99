"""``vla-runtime plan --model DIR --memory FILE --goal TEXT``: the next subtask from a goal and a memory."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..memory.config import MemoryConfig, PrefillConfig
from ..memory.methods import METHODS


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="next subtask instruction from a goal and a memory (KEEP prefill on a LLaMA/Qwen2 HF directory)",
        description=(
            "Load a memory (JSON in the planner node's update format: "
            '{"updates": [{"id": ..., "text": ...}], "deletes": [...], "advance": N}), retrieve the segments '
            "relevant to the goal, prefill them with KEEP (or a baseline) and decode the next subtask greedily. "
            "Prints JSON with the instruction and timings."
        ),
    )
    p.add_argument("--model", required=True, help="HF LLaMA/Qwen2 directory (e.g. from `vla-runtime convert-gguf`)")
    p.add_argument("--memory", required=True, help="memory JSON file (update-message format; several files apply in order)", nargs="+")
    p.add_argument("--goal", required=True)
    p.add_argument("--done", action="append", default=[], help="a finished subtask (repeatable)")
    p.add_argument("--method", default="keep", choices=sorted(METHODS), help="how the memory's KV is obtained (default: keep)")
    p.add_argument("--top-k", type=int, default=20, help="segments retrieved")
    p.add_argument("--static-after", type=int, default=10, help="steps without change before a group is static")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's; 1 on a busy machine)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from ..checkpoints.causal_lm import load_causal_lm
    from ..memory import EmbodiedMemory, SentenceEncoder
    from ..memory.messages import apply_memory_update, parse_memory_update
    from ..memory.planner import Planner, PlannerConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    llm = load_causal_lm(args.model, device=args.device, dtype=torch.float32)
    memory = EmbodiedMemory(SentenceEncoder(device=args.device), MemoryConfig(top_k=args.top_k, static_after=args.static_after))
    for path in args.memory:
        f = Path(path)
        if not f.is_file():
            raise FileNotFoundError(f"memory file {f} does not exist")
        apply_memory_update(memory, parse_memory_update(f.read_bytes(), _file_limits()))
    planner = Planner(llm, memory, PlannerConfig(prefill=PrefillConfig(method=args.method), max_new_tokens=args.max_new_tokens))
    step = planner.next_subtask(args.goal, args.done)
    print(json.dumps({
        "instruction": step.instruction,
        "method": step.prefill.method,
        "ttft_ms": round(step.ttft_ms, 1),
        "total_ms": round(step.total_ms, 1),
        "new_tokens": step.new_tokens,
        "prompt_tokens": step.prefill.n_tokens,
        "recompute_share": round(step.prefill.recompute_share, 3),
        "retrieved": list(step.retrieved),
    }, indent=2))  # fmt: skip
    return 0


def _file_limits():
    from ..memory.messages import UpdateLimits

    return UpdateLimits(max_bytes=16 << 20, max_items=100_000)  # a file may hold a whole memory
