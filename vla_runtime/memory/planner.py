"""Planner: goal + memory -> the next subtask instruction for the VLA policy (greedy, stop strings).

The prompt follows LoTA-Bench (the harness KEEP is evaluated with): the model's chat template around
``[system + "Memory:" header][retrieved memory]["Human: <goal>."]``, and the answer opened as
``"Robot: 1. <done>, 2. <done>, k."`` so the model writes step k. The memory is prefilled by
``MemoryPrefill`` (KEEP by default: stored per-unit KV, multi-hop recomputation,
layer-balanced loading), then the answer is decoded greedily from the assembled cache until a stop
string, EOS or ``max_new_tokens``. Works with any LLaMA/Qwen2 HF directory loaded by
``vla_runtime.checkpoints.causal_lm.load_causal_lm`` (e.g. SmolLM2-135M-Instruct converted by
``vla-runtime convert-gguf``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from ..checkpoints.causal_lm import CausalLM
from ..models.generation import decode
from .bank import EmbodiedMemory
from .config import PrefillConfig, StoreConfig
from .prefill import MemoryPrefill, PrefillStats
from .prompt import PromptBuilder
from .store import KVStore

log = logging.getLogger(__name__)

_MARK = "\x00MEMORY\x00"


@dataclass
class PlannerConfig:
    """Args:
    system_prompt: the planner's role.
    max_new_tokens: longest instruction decoded. stop: strings that end the instruction (not included).
    history: finished subtasks listed in the answer (the most recent, numbered by their place in the plan).
    top_k: segments retrieved (None: the memory's ``top_k``).
    prefill: how the memory's KV is obtained (method, schedule ...). store: KV store tiers.
    unit_context: text every stored memory unit is prefilled after (never in the prompt), e.g. a few
        neutral lines in the memory's own format; "" = none. Stored KV then pulls the query's attention
        less (issue 20: on KitchenWorld, 40 questions, full reuse agreed with full recomputation on 85 %
        instead of 62 %; on PlanWorld it did not help; see the README).
    """

    system_prompt: str = "You are a household robot. Plan tasks step by step like the examples in your memory."
    max_new_tokens: int = 16
    stop: tuple[str, ...] = (",", "\n")
    history: int = 12
    top_k: int | None = None
    prefill: PrefillConfig = field(default_factory=PrefillConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    unit_context: str = ""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"`max_new_tokens` must be >= 1, got {self.max_new_tokens}")
        if any(not s for s in self.stop):
            raise ValueError("`stop` strings must be non-empty")
        if self.history < 0:
            raise ValueError(f"`history` must be >= 0, got {self.history}")


@dataclass
class PlanStep:
    instruction: str
    ttft_ms: float
    total_ms: float
    new_tokens: int
    prefill: PrefillStats
    retrieved: tuple[str, ...]  # segment ids in the prompt


def cut_at_stop(text: str, stop: tuple[str, ...]) -> tuple[str, bool]:
    """``text`` up to the earliest stop string (leading whitespace is dropped first, so an answer that
    opens with a newline is not empty) and whether a stop string was found."""
    text = text.lstrip()
    cut = min((text.find(s) for s in stop if s in text), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


class Planner:
    def __init__(self, llm: CausalLM, memory: EmbodiedMemory, config: PlannerConfig | None = None) -> None:
        if llm.tokenizer is None:
            raise ValueError("the planner needs the LLM's tokenizer (load it with tokenizer=True)")
        self.llm = llm
        self.memory = memory
        self.config = config or PlannerConfig()
        self.builder = PromptBuilder(llm.tokenizer, segment_suffix=memory.config.segment_suffix)
        self.store = KVStore(self.config.store, device=next(llm.model.parameters()).device)
        self.engine = MemoryPrefill(llm.model, self.store, self.config.prefill, decode_capacity=self.config.max_new_tokens + 1)
        eos = getattr(llm.tokenizer, "eos_token_id", None)
        self.stop_ids = {eos} if eos is not None else set()

    def retrieval_query(self, goal: str, done: list[str]) -> str:
        """What memory is retrieved by: the goal and the finished subtasks the answer lists. The next step
        often depends on the place the last one reached ("go to the fridge" -> is the fridge closed?),
        whose segment the goal alone does not retrieve (issue 20: on PlanWorld, 5 of 40 such questions)."""
        return " ".join([goal.strip().rstrip(".") + ".", *(f"{d}." for _, d in self._listed(done))])

    def _listed(self, done: list[str]) -> list[tuple[int, str]]:
        """The finished subtasks the answer lists (the most recent ``history``): (place in the plan from 1, text)."""
        first = max(0, len(done) - self.config.history) if self.config.history else len(done)
        return [(i + 1, d.strip().rstrip(".,")) for i, d in enumerate(done) if i >= first]

    def _texts(self, goal: str, done: list[str]) -> tuple[str, str]:
        """(prefix, query) text around the memory, from the tokenizer's chat template when it has one."""
        steps = "".join(f" {i}. {d}," for i, d in self._listed(done))
        answer = f"Robot:{steps} {len(done) + 1}."
        user = f"Memory:\n{_MARK}Human: {goal.strip().rstrip('.')}."
        tok = self.llm.tokenizer
        if getattr(tok, "chat_template", None):
            chat = [{"role": "system", "content": self.config.system_prompt}, {"role": "user", "content": user}]
            text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) + answer
        else:
            text = f"{self.config.system_prompt}\n\n{user}\n{answer}"
        prefix, query = text.split(_MARK)
        return prefix, query

    @torch.no_grad()
    def next_subtask(self, goal: str, done: list[str] | tuple[str, ...] = ()) -> PlanStep:
        """The next subtask toward ``goal`` given the memory and the subtasks already done."""
        if not goal.strip():
            raise ValueError("the goal must be a non-empty string")
        t0 = time.perf_counter()
        units = self.memory.retrieve(self.retrieval_query(goal, list(done)), self.config.top_k)
        prefix, query = self._texts(goal, list(done))
        prompt = self.builder.build(prefix, units, query, context=self.config.unit_context)
        result = self.engine.run(prompt)
        ttft = (time.perf_counter() - t0) * 1e3
        text, n = self._decode(result)
        return PlanStep(
            instruction=text,
            ttft_ms=ttft,
            total_ms=(time.perf_counter() - t0) * 1e3,
            new_tokens=n,
            prefill=result.stats,
            retrieved=tuple(s.id for u in units for s in u.segments),
        )

    def _decode(self, result) -> tuple[str, int]:
        """Greedy tokens after the prefilled prompt until an end-of-sequence id or a stop string: (text, tokens)."""
        tokenizer, model = self.llm.tokenizer, self.llm.model

        def stopped(tokens: list[torch.Tensor]) -> bool:
            ids = [int(t) for t in tokens]
            if ids[-1] in self.stop_ids:
                return True
            return cut_at_stop(tokenizer.decode(ids, skip_special_tokens=True), self.config.stop)[1]

        out = decode(
            lambda tok: model(tok, cache=result.cache, last_only=True)[:, -1],
            result.logits.reshape(1, -1),  # [1, V]
            lambda logits: logits.argmax(-1, keepdim=True),
            max_new_tokens=self.config.max_new_tokens,
            stop=stopped,
        )
        ids = [int(t) for t in out[0]]
        if ids and ids[-1] in self.stop_ids:
            ids.pop()  # the end-of-sequence id is not part of the text
        text = cut_at_stop(tokenizer.decode(ids, skip_special_tokens=True), self.config.stop)[0] if ids else ""
        return text.strip().rstrip("."), len(ids)
