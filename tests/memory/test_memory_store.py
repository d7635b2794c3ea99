"""Tiered KV store: byte budgets, LRU demotion and dropping, disk tier, layer reads, pins."""

import time

import pytest
import torch

from vla_runtime.memory import KVStore, StoreConfig, TierConfig, UnitKV
from vla_runtime.memory.store import LayerRead


def unit(seed, n=4, layers=2):
    g = torch.Generator().manual_seed(seed)
    return UnitKV(torch.randn(layers, 2, n, 8, generator=g), torch.randn(layers, 2, n, 8, generator=g))


UNIT_BYTES = unit(0).nbytes  # 2 x 2*2*4*8 floats


def test_lru_demotes_to_disk_and_drops_from_the_last_tier(tmp_path):
    store = KVStore(StoreConfig([TierConfig("host", 2 * UNIT_BYTES), TierConfig("disk", 2 * UNIT_BYTES, path=tmp_path)]))
    for name in "abc":
        store.put(name, unit(ord(name)))
    assert [store.tier_of(k) for k in "abc"] == ["disk", "host", "host"]  # a was least recently used
    store.touch("b")
    store.put("d", unit(4))
    assert [store.tier_of(k) for k in "abcd"] == ["disk", "host", "disk", "host"]  # c, not the touched b
    store.put("e", unit(5))  # b demoted; disk over budget: drops its least recently used unit, a
    assert "a" not in store and store.tier_of("b") == "disk"
    assert store.stats()["disk"].dropped == 1 and store.stats()["host"].demoted == 3
    assert store.stats()["host"].bytes <= 2 * UNIT_BYTES and store.stats()["disk"].bytes <= 2 * UNIT_BYTES
    # a unit read back from disk is bit-identical
    torch.testing.assert_close(store.get("c").k, unit(ord("c")).k, rtol=0, atol=0)
    assert len(list(tmp_path.glob("*.safetensors"))) == 2
    with pytest.raises(KeyError, match="evicted or never stored"):
        store.get("a")


def test_read_layer_copies_one_layer_slice_from_every_tier(tmp_path):
    store = KVStore(StoreConfig([TierConfig("host", UNIT_BYTES), TierConfig("disk", 4 * UNIT_BYTES, path=tmp_path)]))
    store.put("x", unit(1))
    store.put("y", unit(2))  # x moves to disk
    for key in ("x", "y"):
        k, v = torch.empty(2, 2, 8), torch.empty(2, 2, 8)
        assert store.read_layer(key, 1, 1, 3, k, v) == 2 * k.numel() * 4
        torch.testing.assert_close(k, unit(1 if key == "x" else 2).k[1, :, 1:3], rtol=0, atol=0)
        torch.testing.assert_close(v, unit(1 if key == "x" else 2).v[1, :, 1:3], rtol=0, atol=0)


def test_pinned_units_stay_put_until_released():
    store = KVStore(StoreConfig([TierConfig("host", UNIT_BYTES)]))
    store.put("a", unit(1))
    with store.pinned(["a", "b"]):  # what a running prefill does with the units it reads
        store.put("b", unit(2))
        assert "a" in store and "b" in store  # over budget while pinned
    assert "a" not in store and "b" in store  # released: the least recently used goes
    with store.pinned(["b"]):
        store.put("c", unit(3))  # only c can go
        assert "b" in store and "c" not in store


def test_throttled_tier_honours_its_bandwidth():
    store = KVStore(StoreConfig([TierConfig("host", 1 << 20, bandwidth=UNIT_BYTES / 2 / 0.05)]))  # a layer in 50 ms
    store.put("a", unit(1))
    k, v = torch.empty(2, 4, 8), torch.empty(2, 4, 8)
    t0 = time.perf_counter()
    store.read_layer("a", 0, 0, 4, k, v)
    assert time.perf_counter() - t0 >= 0.05


