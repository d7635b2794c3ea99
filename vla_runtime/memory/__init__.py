"""KEEP: KV-cache-centric embodied memory (static/dynamic groups, multi-hop recomputation,
layer-balanced loading), its baselines through the same per-layer loop, and the planner."""

from .bank import EmbodiedMemory, MemoryUnit, Segment, SegmentView
from .config import MemoryConfig, PrefillConfig, StoreConfig, TierConfig
from .encoder import SentenceEncoder
from .importance import SegmentAttention, propagate_importance
from .methods import METHODS
from .prefill import MemoryPrefill, PrefillResult, PrefillStats
from .prompt import MemoryPrompt, PromptBuilder, PromptSegment, PromptUnit
from .store import KVStore, UnitKV, content_key

__all__ = [
    "METHODS",
    "EmbodiedMemory",
    "KVStore",
    "MemoryConfig",
    "MemoryPrefill",
    "MemoryPrompt",
    "MemoryUnit",
    "PrefillConfig",
    "PrefillResult",
    "PrefillStats",
    "PromptBuilder",
    "PromptSegment",
    "PromptUnit",
    "Segment",
    "SegmentAttention",
    "SegmentView",
    "SentenceEncoder",
    "StoreConfig",
    "TierConfig",
    "UnitKV",
    "content_key",
    "propagate_importance",
]
