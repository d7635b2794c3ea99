"""``RopeTable``: rows computed once (or grown by doubling, ``grow=True``) equal ``rope_cos_sin`` of the positions asked
for, bit for bit (the caches' rotations come from it, and OpenVLA's parity with upstream is bit-exact)."""

import pytest
import torch

from vla_runtime.kv.rope import RopeConfig, rope_cos_sin
from vla_runtime.kv.rope import RopeTable


@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_spans_equal_the_positions_computed_alone_while_the_table_grows(head_dim: int) -> None:
    cfg = RopeConfig(head_dim=head_dim, theta=10000.0)
    table = RopeTable(cfg, size=5000, device="cpu", grow=True)
    start = 0
    for t in (5, 1, 1, 300, 7, 1, 900, 33, 1, 2500, 1):  # crosses 256, 512, 1024, 2048 and the size's cap
        cos, sin = table.span(start, start + t)
        want_cos, want_sin = rope_cos_sin(torch.arange(start, start + t), cfg)
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin), (start, t)
        assert cos._base is None and cos.storage_offset() == 0  # fresh tensors, not views into the table
        start += t
    assert table._cos.shape[0] < 5000
    assert table.get(5000)[0].shape == (5000, head_dim) and table._cos.shape[0] == 5000  # grown to the size, not past


def test_the_table_holds_about_what_was_asked_for() -> None:
    table = RopeTable(RopeConfig(head_dim=64, theta=10000.0), size=32768, device="cpu", grow=True)
    for end in range(300, 400):  # a prefill, then decodes
        table.span(end - 1 if end > 300 else 0, end)
    assert 400 <= table._cos.shape[0] <= 800  # not the 32k positions the model could reach


def test_dynamic_scaling_is_computed_for_each_request() -> None:
    cfg = RopeConfig(head_dim=64, theta=10000.0, rope_type="dynamic", factor=2.0, original_max_position=64)
    table = RopeTable(cfg, size=1000, device="cpu", grow=True)
    short, long = table.span(10, 20)[0], table.span(10, 200)[0][:10]
    assert torch.equal(short, rope_cos_sin(torch.arange(10, 20), cfg)[0])
    assert not torch.equal(short, long)  # past the original length the base rescales with it


def test_a_table_that_does_not_grow_hands_out_slices_of_one_tensor() -> None:
    """What a compiled forward reads (``get``) stays a view of the same base tensor at every length: a base replaced
    by a larger one is a new graph input (``test_a_compiled_session_whose_keys_pass_256_positions_compiles_nothing``)."""
    cfg = RopeConfig(head_dim=32, theta=10000.0)
    table = RopeTable(cfg, size=2000, device="cpu")
    bases = {table.get(n)[0]._base.data_ptr() for n in (10, 255, 257, 600, 2000)}
    assert len(bases) == 1 and table._cos.shape[0] == 2000
    assert torch.equal(table.get(700)[1], rope_cos_sin(torch.arange(700), cfg)[1])
