"""The native kernel that attends a quantized KV cache in place (kvbank/kernels/quant_attention.cpp),
against the reference: the codecs' own dequantization and plain attention, over many shapes; and
through the engine, against the PyTorch reference path, for every quantized KV dtype."""

import itertools
from pathlib import Path

import pytest
import torch
from conftest import cpu_levels

from kvbank import LLM, SamplingParams, kernels
from kvbank.attention import quantized
from kvbank.attention.fast import DECODE_PARTITION
from kvbank.attention.quantized import NATIVE_CODECS, native_formats
from kvbank.attention.rope import apply_rope, rotation_tables
from kvbank.cache.layers import kivi, token
from kvbank.cache.quant import codecs_for

TEXT = (Path(__file__).parent / "data" / "austen_excerpt.txt").read_text()
QUANTIZED = list(NATIVE_CODECS)


@pytest.fixture(scope="module")
def kernel(native):
    assert native.has_quant_decode(), "every x86 CPU runs the quantized attention (its scalar variant at the least)"
    return native


def _format(name):
    """The native kernels' id of KV format `name`."""
    return native_formats(kernels.native())[name]


def test_the_module_numbers_every_format_python_hands_it(kernel):
    formats = native_formats(kernel)
    assert set(formats) == {"dense", *NATIVE_CODECS}
    assert len(set(formats.values())) == len(formats), formats


def _reference(q, keys, values, lens, scale):
    """q [n, kv_heads, group, dim]; keys/values [n, tokens, kv_heads, dim]: float64 attention."""
    out = []
    for i, n in enumerate(lens):
        scores = torch.einsum("hgd,thd->hgt", q[i].double(), keys[i, :n].double()) * scale
        out.append(torch.einsum("hgt,thd->hgd", scores.softmax(-1), values[i, :n].double()))
    return torch.stack(out)


def _stored_args(k, v):
    """A quantized layer's stored tensors in the kernels' argument order: key codes, key scales
    (int4/int2: range bytes), key grids, value codes, value scales, value zero points."""
    return (k["codes"], k.get("ranges", k.get("scale")), k.get("grid"), v["codes"], v["scale"], v.get("zero"))