def test_read_layers_moves_several_units_in_one_transfer_at_the_links_bandwidth():
    """Each unit's slice lands in its own buffers, and the emulated link is waited out for the total."""
    store = KVStore(StoreConfig([TierConfig("host", 1 << 20, bandwidth=UNIT_BYTES / 2 / 0.05)]))  # a layer in 50 ms
    for i, name in enumerate("abc"):
        store.put(name, unit(i))
    outs = {name: (torch.empty(2, 3, 8), torch.empty(2, 3, 8)) for name in "abc"}
    t0 = time.perf_counter()
    moved = store.read_layers([LayerRead(name, 1, 4, *outs[name]) for name in "abc"], 1)
    assert time.perf_counter() - t0 >= 3 * 0.05 * 3 / 4  # three units' 3 of 4 tokens
    assert moved == 3 * 2 * outs["a"][0].numel() * 4
    for i, name in enumerate("abc"):
        torch.testing.assert_close(outs[name][0], unit(i).k[1, :, 1:4], rtol=0, atol=0)
        torch.testing.assert_close(outs[name][1], unit(i).v[1, :, 1:4], rtol=0, atol=0)
    assert store.stats()["host"].reads == 3


def test_bad_configs_name_the_problem():
    with pytest.raises(ValueError, match="does not fit any tier"):
        KVStore(StoreConfig([TierConfig("host", 10)])).put("a", unit(1))
    with pytest.raises(ValueError, match="needs `path`"):
        TierConfig("disk")
    with pytest.raises(ValueError, match="expected one of device, host, disk"):
        TierConfig("cloud")


def test_a_unit_read_is_the_most_recently_used():
    store = KVStore(StoreConfig([TierConfig("host", budget_bytes=3 * UNIT_BYTES)]))
    for i, key in enumerate("ABC"):
        store.put(key, unit(i))
    store.read_layer("A", 0, 0, 4, torch.empty(2, 4, 8), torch.empty(2, 4, 8))  # a prefill loads A
    store.put("D", unit(3))
    assert sorted(store.keys()) == ["A", "C", "D"]  # B, the least recently used, went


def test_a_disk_unit_is_written_beside_its_name_and_renamed_into_place(tmp_path, monkeypatch):
    import vla_runtime.memory.store as store_module

    store = KVStore(StoreConfig([TierConfig("disk", path=str(tmp_path))]))
    store.put("A", unit(0))
    assert sorted(p.name for p in tmp_path.glob("*.safetensors*")) == ["A.safetensors"]

    def killed(tensors, path):  # a kill while the file is written: a partial file under the temporary name
        open(path, "wb").write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(store_module, "save_file", killed)
    with pytest.raises(KeyboardInterrupt):
        store.put("B", unit(1))
    assert not (tmp_path / "B.safetensors").exists()  # never under the name a reader opens


def test_the_disk_tier_outlives_its_store_and_belongs_to_one_store_at_a_time(tmp_path, caplog):
    config = StoreConfig([TierConfig("host", UNIT_BYTES), TierConfig("disk", 3 * UNIT_BYTES, path=tmp_path)])
    with KVStore(config) as store:
        for name in "abc":
            store.put(name, unit(ord(name)))  # a, b move to disk
        with pytest.raises(ValueError, match=f"disk tier {tmp_path} is in use by another KV store"):
            KVStore(config)  # it would delete the files the first one reads
    (tmp_path / "x.safetensors.tmp").write_bytes(b"half a unit a kill left")
    (tmp_path / "junk.safetensors").write_bytes(b"not safetensors")
    with caplog.at_level("WARNING"), KVStore(config) as restarted:  # a restart keeps what was on disk
        assert sorted(restarted.keys()) == ["a", "b"] and restarted.stats()["disk"].bytes == 2 * UNIT_BYTES
        torch.testing.assert_close(restarted.get("b").v, unit(ord("b")).v, rtol=0, atol=0)
    assert "deleting junk.safetensors, which is not a unit's KV" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "a.safetensors", "b.safetensors"]
    # a smaller budget next time: the least recently written units go
    smaller = StoreConfig([TierConfig("host", UNIT_BYTES), TierConfig("disk", UNIT_BYTES, path=tmp_path)])
    with KVStore(smaller) as store:
        assert store.keys() == ["b"] and not (tmp_path / "a.safetensors").exists()
