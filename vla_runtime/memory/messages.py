"""Memory-update messages (the JSON a robot's perception sends) and subtask-change detection:
the pure logic of the ROS planner node, testable without ROS.

Schema of a memory update (a JSON object; every key optional, at least one present)::

    {"updates": [{"id": "obj:Apple", "text": "{'object': 'Apple', 'state': 'sliced', ...}"}, ...],
     "deletes": ["obj:Mug", ...],
     "advance": 1}

``updates`` adds or rewrites segments, ``deletes`` removes them, ``advance`` moves the step clock
forward after the changes. A message is validated whole before anything is applied, so a bad
message changes nothing; ``MemoryUpdateError`` names the offending field.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from .bank import EmbodiedMemory


class MemoryUpdateError(ValueError):
    """A memory-update message that does not follow the schema (the message says where)."""


@dataclass(frozen=True)
class UpdateLimits:
    """Bounds on one message. max_bytes: encoded size; max_items: updates + deletes;
    max_id_chars / max_text_chars: per segment; max_advance: steps per message."""

    max_bytes: int = 64 * 1024
    max_items: int = 256
    max_id_chars: int = 128
    max_text_chars: int = 2000
    max_advance: int = 1000


@dataclass(frozen=True)
class MemoryUpdate:
    updates: tuple[tuple[str, str], ...] = ()
    deletes: tuple[str, ...] = ()
    advance: int = 0


@dataclass(frozen=True)
class UpdateSummary:
    changed: int
    unchanged: int
    deleted: int
    step: int


_KEYS = ("updates", "deletes", "advance")


def parse_memory_update(raw: str | bytes, limits: UpdateLimits = UpdateLimits()) -> MemoryUpdate:
    """Validate a JSON memory update; raises ``MemoryUpdateError`` naming what is wrong."""
    data = raw.encode() if isinstance(raw, str) else raw
    if len(data) > limits.max_bytes:
        raise MemoryUpdateError(f"message is {len(data)} bytes; the limit is {limits.max_bytes}")
    try:
        msg = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MemoryUpdateError(f"not valid JSON: {e}") from e
    except RecursionError as e:  # nesting deeper than the parser's stack
        raise MemoryUpdateError("JSON nested too deeply; expected {\"updates\": {id: text}, ...}") from e
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        raise MemoryUpdateError(f"JSON value out of range: {e}") from e
    if not isinstance(msg, dict):
        raise MemoryUpdateError(f"expected a JSON object with keys {', '.join(_KEYS)}, got {type(msg).__name__}")
    unknown = sorted(set(msg) - set(_KEYS))
    if unknown:
        raise MemoryUpdateError(f"unknown keys {unknown}; allowed: {', '.join(_KEYS)}")
    if not msg:
        raise MemoryUpdateError(f"empty update; give at least one of {', '.join(_KEYS)}")

    def seg_id(value, where: str) -> str:
        if not isinstance(value, str) or not value.strip():
            raise MemoryUpdateError(f"{where}: expected a non-empty string id")
        if len(value) > limits.max_id_chars:
            raise MemoryUpdateError(f"{where}: id is {len(value)} characters; the limit is {limits.max_id_chars}")
        if value.startswith("<"):
            raise MemoryUpdateError(f"{where}: ids starting with '<' are the prefill's own ({value!r})")
        return utf8(value, where)

    def utf8(value: str, where: str) -> str:
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:  # JSON's "\ud800": a lone surrogate no encoder or tokenizer takes
            raise MemoryUpdateError(f"{where}: not valid text ({e.reason} at character {e.start})") from e
        return value

    updates = msg.get("updates", [])
    if not isinstance(updates, list):
        raise MemoryUpdateError("updates: expected a list of {\"id\": ..., \"text\": ...} objects")
    parsed = []
    for i, item in enumerate(updates):
        where = f"updates[{i}]"
        if not isinstance(item, dict) or set(item) != {"id", "text"}:
            raise MemoryUpdateError(f"{where}: expected an object with exactly the keys id and text")
        text = item["text"]
        if not isinstance(text, str) or not text.strip():
            raise MemoryUpdateError(f"{where}.text: expected a non-empty string")
        if len(text) > limits.max_text_chars:
            raise MemoryUpdateError(f"{where}.text: {len(text)} characters; the limit is {limits.max_text_chars}")
        parsed.append((seg_id(item["id"], f"{where}.id"), utf8(text, f"{where}.text")))
    deletes = msg.get("deletes", [])
    if not isinstance(deletes, list):
        raise MemoryUpdateError("deletes: expected a list of segment ids")
    dels = tuple(seg_id(d, f"deletes[{i}]") for i, d in enumerate(deletes))
    if len(parsed) + len(dels) > limits.max_items:
        raise MemoryUpdateError(f"{len(parsed) + len(dels)} updates and deletes; the limit is {limits.max_items}")
    ids = [i for i, _ in parsed] + list(dels)
    if len(set(ids)) != len(ids):
        raise MemoryUpdateError(f"segment ids appear more than once: {sorted({i for i in ids if ids.count(i) > 1})}")
    advance = msg.get("advance", 0)
    if isinstance(advance, bool) or not isinstance(advance, int) or not 0 <= advance <= limits.max_advance:
        raise MemoryUpdateError(f"advance: expected an integer in [0, {limits.max_advance}], got {advance!r}")
    return MemoryUpdate(tuple(parsed), dels, advance)


def apply_memory_update(memory: EmbodiedMemory, update: MemoryUpdate) -> UpdateSummary:
    """Apply a validated update: deletes (ids must exist, checked first), upserts, then ``advance``."""
    missing = [d for d in update.deletes if d not in memory]
    if missing:
        raise MemoryUpdateError(f"deletes: no such segments {missing}")
    for d in update.deletes:
        memory.delete(d)
    changed = sum(memory.upsert(sid, text) for sid, text in update.updates)
    memory.advance(update.advance)
    return UpdateSummary(changed, len(update.updates) - changed, len(update.deletes), memory.step)


def _normalise(instruction: str) -> str:
    return re.sub(r"\s+", " ", instruction).strip().strip(".!").strip().lower()


@dataclass
class SubtaskTracker:
    """Decides when the planner's subtask changed (case, spacing and a trailing period do not count),
    so the node publishes an instruction to the policy only on a change."""

    current: str | None = None
    _key: str | None = field(default=None, repr=False)

    def update(self, instruction: str) -> bool:
        key = _normalise(instruction)
        if not key or key == self._key:
            return False
        self.current, self._key = instruction.strip(), key
        return True

    def reset(self) -> None:
        self.current = self._key = None
