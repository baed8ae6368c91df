"""Integer GGUF matmuls (kvbank/kernels/matmul.h): exact against a float64 reference of the same
quantized operands, bit-identical across instruction sets and batch sizes, and the fused layer
calls equal to the same steps done one by one."""

import os

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvbank import kernels
from kvbank.models.packed import INT4_TYPES, INT8_TYPES, Int4Blocks, Int8Blocks
from kvbank.models.qweights import KIND_Q4F, KIND_Q5, KIND_Q5F, KIND_Q8, KIND_Q8H, pack, unpack_q8_rows

native = kernels.native()
if native is None and os.environ.get("CI"):
    raise RuntimeError(f"CI must build the native kernels: {kernels.failure()}")
pytestmark = pytest.mark.skipif(native is None, reason=f"native kernels unavailable: {kernels.failure()}")
ISAS = ["scalar", "avx2", "avx512_vnni", "amx"]  # the matmul family's variants (kvbank/kernels/isa.h)


def _isas() -> list[str]:
    best = native.qmatmul_isa() if native else "scalar"
    return ISAS[: ISAS.index(best) + 1]


def _k_quant_bytes(type_name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant super-blocks (gguf-py cannot quantize them): random codes and sub-block
    scales, fp16 super-block scales of realistic size (sub-normal ones included)."""
    size = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}[type_name]
    raw = rng.integers(0, 256, size=(rows, cols // 256, size), dtype=np.uint8)
    scales = rng.uniform(1e-5, 3e-3, size=(rows, cols // 256, 2)) * rng.choice([1, 1e-3], size=(rows, cols // 256, 2))
    halves = scales.astype(np.float16).view(np.uint8).reshape(rows, cols // 256, 4)
    if type_name in ("Q4_K", "Q5_K"):
        raw[..., 0:4] = halves  # d, dmin
    else:
        raw[..., 208:210] = halves[..., 0:2]  # d
    return raw.reshape(rows, -1)


def _raw(type_name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """GGUF block bytes of random weights (gguf-py's quantizer; random K-quant super-blocks)."""
    rng = np.random.default_rng(seed)
    if type_name in ("Q4_K", "Q5_K", "Q6_K"):
        return _k_quant_bytes(type_name, rows, cols, rng)
    values = rng.standard_normal((rows, cols)).astype(np.float32)
    return gguf.quants.quantize(values, gguf.GGMLQuantizationType[type_name])


def _blocks(type_name: str, raw: np.ndarray, rows: int) -> Int4Blocks | Int8Blocks:
    if type_name in INT8_TYPES:
        return Int8Blocks.from_gguf(raw, rows, type_name)
    return Int4Blocks.from_gguf(raw, type_name, rows)


def _weights(type_name: str, rows: int, cols: int, seed: int):
    """(records, kind, dense float64 [rows, cols]) of random weights in `type_name`, packed."""
    raw = _raw(type_name, rows, cols, seed)
    dense = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])).double()
    return (*pack(_blocks(type_name, raw, rows)), dense)