def _case(kernel, kv, dim, block, group, dtype, value_group, lens, scratch, seed, isas):
    """One random pool and query, attended by the kernel at each of `isas`: ({isa: out}, the float64
    reference, and the same over the values' magnitudes)."""
    generator = torch.Generator().manual_seed(seed)
    kv_heads, n = 2, len(lens)
    width = -(-max(lens) // block)
    blocks = n * width + 3
    key_codec, value_codec = codecs_for(kv, dtype, value_group)
    keys = torch.randn(blocks, block, kv_heads, dim, generator=generator) * 2
    keys[..., 5] += 6  # an outlier channel, as real keys have
    values = torch.randn(blocks, block, kv_heads, dim, generator=generator)
    k_stored, v_stored = key_codec.quantize(keys), value_codec.quantize(values)
    k_read, v_read = key_codec.dequantize(k_stored, torch.float32), value_codec.dequantize(v_stored, torch.float32)
    order = torch.randperm(blocks, generator=generator)  # a sequence's blocks lie anywhere
    tables = order[: n * width].view(n, width)
    q = torch.randn(n, kv_heads, group, dim, generator=generator).to(dtype)
    seen_k = k_read[tables].reshape(n, -1, kv_heads, dim).clone()
    seen_v = v_read[tables].reshape(n, -1, kv_heads, dim).clone()
    # int4/int2: each key's distance from its channel's minimum, the part the query is folded into
    folded = torch.zeros_like(seen_k)
    if "grid" in k_stored:
        low = key_codec.ranges(k_stored)[1]
        folded = (k_read - low.unsqueeze(1))[tables].reshape(n, -1, kv_heads, dim).clone()
    extra = {}
    if scratch:
        # each row's own block is read from the step's full-precision scratch rows
        rows = n + 1
        scratch_k = torch.randn(rows, block, kv_heads, dim, generator=generator).to(dtype)
        scratch_v = torch.randn(rows, block, kv_heads, dim, generator=generator).to(dtype)
        own = torch.randperm(rows, generator=generator)[:n]
        for i, length in enumerate(lens):
            j = (length - 1) // block
            seen_k[i, j * block : (j + 1) * block] = scratch_k[own[i]].float()
            seen_v[i, j * block : (j + 1) * block] = scratch_v[own[i]].float()
            folded[i, j * block : (j + 1) * block] = 0  # read in full precision: no folded query
        extra = {"scratch_k": scratch_k, "scratch_v": scratch_v, "own_rows": own}
    outs = {}
    for isa in isas:
        kernel.poison_stacks()  # scratch the kernel reads without writing would be NaN, not old finite values
        outs[isa] = kernel.quant_decode_attention(
            q,
            _format(kv),
            *_stored_args(k_stored, v_stored),
            tables,
            torch.tensor(lens),
            0.125,
            DECODE_PARTITION,
            **extra,
            isa=isa,
        )
    # The largest error a folded query rounded to bfloat16 (2^-9 of each channel's product) puts
    # in a score, per row and query head: the weights' relative error is at most twice that.
    key_rounding = torch.zeros(n, kv_heads, group, 1, dtype=torch.float64)
    for i, length in enumerate(lens):
        products = torch.einsum("hgd,thd->hgt", q[i].double().abs(), folded[i, :length].double().abs())
        key_rounding[i] = products.amax(dim=-1, keepdim=True) * 0.125 * 2**-9
    # and the weighted sum of the values' magnitudes, the scale of the error of weights rounded
    expected = _reference(q, seen_k, seen_v, lens, 0.125)
    return outs, expected, _reference(q, seen_k, seen_v.abs(), lens, 0.125), key_rounding


def _rounding_allowed(isa, kv, dtype, magnitude, key_rounding):
    """What the avx512_bf16 variant may differ by beyond float32 sums, for bfloat16 queries: its
    weights (times the value scales) meet the values as bfloat16, each rounded by at most 2^-8 of
    itself (int8, fp8, int4); int4's block-folded query is rounded to bfloat16, which moves each
    score by at most key_rounding and so each weight by at most twice that, relatively."""
    if isa != "avx512_bf16" or dtype != torch.bfloat16 or kv == "int2":
        return 0
    allowed = magnitude * 2**-8
    if kv == "int4":
        allowed = allowed + magnitude * 2.2 * key_rounding
    return allowed


@pytest.mark.parametrize("kv", QUANTIZED)
def test_native_quantized_attention_matches_the_reference_over_shapes(kernel, kv):
    kivi = kv in ("int4", "int2")
    # contexts across partition boundaries (DECODE_PARTITION = 256) and within one block
    lens = [1, 7, DECODE_PARTITION - 1, DECODE_PARTITION, DECODE_PARTITION + 1, 2 * DECODE_PARTITION + 37]
    shapes = itertools.product(
        (64, 128),  # head dim
        (8, 16, 32),  # block size
        (1, 3),  # query heads per KV head
        (torch.float32, torch.bfloat16),
        # value group size (None: per-token scales) and residual (scratch) blocks present
        ((64, True), (64, False), (32, True), (16, False)) if kivi else ((None, False),),
    )
    # every version of the kernel this CPU runs (scalar; 8 lanes; 16; 16 with int8/fp8 keys by tables)
    # (up to the active level: KVBANK_ISA=scalar leaves the scalar one alone)
    isas = kernel.quant_decode_isas()
    assert isas[:2] == (["scalar"] if kernel.isa_report()["active"] == "scalar" else ["scalar", "avx2"])
    for seed, (dim, block, group, dtype, (value_group, scratch)) in enumerate(shapes):
        outs, expected, magnitude, key_rounding = _case(
            kernel, kv, dim, block, group, dtype, value_group or 32, lens, scratch, seed, isas
        )
        for isa, out in outs.items():
            err = (out.double() - expected).abs()
            # float32 sums over hundreds of tokens (a few units in the last place of the row's largest
            # value), and for bfloat16 out the output's own rounding
            largest = expected.abs().amax(dim=-1, keepdim=True)
            bound = expected.abs() * (0 if dtype == torch.float32 else 2**-8) + largest * 1e-5
            bound += _rounding_allowed(isa, kv, dtype, magnitude, key_rounding)
            assert (err <= bound).all(), (isa, dim, block, group, dtype, value_group, scratch, err.max().item())


@pytest.mark.parametrize("kv", QUANTIZED)
def test_every_vector_variant_agrees_with_the_scalar_reference(kernel, kv):
    # The scalar variant is plain C++ over one token at a time; the vector variants decode the same
    # codes and differ from it only in the order of their float32 sums (and, for avx512_bf16's
    # int8/fp8/int4 codes, bfloat16 weights and int4's bfloat16 folded query: _rounding_allowed).
    kivi = kv in ("int4", "int2")
    lens = [3, DECODE_PARTITION + 5, 2 * DECODE_PARTITION + 37]
    for seed, (dim, group, dtype) in enumerate(itertools.product((64, 128), (1, 3), (torch.float32, torch.bfloat16))):
        outs, expected, magnitude, key_rounding = _case(
            kernel, kv, dim, 16, group, dtype, 32, lens, kivi, seed, kernel.quant_decode_isas()
        )
        scalar = outs.pop("scalar")
        largest = expected.abs().amax(dim=-1, keepdim=True)
        for isa, out in outs.items():
            assert not torch.equal(out, torch.zeros_like(out))
            bound = largest * 2e-5 + scalar.double().abs() * (0 if dtype == torch.float32 else 2**-7)
            bound += _rounding_allowed(isa, kv, dtype, magnitude, key_rounding)
            err = (out.double() - scalar.double()).abs()
            assert (err <= bound).all(), (isa, kv, dim, group, dtype, err.max().item())


def test_bad_arguments_are_refused_with_the_numbers(kernel):
    key_codec, value_codec = codecs_for("int8", torch.float32)
    stored_k = key_codec.quantize(torch.randn(4, 16, 2, 64))
    stored_v = value_codec.quantize(torch.randn(4, 16, 2, 64))
    q = torch.randn(1, 2, 3, 64)
    args = _stored_args(stored_k, stored_v)
    tables, lens = torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="isa must be auto, scalar, avx2, avx512 or avx512_bf16, got avx9"):
        kernel.quant_decode_attention(q, 1, *args, tables, lens, 0.125, DECODE_PARTITION, isa="avx9")
    with pytest.raises(RuntimeError, match="unknown quantized KV format 9"):
        kernel.quant_decode_attention(q, 9, *args, tables, lens, 0.125, DECODE_PARTITION)
    with pytest.raises(RuntimeError, match="q has 3 KV heads, the cache 2"):
        kernel.quant_decode_attention(torch.randn(1, 3, 3, 64), 1, *args, tables, lens, 0.125, DECODE_PARTITION)
    with pytest.raises(RuntimeError, match="codes have 64 bytes per head, expected 32"):
        kernel.quant_decode_attention(q, 4, *args, tables, lens, 0.125, DECODE_PARTITION)  # int8 codes read as int4
    with pytest.raises(RuntimeError, match="row 0: block 4 is outside the cache's 4 blocks"):
        kernel.quant_decode_attention(q, 1, *args, tables + 4, lens, 0.125, DECODE_PARTITION)
    with pytest.raises(RuntimeError, match="row 0: context length 17 is beyond its block table"):
        kernel.quant_decode_attention(q, 1, *args, tables, lens * 17, 0.125, DECODE_PARTITION)
    key_codec, value_codec = codecs_for("int4", torch.float32)
    stored_k = key_codec.quantize(torch.randn(4, 16, 2, 64))
    stored_v = value_codec.quantize(torch.randn(4, 16, 2, 64))
    args = list(_stored_args(stored_k, stored_v))
    args[2] = None  # no key grids
    with pytest.raises(RuntimeError, match="int4/int2 need key grids and value zero points"):
        kernel.quant_decode_attention(q, 4, *args, tables, lens, 0.125, DECODE_PARTITION)
    args = _stored_args(stored_k, stored_v)
    with pytest.raises(RuntimeError, match=r"key ranges must be uint8 \[blocks, heads, dim\]"):
        kernel.quant_decode_attention(q, 4, args[0], args[2], *args[2:], tables, lens, 0.125, DECODE_PARTITION)


