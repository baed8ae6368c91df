"""4-bit GGUF weights: exact decoding of the blocks, and the int4 matmul path against dense."""

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvbank.models.packed import Int4Blocks, PackedLinear, packed_matmul_available


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1"])
def test_blocks_decode_exactly_like_gguf(type_name):
    kind = gguf.GGMLQuantizationType[type_name]
    weights = np.random.default_rng(0).standard_normal((24, 96)).astype(np.float32)
    raw = gguf.quants.quantize(weights, kind)
    dense = torch.from_numpy(gguf.quants.dequantize(raw, kind))
    blocks = Int4Blocks.from_gguf(raw, type_name, rows=24)
    rebuilt = (blocks.q.float() - 8).reshape(24, -1, 32) * blocks.scale[..., None] + blocks.zero[..., None]
    assert torch.equal(rebuilt.reshape(24, 96), dense)


@pytest.mark.skipif(not packed_matmul_available(torch.device("cpu")), reason="this torch has no CPU int4 matmul")
def test_packed_linear_matches_dense_and_switches_by_batch_size():
    kind = gguf.GGMLQuantizationType.Q4_1
    weights = np.random.default_rng(1).standard_normal((64, 128)).astype(np.float32)
    raw = gguf.quants.quantize(weights, kind)
    dense = torch.from_numpy(gguf.quants.dequantize(raw, kind)).bfloat16()
    layer = PackedLinear(dense, None, Int4Blocks.from_gguf(raw, "Q4_1", rows=64), max_rows=4)
    small, large = torch.randn(3, 128, dtype=torch.bfloat16), torch.randn(9, 128, dtype=torch.bfloat16)
    torch.testing.assert_close(layer(small).float(), F.linear(small, dense).float(), atol=0.15, rtol=0.02)
    assert torch.equal(layer(large), F.linear(large, dense))


@pytest.mark.skipif(not packed_matmul_available(torch.device("cpu")), reason="this torch has no CPU int4 matmul")
def test_packed_linear_without_a_row_limit_gives_a_row_the_same_result_in_any_batch():
    kind = gguf.GGMLQuantizationType.Q4_1
    weights = np.random.default_rng(2).standard_normal((64, 128)).astype(np.float32)
    raw = gguf.quants.quantize(weights, kind)
    dense = torch.from_numpy(gguf.quants.dequantize(raw, kind)).bfloat16()
    layer = PackedLinear(dense, None, Int4Blocks.from_gguf(raw, "Q4_1", rows=64), max_rows=None)
    rows = torch.randn(300, 128, dtype=torch.bfloat16)
    alone = layer(rows[:1])
    assert not torch.equal(alone, F.linear(rows[:1], dense))  # the 4-bit path, not the dense one
    for count in (2, 8, 9, 64, 300):
        assert torch.equal(layer(rows[:count])[:1], alone), count
        assert torch.equal(layer(rows[:count].flip(0))[-1:], alone), count