def _quantized(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel sees it: 8-bit blocks of 32, scale amax / 127, rounded to nearest even."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.round(blocks * torch.where(scale != 0, 1 / scale, torch.zeros_like(scale)))
    assert q.abs().max() <= 127
    return (q.double() * scale.double()).reshape(x.shape)


TYPES = [*INT4_TYPES, *INT8_TYPES]


@pytest.mark.parametrize("type_name", TYPES)
def test_every_instruction_set_gives_the_exact_product_of_the_quantized_operands(type_name):
    cols = 512 if type_name.endswith("_K") else 224  # K-quants come in super-blocks of 256
    records, kind, dense = _weights(type_name, 48, cols, seed=1)
    # rows of very different scales; 37 of them: two whole tiles of 16 for amx, and 5 more
    x = torch.randn(37, cols) * torch.logspace(-3, 2, 37)[:, None]
    reference = _quantized(x) @ dense.T
    results = {isa: native.qlinear(x, records, kind, True, isa) for isa in _isas()}
    for isa, out in results.items():
        # Integer dot products are exact; only the float32 sums over the blocks (or half-blocks) round.
        torch.testing.assert_close(out.double(), reference, rtol=1e-5, atol=1e-5 * reference.abs().max().item())
        assert torch.equal(out, results["scalar"]), isa


@pytest.mark.parametrize("type_name", TYPES)
def test_blocks_hold_the_files_weights_to_the_bit(type_name):
    """Decoded blocks give gguf-py's dequantized values exactly, and pack into the kind that keeps
    their scales exact (float32 for Q4_K's and Q6_K's products of two scales)."""
    records, kind, dense = _weights(type_name, 32, 512, seed=12)
    kinds = {"Q4_0": 4, "Q4_1": 4, "Q4_K": KIND_Q4F, "Q5_1": KIND_Q5F, "Q5_K": KIND_Q5F}
    kinds |= {"Q8_0": KIND_Q8, "Q5_0": KIND_Q5, "Q6_K": KIND_Q8H}
    assert kind == kinds[type_name]
    blocks = _blocks(type_name, _raw(type_name, 32, 512, seed=12), 32)
    assert torch.equal(blocks.dequantize().double(), dense)


def test_q4_0_weights_fit_8_bit_blocks_exactly_and_q4_1_weights_do_not():
    rng = np.random.default_rng(13)
    raw = gguf.quants.quantize(rng.standard_normal((16, 256)).astype(np.float32), gguf.GGMLQuantizationType.Q4_0)
    four = Int4Blocks.from_gguf(raw, "Q4_0", 16)
    assert torch.equal(four.as_int8().dequantize(), four.dequantize())
    # Q4_0 weights as 5-bit records: the exact product, the same bits on every instruction set
    x = torch.randn(5, 256)
    records, kind = pack(four.as_int8())
    assert kind == KIND_Q5
    reference = _quantized(x) @ four.dequantize().double().T
    results = {isa: native.qlinear(x, records, kind, True, isa) for isa in _isas()}
    for isa, out in results.items():
        torch.testing.assert_close(out.double(), reference, rtol=1e-5, atol=1e-5 * reference.abs().max().item())
        assert torch.equal(out, results["scalar"]), isa
    raw1 = gguf.quants.quantize(rng.standard_normal((16, 256)).astype(np.float32), gguf.GGMLQuantizationType.Q4_1)
    assert Int4Blocks.from_gguf(raw1, "Q4_1", 16).as_int8() is None
    # a fused projection of a Q4_0 and a Q6_K tensor: one 8-bit form with scales per 16 inputs
    six = Int8Blocks.from_gguf(_k_quant_bytes("Q6_K", 16, 256, rng), 16, "Q6_K")
    mixed = Int8Blocks.cat([four.as_int8(), six])
    assert mixed.halves and mixed.scale.shape == (32, 16)
    assert torch.equal(mixed.dequantize(), torch.cat([four.dequantize(), six.dequantize()]))
    records, kind = pack(mixed)
    x = torch.randn(3, 256)
    assert kind == KIND_Q8H
    reference = _quantized(x) @ mixed.dequantize().double().T
    out = native.qlinear(x, records, kind, True).double()
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5 * reference.abs().max().item())


def test_the_8_bit_rounding_stays_close_to_the_float_product():
    records, kind, dense = _weights("Q4_1", 64, 576, seed=2)
    x = torch.randn(4, 576)
    exact = x.double() @ dense.T
    rel = (native.qlinear(x, records, kind, True).double() - exact).norm() / exact.norm()
    assert 1e-4 < rel < 0.01  # the activations really are rounded, by about what 8 bits cost


@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0", "Q4_K", "Q5_0", "Q5_K", "Q6_K"])
def test_a_row_gets_the_same_result_in_any_batch(type_name):
    records, kind, _ = _weights(type_name, 64, 256, seed=3)
    rows = torch.randn(40, 256, dtype=torch.bfloat16)
    alone = native.qlinear(rows[:1], records, kind)
    for count in (2, 3, 4, 5, 8, 16, 17, 32, 40):
        assert torch.equal(native.qlinear(rows[:count], records, kind)[:1], alone), count
        assert torch.equal(native.qlinear(rows[:count].flip(0), records, kind)[-1:], alone), count


def test_bfloat16_output_is_the_float32_result_rounded_once():
    records, kind, _ = _weights("Q4_0", 32, 96, seed=4)
    x = torch.randn(3, 96, dtype=torch.bfloat16)
    assert torch.equal(native.qlinear(x, records, kind), native.qlinear(x, records, kind, True).bfloat16())


def test_embedding_rows_come_out_of_the_head_records_exactly():
    records, _, dense = _weights("Q8_0", 64, 96, seed=5)
    ids = torch.tensor([0, 15, 16, 17, 63, 5])
    assert torch.equal(unpack_q8_rows(records, ids, torch.float32).double(), dense[ids])
    assert torch.equal(native.q8_rows(records, ids, torch.float32).double(), dense[ids])
    assert torch.equal(native.q8_rows(records, ids, torch.bfloat16), dense[ids].float().bfloat16())
    with pytest.raises(RuntimeError, match="token id 64 is outside the table's 64 rows"):
        native.q8_rows(records, torch.tensor([64]), torch.float32)