PER_TOKEN = ["int8", "fp8_e4m3", "fp8_e5m2"]


def _write_inputs(dtype, dim, seed):
    # magnitudes from 1e-8 to 1e4 (fp8 subnormal codes included), zeros, a row of one outlier
    # beside tiny values, and exact ties between neighbouring codes (rounding must go to even)
    torch.manual_seed(seed)
    n, heads = 200, 3
    x = torch.randn(n, heads, dim) * torch.logspace(-8, 4, n).view(n, 1, 1)
    x[0] = 0
    x[1, :, 0], x[1, :, 1:] = 1e3, torch.randn(heads, dim - 1) * 1e-3
    ties = torch.tensor([0.5, 1.5, 2.5, -2.5, 1.0625, 1.1875, 3.25, 0.0078125 * 1.5, 0.001953125 * 0.5])
    x[2, :, :] = ties.repeat(dim // len(ties) + 1)[:dim]
    x[2, :, -1] = 448.0  # a scale of exactly 1 for e4m3, so the ties above reach the rounding as they are
    x[3, :, :] = ties.repeat(dim // len(ties) + 1)[:dim]
    x[3, :, -1] = 127.0
    return x.to(dtype)


@pytest.mark.parametrize("isa_level", cpu_levels()[:2], indirect=True)  # the scalar variant and avx2
@pytest.mark.parametrize("kv", PER_TOKEN)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_native_writes_equal_the_codec_bit_for_bit(kernel, kv, dtype, isa_level):
    codec = codecs_for(kv, dtype)[0]
    for dim, seed in ((64, 0), (128, 1), (16, 2)):
        x = _write_inputs(dtype, dim, seed)
        blocks, block = 30, 16
        # rows strided as the fused projection leaves them (k is a view into q|k|v)
        fused = torch.zeros(x.shape[0], 5 * x.shape[1] * dim, dtype=dtype)
        strided = fused[:, dim : dim + x.shape[1] * dim].view_as(x)
        strided.copy_(x)
        slots = torch.randperm(blocks * block)[: x.shape[0]]
        component = codec.components(block, x.shape[1], dim)
        codes = torch.full((blocks, *component["codes"][0]), 77, dtype=component["codes"][1])
        scale = torch.zeros(blocks, *component["scale"][0], dtype=torch.float16)
        kernel.quant_write_tokens(strided, _format(kv), codes, scale, slots)
        expected = codec.quantize(x)
        assert torch.equal(codes.view(-1, *codes.shape[2:])[slots], expected["codes"]), (kv, dtype, dim)
        got_scale = scale.view(-1, x.shape[1])[slots]
        assert torch.equal(got_scale.view(torch.int16), expected["scale"].view(torch.int16)), (kv, dtype, dim)
        untouched = torch.ones(blocks * block, dtype=torch.bool)
        untouched[slots] = False
        assert (codes.view(blocks * block, -1)[untouched] == 77).all(), "a slot not written was changed"


def test_bad_write_arguments_are_refused_with_the_numbers(kernel):
    codes = torch.zeros(4, 16, 2, 64, dtype=torch.int8)
    scale = torch.zeros(4, 16, 2, dtype=torch.float16)
    x = torch.randn(3, 2, 64)
    with pytest.raises(RuntimeError, match="slot 64 is outside the cache's 64 slots"):
        kernel.quant_write_tokens(x, 1, codes, scale, torch.tensor([0, 64, 1]))
    with pytest.raises(RuntimeError, match="got format 4"):
        kernel.quant_write_tokens(x, 4, codes, scale, torch.tensor([0, 1, 2]))
    with pytest.raises(RuntimeError, match=r"slots must be int64 \[3\]"):
        kernel.quant_write_tokens(x, 1, codes, scale, torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="codes must be one byte each"):
        kernel.quant_write_tokens(torch.randn(3, 3, 64), 1, codes, scale, torch.tensor([0, 1, 2]))


@pytest.mark.parametrize("kv", PER_TOKEN)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_code_is_read_as_the_codec_reads_it(kernel, kv, dtype):
    # One token per row, a zero query: each row's output is its token's values exactly. The
    # values' codes enumerate every byte the format can hold (fp8's NaN codes aside), in every
    # channel position; keys hold them too, read by the same decoding.
    dim, heads, block = 64, 2, 16
    codes = torch.arange(256, dtype=torch.int16)
    if kv == "int8":
        codes = codes[(codes - 128).abs() <= 127] - 128
    elif kv == "fp8_e4m3":
        codes = codes[(codes & 0x7F) != 0x7F]
    else:
        codes = codes[(codes & 0x7C) != 0x7C]  # no infinities or NaN either
    n = -(-codes.numel() // dim) * 2
    flat = codes.repeat(n * heads * dim // codes.numel() + 1)[: n * heads * dim]
    stored = {
        "codes": flat.to(torch.int8 if kv == "int8" else torch.uint8).view(n, 1, heads, dim),
        "scale": torch.full((n, 1, heads), 0.75, dtype=torch.float16),
    }
    stored = {name: torch.cat((t, t.new_zeros(n, block - 1, *t.shape[2:])), dim=1) for name, t in stored.items()}
    codec = codecs_for(kv, dtype)[1]
    values = codec.dequantize({k: v[:, :1] for k, v in stored.items()}, torch.float32)[:, 0]
    q = torch.zeros(n, heads, 3, dim, dtype=dtype)
    tables = torch.arange(n).view(n, 1)
    for isa in kernel.quant_decode_isas():
        out = kernel.quant_decode_attention(
            q,
            _format(kv),
            stored["codes"],
            stored["scale"],
            None,
            stored["codes"],
            stored["scale"],
            None,
            tables,
            torch.ones(n, dtype=torch.long),
            0.125,
            DECODE_PARTITION,
            isa=isa,
        )
        expected = values.unsqueeze(2).expand(n, heads, 3, dim).to(dtype)
        assert torch.equal(out, expected), (isa, (out.float() - expected.float()).abs().max())


@pytest.mark.parametrize("kv", ["bfloat16", "int8", "fp8_e4m3"])
def test_a_prefills_rows_attended_together_keep_each_rows_bits_alone(kernel, kv):
    # A prefill's rows read the same blocks, and the AVX2 version attends up to 8 of them per block
    # it decodes (quant_rows in quant_attention.cpp). Each row must get its bits alone, whatever shares
    # its tile: rows of one sequence across a partition boundary, a row of another sequence among
    # them, rows that start later (a window), and on every version the CPU has.
    generator = torch.Generator().manual_seed(7)
    blocks, block, kv_heads, group, dim = 40, 16, 3, 3, 64
    keys = torch.randn(blocks, block, kv_heads, dim, generator=generator) * 2
    values = torch.randn(blocks, block, kv_heads, dim, generator=generator)
    if kv == "bfloat16":
        none = torch.empty(0, dtype=torch.float16)
        args, format_ = (keys.bfloat16(), none, None, values.bfloat16(), none, None), 0
    else:
        key_codec, value_codec = codecs_for(kv, torch.float32)
        args, format_ = _stored_args(key_codec.quantize(keys), value_codec.quantize(values)), _format(kv)
    order = torch.randperm(blocks, generator=generator)
    sequence, other = order[:20], order[20:]
    lens = [*range(250, 270), 300, *range(270, 290)]
    tables = torch.stack([sequence] * 20 + [other] + [sequence] * 20)
    starts = torch.tensor([0] * 30 + [100] * 5 + [0] * 6)
    q = torch.randn(len(lens), kv_heads, group, dim, generator=generator).bfloat16()
    for isa in kernel.quant_decode_isas():
        together = kernel.quant_decode_attention(
            q, format_, *args, tables, torch.tensor(lens), 0.125, DECODE_PARTITION, isa=isa, starts=starts
        )
        for i in range(len(lens)):
            alone = kernel.quant_decode_attention(
                q[i : i + 1], format_, *args, tables[i : i + 1], torch.tensor(lens[i : i + 1]), 0.125,
                DECODE_PARTITION, isa=isa, starts=starts[i : i + 1],
            )  # fmt: skip
            assert torch.equal(alone, together[i : i + 1]), (isa, i)


def _kivi_pool(kv, dtype, blocks, block, heads, dim, group):
    key_codec, value_codec = codecs_for(kv, dtype, group)
    sides = [
        {
            name: torch.zeros(blocks, *shape, dtype=cdtype)
            for name, (shape, cdtype) in codec.components(block, heads, dim).items()
        }
        for codec in (key_codec, value_codec)
    ]
    residual = torch.zeros(2, 4, block, heads, dim, dtype=dtype)
    return (key_codec, value_codec), sides, residual


def _kivi_write(kernel, kv, k, v, sides, residual, plan, slots):
    ks, vs = sides
    kernel.poison_stacks()  # scratch the kernel reads without writing would be NaN
    return kernel.kivi_write(
        k,
        v,
        _format(kv),
        *_stored_args(ks, vs),
        residual[0],
        residual[1],
        # rows given as (block, slot, held, upto) are not read early
        torch.tensor([(*row, 0)[: kivi.PLAN_FIELDS] for row in plan]).view(-1, kivi.PLAN_FIELDS),
        torch.tensor(slots),
    )


def _same_bits(a, b):
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("isa_level", cpu_levels()[:2], indirect=True)  # the scalar variant and avx2
@pytest.mark.parametrize("kv", ["int4", "int2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_native_kivi_writes_equal_the_codec_bit_for_bit(kernel, kv, dtype, isa_level):
    # A prefill of whole blocks, then one open block filled over three steps through its
    # residual slot; every stored tensor equals the codecs' block quantization bit for bit.
    for dim, group, block, seed in ((64, 32, 16, 0), (128, 64, 16, 1), (64, 16, 32, 2), (128, 128, 64, 3)):
        generator = torch.Generator().manual_seed(seed)
        heads = 3
        codecs, sides, residual = _kivi_pool(kv, dtype, 10, block, heads, dim, group)
        k = torch.randn(5 * block, heads, dim, generator=generator) * torch.logspace(-4, 2, 5 * block).view(-1, 1, 1)
        k[:, :, 5] += 20  # an outlier channel
        k[:block, 1] = 0.5  # a constant head: the smallest scale
        v = torch.randn(5 * block, heads, dim, generator=generator).to(dtype)
        k = k.to(dtype)
        ids = [7, 2, 5, 0]
        scratch_k, scratch_v = _kivi_write(
            kernel,
            kv,
            k[: 4 * block],
            v[: 4 * block],
            sides,
            residual,
            [(b, -1, 0, block) for b in ids],
            list(range(4 * block)),
        )
        assert torch.equal(scratch_k.flatten(0, 1), k[: 4 * block]) and torch.equal(
            scratch_v.flatten(0, 1), v[: 4 * block]
        )
        tail = k[4 * block :], v[4 * block :]
        cuts = (0, 5, block // 2, block)
        for a, b in zip(cuts, cuts[1:]):
            plan = [(3, 1, a, b)]
            scratch_k, _ = _kivi_write(kernel, kv, tail[0][a:b], tail[1][a:b], sides, residual, plan, list(range(a, b)))
            assert torch.equal(scratch_k[0, :b], tail[0][:b]), "the scratch row holds the block's tokens so far"
            if b < block:
                assert torch.equal(residual[0, 1, :b], tail[0][:b]) and torch.equal(residual[1, 1, :b], tail[1][:b])
        blocks = [*ids, 3]
        expected = [codec.quantize(x.view(5, block, heads, dim)) for codec, x in zip(codecs, (k, v))]
        for side, want in zip(sides, expected):
            for name, tensor in side.items():
                assert _same_bits(tensor[blocks], want[name]), (kv, dtype, dim, group, block, name)


def test_the_pytorch_kivi_write_reads_its_moves_off_the_plans_table():
    # Rows: a block filled whole; an open block taking its first tokens; one taking more; one
    # filling up from its residual slot. Columns: block, residual slot, held before, held after, read early.
    table = torch.tensor([(7, -1, 0, 16, 0), (3, 1, 0, 5, 0), (4, 2, 5, 8, 0), (5, 0, 8, 16, 0)])
    moves = kivi.ResidualPlan(4, torch.arange(4), table, 16).moves
    pairs = [
        (moves.preload_rows, moves.preload_slots, [2, 3], [2, 0]),
        (moves.full_rows, moves.full_blocks, [0, 3], [7, 5]),
        (moves.keep_rows, moves.keep_slots, [1, 2], [1, 2]),
    ]
    for rows, other, want_rows, want_other in pairs:
        assert rows.tolist() == want_rows and other.tolist() == want_other
    assert kivi.ResidualPlan(1, torch.arange(1), table[:1], 16).moves.preload_rows is None


def test_bad_kivi_write_arguments_are_refused_with_the_numbers(kernel):
    _, sides, residual = _kivi_pool("int4", torch.float32, 4, 16, 2, 64, 32)
    k = v = torch.randn(3, 2, 64)
    with pytest.raises(RuntimeError, match="block 4 is outside the pool's 4 blocks"):
        _kivi_write(kernel, "int4", k, v, sides, residual, [(4, 0, 0, 3)], [0, 1, 2])
    with pytest.raises(RuntimeError, match="residual slot 9 is outside the 4 slots"):
        _kivi_write(kernel, "int4", k, v, sides, residual, [(1, 9, 0, 3)], [0, 1, 2])
    with pytest.raises(RuntimeError, match="tokens held 5 -> 3 do not fit a block of 16"):
        _kivi_write(kernel, "int4", k, v, sides, residual, [(1, 0, 5, 3)], [0, 1, 2])
    with pytest.raises(RuntimeError, match="only a block this step fills can be read early, got early 1 with 3 of 16"):
        _kivi_write(kernel, "int4", k, v, sides, residual, [(1, 0, 0, 3, 1)], [0, 1, 2])
    with pytest.raises(RuntimeError, match=r"the plan must be contiguous int64 \[rows, 5\], got \[1, 4\]"):
        kernel.kivi_write(
            k,
            v,
            _format("int4"),
            *_stored_args(*sides),
            residual[0],
            residual[1],
            torch.tensor([[1, 0, 0, 3]]),
            torch.tensor([0, 1, 2]),
        )
    with pytest.raises(RuntimeError, match="scratch slot 16 is outside the step's 16"):
        _kivi_write(kernel, "int4", k, v, sides, residual, [(1, 0, 0, 3)], [0, 1, 16])
    with pytest.raises(RuntimeError, match=r"got format 1"):
        _kivi_write(kernel, "int8", k, v, sides, residual, [(1, 0, 0, 3)], [0, 1, 2])


@pytest.mark.parametrize("isa_level", cpu_levels()[:2], indirect=True)  # the scalar variant and avx2
@pytest.mark.parametrize("kv", ["bfloat16", "int4", "int2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_native_key_rotation_equals_the_torch_rotation_bit_for_bit(kernel, kv, dtype, isa_level):
    # What a shifting policy does at every eviction (KVKind.rotate_keys): blocks dequantized,
    # rotated, rounded to the model dtype and quantized again, in every layer; the sources
    # overlap the destinations and one block is rotated in place.
    generator = torch.Generator().manual_seed(0)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    src, dst = torch.tensor([0, 3, 5, 7]), torch.tensor([3, 1, 5, 11])
    keys = [torch.randn(12, 16, 3, 64, generator=generator) * torch.logspace(-2, 1, 64) for _ in range(3)]
    if kv == "bfloat16":
        native = [k.to(dtype) for k in keys]
        torch_side = [k.clone() for k in native]
    else:
        codec = codecs_for(kv, dtype)[0]
        native = [codec.quantize(k.to(dtype)) for k in keys]
        torch_side = [{name: t.clone() for name, t in stored.items()} for stored in native]
    caches = (
        (native, _format("dense"), [], [])
        if kv == "bfloat16"
        else (
            [k["codes"] for k in native],
            _format(kv),
            [k["ranges"] for k in native],
            [k["grid"] for k in native],
        )
    )
    for delta in (16, -1008, 4096):
        cos, sin = (t[0] for t in rotation_tables(torch.tensor([delta]), inv_freq.float()))
        if kv == "bfloat16":
            for k in torch_side:
                k.index_copy_(0, dst, apply_rope(k.index_select(0, src).float(), cos, sin).to(dtype))
            kernel.rotate_key_blocks(*caches, src, dst, cos, sin, dtype == torch.bfloat16)
            assert all(_same_bits(a, b) for a, b in zip(native, torch_side)), (kv, dtype, delta)
            continue
        for stored in torch_side:
            picked = {name: t.index_select(0, src) for name, t in stored.items()}
            rotated = apply_rope(codec.dequantize(picked, torch.float32), cos, sin).to(dtype)
            for name, t in codec.quantize(rotated).items():
                stored[name].index_copy_(0, dst, t)
        kernel.rotate_key_blocks(*caches, src, dst, cos, sin, dtype == torch.bfloat16)
        for a, b in zip(native, torch_side):
            assert all(_same_bits(a[name], b[name]) for name in a), (kv, dtype, delta)
    with pytest.raises(RuntimeError, match="block 12 is outside the pool's 12 blocks"):
        kernel.rotate_key_blocks(*caches, src, torch.tensor([3, 1, 5, 12]), cos, sin, dtype == torch.bfloat16)


@pytest.mark.parametrize("isa_level", cpu_levels()[:2], indirect=True)  # the scalar variant and avx2
@pytest.mark.parametrize("kv", ["int4", "int2"])
def test_native_key_blocks_read_and_store_as_the_codec_does(kernel, kv, isa_level):
    # What a stream's edits do to KIVI keys (KiviKind.move_tokens): whole blocks read in float32,
    # changed, and quantized again.
    generator = torch.Generator().manual_seed(1)
    codec = codecs_for(kv, torch.bfloat16)[0]
    keys = [torch.randn(9, 16, 3, 64, generator=generator) * torch.logspace(-2, 1, 64) for _ in range(3)]
    stored = [codec.quantize(k.bfloat16()) for k in keys]
    caches = (
        [k["codes"] for k in stored],
        _format(kv),
        [k["ranges"] for k in stored],
        [k["grid"] for k in stored],
    )
    ids = torch.tensor([4, 0, 8])
    read = kernel.read_key_blocks(*caches, ids, True)
    for layer, k in enumerate(stored):
        want = codec.dequantize({name: t.index_select(0, ids) for name, t in k.items()}, torch.float32)
        assert _same_bits(read[layer], want)
    changed = read + torch.randn(read.shape, generator=generator)
    to = torch.tensor([1, 2, 8])
    kernel.store_key_blocks(changed, *caches, to)
    for layer, k in enumerate(stored):
        want = codec.quantize(changed[layer])
        assert all(_same_bits(k[name].index_select(0, to), want[name]) for name in k), layer
    with pytest.raises(RuntimeError, match="a block id appears twice"):
        kernel.store_key_blocks(changed, *caches, torch.tensor([1, 2, 1]))
    with pytest.raises(RuntimeError, match="block 9 is outside the pool's 9 blocks"):
        kernel.read_key_blocks(*caches, torch.tensor([9]), True)
    with pytest.raises(RuntimeError, match=r"keys must be float32 \[3, 3, 16, 3, 64\]"):
        kernel.store_key_blocks(changed.bfloat16(), *caches, to)


def test_native_row_copies_read_every_source_before_writing(kernel):
    # A stream's edit moves value codes over slots it also frees (KiviKind/DenseKind.move_tokens).
    tensors = [torch.arange(48, dtype=torch.uint8).view(12, 2, 2), torch.randn(10, 3).bfloat16()]
    want = [t.clone() for t in tensors]
    src, dst = torch.tensor([0, 1, 2, 7]), torch.tensor([1, 2, 3, 0])
    for t in want:
        t.index_copy_(0, dst, t.index_select(0, src))
    kernel.copy_rows(tensors, src, dst)
    assert all(_same_bits(a, b) for a, b in zip(tensors, want))
    with pytest.raises(RuntimeError, match="tensor 1: row 10 is outside its 10 rows"):
        kernel.copy_rows(tensors, src, torch.tensor([1, 2, 3, 10]))


def _prompt_logprobs(llm: LLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=0))
    return [
        torch.tensor([step[token].logprob for step, token in zip(out.prompt_logprobs[1:], prompt[1:])])
        for out, prompt in zip(outs, prompts)
    ]


def _engine(kv: str, batch_invariant: bool, dtype: str = "float32") -> LLM:
    # prompts longer than the step's token budget (chunked prefill), decodes beside them
    return LLM(
        dtype=dtype,
        kv_cache_dtype=kv,
        num_gpu_blocks=96,
        max_num_batched_tokens=64,
        enable_prefix_caching=False,
        batch_invariant=batch_invariant,
    )


def _rows_of_step(q, meta, view, block_size):
    """Every new token of a step as a row for the native kernel, derived from the reference
    path's view of the step: block table, context length and (int4/int2) its own scratch row."""
    tables, lens, own = [], [], []
    widths = [len(c.block_table) for c in meta.prefills]
    if meta.num_decode_tokens:
        widths.append(meta.decode_block_tables.shape[1])
    width = max(widths)

    def table_of(t):
        return torch.cat((t, t.new_zeros(width - len(t))))

    for i in range(meta.num_decode_tokens):
        tables.append(table_of(meta.decode_block_tables[i]))
        lens.append(int(meta.decode_context_lens[i]))
        own.append(int(view.own_rows[i]) if view.own_rows is not None else -1)
    for i, chunk in enumerate(meta.prefills):
        for p in range(chunk.context_start, chunk.kv_len):
            tables.append(table_of(chunk.block_table))
            lens.append(p + 1)
            if view.chunk_rows:
                own.append(view.chunk_rows[i][0] + p // block_size - chunk.context_start // block_size)
    own_rows = torch.tensor(own) if view.chunk_rows or view.own_rows is not None else None
    return torch.stack(tables), torch.tensor(lens), own_rows


@pytest.mark.parametrize("kv", QUANTIZED)
def test_native_attention_equals_the_reference_path_at_every_layer_and_step(kernel, kv, monkeypatch):
    # A real engine run on the reference path; at every layer of every step (prefill chunks and
    # decodes, int4/int2 residual blocks included) the native kernel attends the same tokens too.
    llm = _engine(kv, batch_invariant=False)
    for kind in llm.engine.runner.storage.kinds:
        kind.attend_rows = False
    compared = []

    def attend(q, layer, kind, view, meta, scale, scratch=None):
        expected = quantized.quantized_paged_attention(q, layer, kind, view, meta, scale, scratch)
        tables, lens, own_rows = _rows_of_step(q, meta, view, layer.block_size)
        got = quantized.native_rows(q, layer, tables, lens, scale, scratch, own_rows)
        largest = expected.abs().amax(dim=-1, keepdim=True)
        assert ((got - expected).abs() <= largest * 1e-5 + 1e-6).all(), (got - expected).abs().max()
        compared.append((meta.num_decode_tokens, len(meta.prefills)))
        return expected

    monkeypatch.setattr(quantized, "attend_quantized", attend)
    for module in (token, kivi):
        monkeypatch.setattr(module, "attend_quantized", attend)
    tokens = llm.get_tokenizer().encode(TEXT)
    llm.generate([tokens[:120], tokens[1000:1050]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert any(d and p for d, p in compared), "no step mixed decodes and prefill chunks"


@pytest.fixture(scope="module")
def full_precision_logprobs():
    """The prompts' logprobs through the full-precision cache, per model dtype, computed once."""
    computed: dict[str, tuple[list[list[int]], list[torch.Tensor]]] = {}

    def of(dtype: str) -> tuple[list[list[int]], list[torch.Tensor]]:
        if dtype not in computed:
            llm = _engine("auto", batch_invariant=True, dtype=dtype)
            tokens = llm.get_tokenizer().encode(TEXT)
            # Quantization noise per prompt is large (fp8_e5m2 keeps two mantissa bits: measured over
            # 200-token prompts, native/reference error ratios of 0.84 to 1.13), so the errors are
            # pooled over every prompt's tokens.
            prompts = [tokens[:160], tokens[1000:1090], tokens[2000:2200], tokens[3000:3200]]
            computed[dtype] = prompts, _prompt_logprobs(llm, prompts)
        return computed[dtype]

    return of


@pytest.mark.parametrize(("kv", "dtype"), [(kv, "bfloat16") for kv in QUANTIZED] + [("int4", "float32")])
def test_engine_logprobs_with_native_rows_are_as_close_to_full_precision_as_the_reference(
    kernel, kv, dtype, full_precision_logprobs
):
    # Every token attended by the native kernel (the default, batch-invariant mode) against the
    # reference path. The paths round differently, and quantization turns a last-bit difference in
    # a key into a different code now and then, so they agree to quantization noise, not to bits:
    # each is compared with the full-precision cache.
    # (bfloat16: the default, where int8 and fp8 keys and values go through the bfloat16 tables)
    prompts, full = full_precision_logprobs(dtype)
    llm = _engine(kv, batch_invariant=True, dtype=dtype)
    assert all(kind.attend_rows for kind in llm.engine.runner.storage.kinds if kind.name != "dense")
    native = _prompt_logprobs(llm, prompts)
    for kind in llm.engine.runner.storage.kinds:
        kind.attend_rows = False
    for layer in llm.engine.runner.storage.layers:
        if hasattr(layer, "native_format"):
            layer.native = layer.native_format = None
    reference = _prompt_logprobs(llm, prompts)
    assert not any(torch.equal(got, exact) for got, exact in zip(native, full))  # the quantized cache was read
    native, reference, full = torch.cat(native), torch.cat(reference), torch.cat(full)
    assert (native - full).abs().mean() <= 1.25 * (reference - full).abs().mean() + 1e-3


def test_the_default_configuration_attends_quantized_kv_natively(kernel):
    llm = LLM(kv_cache_dtype="int4", num_gpu_blocks=32)
    storage = llm.engine.runner.storage
    assert storage.kind("kivi").attend_rows
    assert {layer.native_format for layer in storage.layers} == {_format("int4")}


def _greedy(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[tuple[list[int], list[float]]]:
    """Each prompt's tokens and their logprobs."""
    return [
        (o.outputs[0].token_ids, [s[t].logprob for s, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
        for o in llm.generate(prompts, params)
    ]


@pytest.mark.parametrize("kv", ["int8", "int4"])
def test_quantized_kv_greedy_answer_is_the_same_alone_and_batched(kernel, kv):
    # Every token attends by rows through the native kernel, and the packed weights' kernels give
    # a row the same bits at any row count: the answer and its logprobs do not depend on the batch.
    llm = LLM(kv_cache_dtype=kv, max_num_batched_tokens=96, num_gpu_blocks=256, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=0, ignore_eos=True)

    chat = [
        llm.render_chat([{"role": "user", "content": f"Tell story {i} about a {'big ' * 9 * i}dog."}]) for i in range(4)
    ]
    alone = _greedy(llm, chat[:1], params)[0]
    mixed = _greedy(llm, chat[1:3] + chat[:1] + chat[3:] + chat[:1], params)
    assert mixed[2] == alone and mixed[-1] == alone


@pytest.mark.parametrize("kv", QUANTIZED)
def test_the_one_call_decoder_stack_on_quantized_kv_gives_the_layer_by_layer_bits(kernel, kv, monkeypatch):
    # Quantized caches in the default configuration: a whole step runs as one native call that
    # quantizes each new K/V row at its slot (int8/fp8) or writes it through the step's scratch
    # rows, quantizing blocks as they fill (int4/int2), and attends the codes in place; switched
    # off, the layer-by-layer path (native writes, the kernel by rows) gives the same tokens and
    # logprobs.
    llm = LLM(kv_cache_dtype=kv, max_num_batched_tokens=96, num_gpu_blocks=256, enable_prefix_caching=False)
    model = llm.engine.runner.model
    assert model.layers[0].native is not None, "the default configuration runs on the integer kernels"
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=0, ignore_eos=True)

    prompts = [
        llm.render_chat([{"role": "user", "content": f"Name {i + 2} {'old ' * 5 * i}rivers."}]) for i in range(3)
    ]
    steps = []
    stack = type(model)._stack_attention
    monkeypatch.setattr(type(model), "_stack_attention", lambda *args: steps.append(stack(*args)) or steps[-1])
    fused = _greedy(llm, prompts, params)
    assert any(s is not None for s in steps), "the stack never ran"
    monkeypatch.setattr(type(model), "_stack_attention", lambda *args: None)
    assert _greedy(llm, prompts, params) == fused
