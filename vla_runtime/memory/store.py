"""Tiered store of per-unit KV (keys **before** RoPE), keyed by a content hash.

A unit's KV is ``k, v: [L, Hkv, n, D]`` for its ``n`` tokens. Tiers go from fastest to slowest
(device memory, CPU RAM, disk as safetensors files). A new unit enters the fastest tier; when a tier
is over its byte budget its least recently used units move one tier down, and the last tier drops
them. Units in use by a running prefill are pinned (never moved or dropped while pinned). The disk tier's
directory belongs to one store at a time and outlives it: the next store on it starts with its units.

``read_layer`` copies one layer of a unit's token range into caller buffers -- the load the KEEP
prefill needs per (segment, layer); ``read_layers`` moves one layer of several units as one transfer.
A tier can emulate a slower link (``bandwidth``) so the loading schedule can be studied on a machine
without one.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import math
import os
import threading
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .config import StoreConfig, TierConfig

log = logging.getLogger(__name__)


def content_key(*parts) -> str:
    """A stable hash of token ids / strings (the store key of a unit's KV)."""
    h = hashlib.sha256()
    for part in parts:
        h.update(repr(part).encode())
        h.update(b"\x00")
    return h.hexdigest()[:32]


@dataclass(frozen=True)
class UnitKV:
    """k, v: [L, Hkv, n, D] (k without RoPE)."""

    k: torch.Tensor
    v: torch.Tensor

    def __post_init__(self) -> None:
        if self.k.shape != self.v.shape or self.k.dim() != 4:
            raise ValueError(f"unit KV needs k, v of equal shape [L, Hkv, n, D], got {tuple(self.k.shape)}, {tuple(self.v.shape)}")

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    @property
    def n_tokens(self) -> int:
        return self.k.shape[2]


@dataclass
class LayerRead:
    """One unit's part of a layer load: tokens ``[start, end)`` of unit ``key`` into ``out_k, out_v: [Hkv, end - start, D]``."""

    key: str
    start: int
    end: int
    out_k: torch.Tensor
    out_v: torch.Tensor


@dataclass
class TierStats:
    units: int = 0
    bytes: int = 0
    bytes_read: int = 0
    reads: int = 0
    demoted: int = 0
    dropped: int = 0


class _Tier:
    """One tier: an LRU-ordered map key -> payload, its byte count and its read path."""

    def __init__(self, cfg: TierConfig, device: torch.device) -> None:
        self.cfg = cfg
        self.device = device
        self.entries: OrderedDict[str, tuple[object, int]] = OrderedDict()  # key -> (payload, nbytes)
        self.stats = TierStats()

    @property
    def used(self) -> int:
        return self.stats.bytes

    def insert(self, key: str, kv: UnitKV) -> None:
        payload = self._encode(key, kv)
        self.entries[key] = (payload, kv.nbytes)
        self.stats.units += 1
        self.stats.bytes += kv.nbytes

    def remove(self, key: str) -> UnitKV:
        payload, nbytes = self.entries.pop(key)
        self.stats.units -= 1
        self.stats.bytes -= nbytes
        return self._decode(key, payload, drop=True)

    def full(self, key: str) -> UnitKV:
        return self._decode(key, self.entries[key][0], drop=False)

    def layer(self, key: str, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: [Hkv, end - start, D] of one layer (a view or a fresh tensor on this tier's side)."""
        kv = self.entries[key][0]
        return kv.k[layer, :, start:end], kv.v[layer, :, start:end]

    def _encode(self, key: str, kv: UnitKV):
        return kv

    def _decode(self, key: str, payload, *, drop: bool) -> UnitKV:
        return payload


class _DeviceTier(_Tier):
    def _encode(self, key, kv):
        return UnitKV(kv.k.to(self.device), kv.v.to(self.device))


class _HostTier(_Tier):
    """CPU RAM; pinned when the compute device is CUDA so loads can be asynchronous."""

    def _encode(self, key, kv):
        k, v = kv.k.to("cpu"), kv.v.to("cpu")
        if self.device.type == "cuda":
            k, v = k.pin_memory(), v.pin_memory()
        return UnitKV(k, v)


class _DiskTier(_Tier):
    """One safetensors file per unit; a layer is read with a slice (memory-mapped, never unpickled).

    The directory belongs to one store at a time (an exclusive lock on its ``.lock`` file, released by ``close``
    or at exit): two stores sharing it would delete each other's files. The units an earlier store left there are
    taken back at start, least recently written first (a restart keeps the tier); a file that cannot be read as a
    unit is deleted with a warning, and so are the ``*.tmp`` files a kill left."""

    def __init__(self, cfg: TierConfig, device: torch.device) -> None:
        super().__init__(cfg, device)
        self.root = Path(cfg.path)
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock_file = open(self.root / ".lock", "a")  # noqa: SIM115 - held for the store's lifetime
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            raise ValueError(f"disk tier {self.root} is in use by another KV store (its .lock is held); give each store "
                             "its own `path`") from None
        self._reload()

    def close(self) -> None:
        self._lock_file.close()

    def _reload(self) -> None:
        for tmp in self.root.glob(f"*{UNIT_SUFFIX}.tmp"):
            tmp.unlink(missing_ok=True)
        for path in sorted(self.root.glob(f"*{UNIT_SUFFIX}"), key=lambda p: p.stat().st_mtime_ns):
            try:
                nbytes = _unit_file_bytes(path)
            except (OSError, ValueError, SafetensorError) as e:
                log.warning("disk tier %s: deleting %s, which is not a unit's KV (%s)", self.root, path.name, e)
                path.unlink(missing_ok=True)
                continue
            self.entries[path.name.removesuffix(UNIT_SUFFIX)] = (path, nbytes)
            self.stats.units += 1
            self.stats.bytes += nbytes
        if self.entries:
            log.info("disk tier %s: %d units (%d bytes) kept from an earlier store", self.root, self.stats.units, self.stats.bytes)

    def _file(self, key: str) -> Path:
        return self.root / f"{key}{UNIT_SUFFIX}"

    def _encode(self, key, kv):
        """Written beside its final name and renamed into place: a unit file is complete or absent."""
        path = self._file(key)
        tmp = path.with_name(path.name + ".tmp")
        save_file({"k": kv.k.detach().cpu().contiguous(), "v": kv.v.detach().cpu().contiguous()}, str(tmp))
        os.replace(tmp, path)
        return path

    def _decode(self, key, payload, *, drop):
        with safe_open(str(payload), framework="pt") as f:
            kv = UnitKV(f.get_tensor("k"), f.get_tensor("v"))
        if drop:
            payload.unlink(missing_ok=True)
        return kv

    def layer(self, key, layer, start, end):
        with safe_open(str(self.entries[key][0]), framework="pt") as f:
            return f.get_slice("k")[layer, :, start:end], f.get_slice("v")[layer, :, start:end]


UNIT_SUFFIX = ".safetensors"
_ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1}


def _unit_file_bytes(path: Path) -> int:
    """The bytes of the unit a disk-tier file holds, from its header (``ValueError`` if it holds no unit)."""
    with safe_open(str(path), framework="pt") as f:
        if set(f.keys()) != {"k", "v"}:
            raise ValueError(f"tensors {sorted(f.keys())}; expected k and v")
        k, v = f.get_slice("k"), f.get_slice("v")
        if k.get_shape() != v.get_shape() or len(k.get_shape()) != 4 or k.get_dtype() not in _ITEM_BYTES:
            raise ValueError(f"k {k.get_shape()} {k.get_dtype()}, v {v.get_shape()}; expected equal float [L, Hkv, n, D]")
        return 2 * math.prod(k.get_shape()) * _ITEM_BYTES[k.get_dtype()]


TIERS: dict[str, type[_Tier]] = {"device": _DeviceTier, "host": _HostTier, "disk": _DiskTier}


class KVStore:
    """Units of pre-RoPE KV in tiers with byte budgets and LRU demotion. Thread-safe."""

    def __init__(self, config: StoreConfig | None = None, *, device: torch.device | str = "cpu") -> None:
        self.config = config or StoreConfig()
        self.device = torch.device(device)
        self.tiers = []
        try:
            for t in self.config.tiers:
                self.tiers.append(TIERS[t.kind](t, self.device))
        except BaseException:
            self.close()
            raise
        self._lock = threading.RLock()
        self._pins: dict[str, int] = {}
        self._rebalance()  # a disk tier that kept an earlier store's units may be over its budget

    def close(self) -> None:
        """Release the disk tier's directory (its files stay for the next store on it)."""
        for tier in self.tiers:
            if isinstance(tier, _DiskTier):
                tier.close()

    def __enter__(self) -> "KVStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- queries --------------------------------------------------------------------------------
    def __contains__(self, key: str) -> bool:
        with self._lock:
            return any(key in t.entries for t in self.tiers)

    def tier_of(self, key: str) -> str | None:
        with self._lock:
            return next((t.cfg.kind for t in self.tiers if key in t.entries), None)

    def keys(self) -> list[str]:
        with self._lock:
            return [k for t in self.tiers for k in t.entries]

    def stats(self) -> dict[str, TierStats]:
        with self._lock:
            return {t.cfg.kind: TierStats(**vars(t.stats)) for t in self.tiers}

    @property
    def nbytes(self) -> int:
        return sum(t.used for t in self.tiers)

    # ---- writes ---------------------------------------------------------------------------------
    def put(self, key: str, kv: UnitKV) -> None:
        """Store a unit in the fastest tier (replacing an older copy) and rebalance the tiers."""
        largest = max(t.cfg.budget_bytes for t in self.tiers)
        if kv.nbytes > largest:
            raise ValueError(f"a unit of {kv.nbytes} bytes does not fit any tier (largest budget {largest} bytes)")
        with self._lock:
            for tier in self.tiers:
                if key in tier.entries:
                    tier.remove(key)
            first = next(t for t in self.tiers if t.cfg.budget_bytes >= kv.nbytes)
            first.insert(key, kv)
            self._rebalance()

    def _rebalance(self) -> None:
        for i, tier in enumerate(self.tiers):
            victims = iter([k for k in tier.entries if not self._pins.get(k)])  # LRU first
            while tier.used > tier.cfg.budget_bytes:
                key = next(victims, None)
                if key is None:
                    log.warning("KV store tier %s is over budget (%d > %d bytes): its units are in use", tier.cfg.kind, tier.used, tier.cfg.budget_bytes)
                    break
                kv = tier.remove(key)
                if i + 1 < len(self.tiers):
                    tier.stats.demoted += 1
                    self.tiers[i + 1].insert(key, kv)  # newest there: everything below was used less recently
                else:
                    tier.stats.dropped += 1
                    log.debug("KV store dropped unit %s (LRU of the last tier)", key)

    def touch(self, key: str) -> None:
        """Mark a unit as just used (moves it to the MRU end of its tier)."""
        with self._lock:
            for tier in self.tiers:
                if key in tier.entries:
                    tier.entries.move_to_end(key)
                    return
        raise KeyError(f"KV unit {key} is not in the store")

    @contextmanager
    def pinned(self, keys):
        """Keep ``keys`` where they are (no demotion or dropping) inside the block."""
        keys = list(keys)
        with self._lock:
            for k in keys:
                self._pins[k] = self._pins.get(k, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                for k in keys:
                    self._pins[k] -= 1
                    if not self._pins[k]:
                        del self._pins[k]
                self._rebalance()

    # ---- reads ----------------------------------------------------------------------------------
    def _find(self, key: str) -> _Tier:
        for tier in self.tiers:
            if key in tier.entries:
                return tier
        raise KeyError(f"KV unit {key} is not in the store (evicted or never stored)")

    def get(self, key: str) -> UnitKV:
        """The whole unit (a copy when it lives on disk)."""
        with self._lock:
            tier = self._find(key)
            tier.entries.move_to_end(key)
            return tier.full(key)

    def read_layer(
        self, key: str, layer: int, start: int, end: int, out_k: torch.Tensor, out_v: torch.Tensor, *, non_blocking: bool = False
    ) -> int:
        """Copy layer ``layer`` of tokens ``[start, end)`` of a unit into ``out_k, out_v: [Hkv, end - start, D]``.

        Returns the bytes moved. Honours the tier's emulated ``bandwidth`` (sleeps out the difference).
        """
        return self.read_layers([LayerRead(key, start, end, out_k, out_v)], layer, non_blocking=non_blocking)

    def read_layers(self, reads: list[LayerRead], layer: int, *, non_blocking: bool = False) -> int:
        """Copy layer ``layer`` of several units' token ranges, one transfer: the bytes of every read are
        moved first, then an emulated ``bandwidth`` is waited out once for the total (as one DMA of a
        descriptor list, not one wake-up per unit). Returns the bytes moved."""
        t0 = time.perf_counter()
        with self._lock:  # one lookup pass: the copies run outside the lock
            tiers = [self._find(r.key) for r in reads]
            for tier, r in zip(tiers, reads):  # read: the most recently used (the eviction order is LRU)
                tier.entries.move_to_end(r.key)
            slices = [tier.layer(r.key, layer, r.start, r.end) for tier, r in zip(tiers, reads)]
        sizes = []
        for r, (k, v) in zip(reads, slices):
            r.out_k.copy_(k, non_blocking=non_blocking)
            r.out_v.copy_(v, non_blocking=non_blocking)
            sizes.append(k.numel() * k.element_size() + v.numel() * v.element_size())
        with self._lock:
            for tier, nbytes in zip(tiers, sizes):
                tier.stats.reads += 1
                tier.stats.bytes_read += nbytes
        link_s = sum(n / t.cfg.bandwidth for t, n in zip(tiers, sizes) if t.cfg.bandwidth is not None)
        wait = link_s - (time.perf_counter() - t0)
        if wait > 0:
            time.sleep(wait)
        return sum(sizes)