def test_bad_shapes_and_kinds_are_refused_with_the_numbers():
    records, kind, _ = _weights("Q4_1", 32, 64, seed=6)
    with pytest.raises(RuntimeError, match=r"x must be \[rows, 64\]"):
        native.qlinear(torch.randn(2, 96), records, kind)
    with pytest.raises(RuntimeError, match="kind must be 4"):
        native.qlinear(torch.randn(2, 64), records, 6)
    with pytest.raises(RuntimeError, match="packed weights must be contiguous uint8"):
        native.qlinear(torch.randn(2, 64), records, 8)
    with pytest.raises(RuntimeError, match="isa must be"):
        native.qlinear(torch.randn(2, 64), records, kind, True, "neon")


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x.float(), w.shape, w.float(), 1e-5)


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # The norm's and SiLU's float32 arithmetic may round an ulp apart from torch's, which can move
    # an 8-bit activation by one step: equal up to that.
    torch.testing.assert_close(actual.float(), expected.float(), rtol=0, atol=0.02 * expected.abs().max().item())


def test_fused_layer_calls_equal_their_steps_one_by_one():
    hidden, inter, heads, dim = 64, 96, 2, 16
    qkv, k4, _ = _weights("Q4_1", 3 * hidden // 2 + hidden // 2, hidden, seed=7)  # q 64 + k 32 + v 32 rows
    o, _, _ = _weights("Q4_0", hidden, hidden, seed=8)
    gate_up, _, _ = _weights("Q4_1", 2 * inter, hidden, seed=9)
    down, _, _ = _weights("Q4_1", hidden, inter, seed=10)
    rows = 5
    x = torch.randn(rows, hidden, dtype=torch.bfloat16)
    residual = torch.randn(rows, hidden, dtype=torch.bfloat16)
    norm1, norm2 = (torch.rand(hidden, dtype=torch.bfloat16) + 0.5 for _ in range(2))
    angles = torch.rand(rows, dim // 2) * 6
    cos = torch.cat([angles.cos()] * 2, -1).bfloat16()
    sin = torch.cat([-angles.sin(), angles.sin()], -1).bfloat16()

    res = residual.clone()
    fused_qkv = native.qlayer_attn_in(x, res, norm1, 1e-5, [qkv], [k4], cos, sin, heads + 2)
    expected_res = (x.float() + residual.float()).bfloat16()
    assert torch.equal(res, expected_res)
    step = native.qlinear(_rms(expected_res, norm1), qkv, k4, True).bfloat16()
    native.rope_(step, cos, sin, heads + 2)
    _close(fused_qkv, step)

    attn = torch.randn(rows, hidden, dtype=torch.bfloat16)
    res2 = res.clone()
    fused_out = native.qlayer_mlp(attn, res2, [o], [4], norm2, 1e-5, [gate_up], [4], [down], [4])
    projected = native.qlinear(attn, o, 4)
    after = (projected.float() + res.float()).bfloat16()
    assert torch.equal(res2, after)
    g, u = native.qlinear(_rms(after, norm2), gate_up, 4, True).bfloat16().chunk(2, dim=-1)
    h = F.silu(g) * u
    _close(fused_out, native.qlinear(h.float(), down, 4, True).bfloat16())


@pytest.mark.parametrize("type_name", ["Q6_K", "Q4_K", "Q5_0"])
def test_an_untied_head_of_any_kernel_type_runs_on_its_records(type_name):
    """Q4_K_M files untie the head as Q6_K (or Q4_K/Q5_K): it takes its own records, not bfloat16."""
    from tiny_models import tiny_config

    from kvbank.models.llama import LlamaForCausalLM
    from kvbank.models.qweights import QuantHead

    vocab, hidden = 64, 256
    model = LlamaForCausalLM(tiny_config(num_heads=4, head_dim=64, vocab_size=vocab, tie_word_embeddings=False))
    model.to(torch.bfloat16)
    blocks = _blocks(type_name, _raw(type_name, vocab, hidden, seed=40), vocab)
    int4, int8 = ({"lm_head.weight": blocks}, {}) if type_name in INT4_TYPES else ({}, {"lm_head.weight": blocks})
    model._pack_embeddings(int8, native, int4)
    assert isinstance(model.lm_head, QuantHead) and model.lm_head.kind == pack(blocks)[1]
    hidden_states = torch.randn(3, hidden, dtype=torch.bfloat16)
    logits = model.compute_logits(hidden_states)
    expected = native.qlinear(_rms(hidden_states, model.norm.weight), *pack(blocks), True)
    torch.testing.assert_close(logits, expected, rtol=0, atol=0.01 * expected.abs().max().item())


def test_the_head_is_the_final_norm_then_the_8_bit_matmul():
    head, _, _ = _weights("Q8_0", 80, 64, seed=11)
    hidden = torch.randn(3, 64, dtype=torch.bfloat16)
    norm = torch.rand(64, dtype=torch.bfloat16) + 0.5
    logits = native.qhead(hidden, norm, 1e-5, head, 8)
    assert logits.dtype == torch.float32
    # The norm's float32 sum runs in another order than torch's: an 8-bit rounding may differ.
    expected = native.qlinear(_rms(hidden, norm), head, 8, True)
    torch.testing.assert_close(logits, expected, rtol=0, atol=0.01 * expected.abs().max().item())


def test_a_fused_projection_of_types_with_no_common_record_runs_split_on_the_integer_kernels():
    """Q4_K_M files give q and k Q4_K and v Q6_K: no record holds all three exactly, so the fused
    q/k/v runs as one integer linear per tensor, side by side (was dense)."""
    from torch import nn

    from kvbank.models.llama import group_blocks, split_linear
    from kvbank.models.qweights import SplitLinear

    rows = {"q": 256, "k": 128, "v": 128}
    types = {"q": "Q4_K", "k": "Q4_K", "v": "Q6_K"}
    blocks = {n: _blocks(types[n], _raw(types[n], r, 256, seed=20 + i), r) for i, (n, r) in enumerate(rows.items())}
    int4 = [blocks[n] if types[n] in INT4_TYPES else None for n in rows]
    int8 = [blocks[n] if types[n] in INT8_TYPES else None for n in rows]
    assert group_blocks(int4, int8, native) is None
    dense = nn.Linear(256, 512, bias=False).bfloat16()
    split = split_linear(dense, int4, int8, native, None)
    assert isinstance(split, SplitLinear) and [p.kind for p in split.parts] == [KIND_Q4F, KIND_Q4F, KIND_Q8H]
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    weights = torch.cat([b.dequantize().double() for b in blocks.values()])
    reference = _quantized(x) @ weights.T
    out = split(x).double()
    torch.testing.assert_close(out, reference, rtol=2e-2, atol=1e-2 * reference.abs().max().item())  # bfloat16 out
    assert torch.equal(split(x[:1]), split(x)[:1])  # a row's bits do not depend on the batch


def test_fused_layer_calls_take_a_projection_split_in_segments_of_different_kinds():
    """q/k/v as Q5_1 q and k with a Q8_0 v (no common record): the fused call runs the segments
    side by side and equals the one-by-one steps, as for one segment."""
    hidden, heads, dim = 64, 2, 16
    q_rec, q_kind, _ = _weights("Q5_1", hidden, hidden, seed=30)
    k_rec, k_kind, _ = _weights("Q5_1", hidden // 2, hidden, seed=31)
    v_rec, v_kind, _ = _weights("Q8_0", hidden // 2, hidden, seed=32)
    assert (q_kind, v_kind) == (KIND_Q5F, KIND_Q8)
    rows = 3
    x = torch.randn(rows, hidden, dtype=torch.bfloat16)
    norm = torch.rand(hidden, dtype=torch.bfloat16) + 0.5
    angles = torch.rand(rows, dim // 2) * 6
    cos = torch.cat([angles.cos()] * 2, -1).bfloat16()
    sin = torch.cat([-angles.sin(), angles.sin()], -1).bfloat16()
    records, kinds = [q_rec, k_rec, v_rec], [q_kind, k_kind, v_kind]
    fused = native.qlayer_attn_in(x, None, norm, 1e-5, records, kinds, cos, sin, heads + 2)
    normed = _rms(x, norm)
    step = torch.cat([native.qlinear(normed, r, k, True) for r, k in zip(records, kinds)], -1).bfloat16()
    native.rope_(step, cos, sin, heads + 2)
    _close(fused, step)
    with pytest.raises(RuntimeError, match="one kind per records tensor"):
        native.qlayer_attn_in(x, None, norm, 1e-5, [q_rec, k_rec], [q_kind], cos, sin, heads + 2)
