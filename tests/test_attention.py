"""The batched paged attention against the one-query-at-a-time reference."""

import pytest
import torch
from conftest import cpu_levels

from kvbank.attention import AttentionMetadata, PrefillChunk, fast, write_kv
from kvbank.attention.cascade import find_shared_prefixes, share_prefixes
from kvbank.attention.fast import DenseStep, chunk_visibility, paged_attention
from kvbank.attention.paged import paged_attention_reference

BLOCK = 4
HEADS, KV_HEADS, DIM = 6, 2, 8


def _step(seqs: list[tuple[int, int]], num_blocks: int = 64, shared: dict[int, list[int]] | None = None):
    """Metadata, dense step state and tensors for sequences given as (cached_len, new_len), decodes first.

    `shared` maps a sequence's index to the leading blocks it takes from another's table, given
    as (that sequence's index, number of blocks).
    """
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, generator=gen)
    v_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, generator=gen)
    free = list(torch.randperm(num_blocks, generator=gen).tolist())
    slots, tables, lens, prefills, masks = [], [], [], [], []
    offset = 0
    for i, (cached, new) in enumerate(seqs):
        source, count = (shared or {}).get(i, (0, 0))
        table = tables[source][:count] if count else []
        table += [free.pop() for _ in range(-(-(cached + new) // BLOCK) - len(table))]
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(cached, cached + new)]
        if new == 1:
            tables.append(table)
            lens.append(cached + 1)
        else:
            mask = None
            if cached:
                visible = chunk_visibility(cached, cached + new, BLOCK)
                mask = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
            prefills.append(PrefillChunk(offset, offset + new, cached, torch.tensor(table)))
            masks.append(mask)
        offset += new
    meta = AttentionMetadata(torch.tensor(slots), len(tables), None, None, prefills, BLOCK, torch.float32)
    if tables:
        width = max(map(len, tables))
        meta.decode_block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
        meta.decode_context_lens = torch.tensor(lens)
    q = torch.randn(offset, HEADS, DIM, generator=gen)
    k = torch.randn(offset, KV_HEADS, DIM, generator=gen)
    v = torch.randn(offset, KV_HEADS, DIM, generator=gen)
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    return q, k, v, k_cache, v_cache, meta, DenseStep(None, masks)


@pytest.mark.parametrize(
    "seqs",
    [
        [(0, 1)],
        [(5, 1), (12, 1), (3, 1)],  # decodes of different lengths, partial blocks
        [(0, 9)],  # fresh prefill
        [(8, 5)],  # prefill continuing a cached prefix
        [(7, 1), (0, 6), (10, 3), (2, 1)][:3],  # a mixed step
        [(8, 40), (0, 45)],  # chunks long enough for padded queries and keys
        # cached prefixes of whole KEY_PAD units and more: those keys are attended without a mask
        [(64, 5), (130, 40), (200, 1)],
        [(256, 70)],
    ],
)
def test_fast_path_matches_reference(seqs):
    seqs = sorted(seqs, key=lambda s: s[1] > 1)
    q, k, v, k_cache, v_cache, meta, step = _step(seqs, num_blocks=256)
    scale = DIM**-0.5
    got = paged_attention(q, k, v, k_cache, v_cache, meta, step, scale)
    ref = paged_attention_reference(q, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_shared_prefixes_group_decodes_by_their_common_leading_blocks():
    tables = [[1, 2, 3, 4, 5], [9, 8], [1, 2, 3, 4, 6], [1, 2, 7, 7], [1, 2, 3, 4, 5, 6]]
    lens = [18, 6, 20, 16, 24]  # blocks of 4: every token sits in its table's last block
    groups = find_shared_prefixes(tables, lens, 4, min_blocks=2)
    assert sorted((sorted(rows), shared) for rows, shared in groups) == [([0, 2, 4], 4)]
    assert sorted((sorted(rows), shared) for rows, shared in find_shared_prefixes(tables, lens, 4, 1)) == [
        ([0, 2, 4], 4)
    ]  # [3] shares 2 blocks: worth less than the 3 x 4 above
    # A block the decode's own token sits in is never shared, even when the ids agree.
    assert find_shared_prefixes([[1, 2], [1, 2]], [6, 7], 4, 1) == [([0, 1], 1)]
    assert find_shared_prefixes([[1], [1]], [2, 3], 4, 1) == []
    assert find_shared_prefixes([[1, 2, 3]], [10], 4, 1) == []


@pytest.mark.parametrize(
    "seqs, shared, key_pad",
    [
        ([(13, 1), (14, 1), (21, 1)], {1: (0, 3), 2: (0, 3)}, BLOCK),  # one group, different lengths
        ([(16, 1), (17, 1), (9, 1), (12, 1), (5, 1)], {1: (0, 4), 3: (2, 2)}, BLOCK),  # two groups and a loner
        ([(12, 1), (12, 1), (0, 6)], {1: (0, 3)}, BLOCK),  # with a prefill in the step
        ([(70, 1), (75, 1), (90, 1)] * 4, {i: (0, 18) for i in range(1, 12)}, 64),  # 16 of 18 blocks; 36 rows padded
    ],
)
def test_shared_prefix_decodes_match_reference(seqs, shared, key_pad, monkeypatch):
    monkeypatch.setattr(fast, "KEY_PAD", key_pad)
    q, k, v, k_cache, v_cache, meta, step = _step(seqs, num_blocks=256, shared=shared)
    tables = [t[: -(-n // BLOCK)] for t, n in zip(meta.decode_block_tables.tolist(), meta.decode_context_lens.tolist())]
    share_prefixes(
        step, tables, meta.decode_context_lens.tolist(), BLOCK, torch.float32, torch.device("cpu"), min_tokens=BLOCK
    )
    assert len(step.shared_prefixes) == len({source for source, _ in shared.values()})
    assert all(len(p.block_table) * BLOCK % key_pad == 0 for p in step.shared_prefixes)
    scale = DIM**-0.5
    got = paged_attention(q, k, v, k_cache, v_cache, meta, step, scale)
    ref = paged_attention_reference(q, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_write_kv_puts_tokens_in_their_slots():
    k_cache = torch.zeros(3, BLOCK, 1, 2)
    v_cache = torch.zeros(3, BLOCK, 1, 2)
    k = torch.tensor([[[1.0, 1.0]], [[2.0, 2.0]]])
    write_kv(k_cache, v_cache, k, -k, torch.tensor([5, 11]))
    assert k_cache[1, 1].tolist() == [[1.0, 1.0]] and k_cache[2, 3].tolist() == [[2.0, 2.0]]
    assert v_cache[2, 3].tolist() == [[-2.0, -2.0]]
    assert k_cache.abs().sum() == 6


@pytest.mark.parametrize(
    "dtype, heads, kv_heads, dim, block, lens, partition",
    [
        (torch.bfloat16, 9, 3, 64, 16, [1, 17, 300, 944, 33], 256),  # the bundled model's shape; several partitions
        (torch.bfloat16, 9, 3, 64, 16, [130, 7], 32),  # many partitions merged
        (torch.bfloat16, 8, 2, 128, 32, [5, 600], 256),  # group of 4, head dim 128, larger blocks
        (torch.bfloat16, 4, 4, 64, 16, [64, 65], 64),  # no grouping; a partition exactly full
        (torch.bfloat16, 4, 1, 256, 16, [1, 300, 700], 256),  # Gemma 3: head dim 256, group of 4
        (torch.float32, 6, 2, 8, 4, [3, 9, 30], 8),  # the portable path (no AVX-512 needed)
    ],
)
@pytest.mark.parametrize("isa_level", cpu_levels(), indirect=True, scope="module")
def test_native_decode_kernel_matches_reference(native, isa_level, dtype, heads, kv_heads, dim, block, lens, partition):
    # every variant of the dense kernel (scalar, 8 lanes, 16 lanes, bfloat16 pairs) against the reference
    gen = torch.Generator().manual_seed(0)
    num_blocks = sum(-(-n // block) for n in lens) + 3
    k_cache = torch.randn(num_blocks, block, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block, kv_heads, dim, generator=gen).to(dtype)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(-(-n // block))] for n in lens]
    width = max(map(len, tables))
    meta = AttentionMetadata(
        torch.zeros(0, dtype=torch.long),
        len(lens),
        torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        torch.tensor(lens),
        [],
        block,
        dtype,
    )
    q = torch.randn(len(lens), heads, dim, generator=gen).to(dtype)
    scale = dim**-0.5
    native.poison_stacks()  # scratch the kernel reads without writing would be NaN
    got = native.paged_decode_attention(
        q.view(len(lens), kv_heads, heads // kv_heads, dim),
        k_cache,
        v_cache,
        meta.decode_block_tables,
        meta.decode_context_lens,
        scale,
        partition,
    )
    ref = paged_attention_reference(q.float(), k_cache, v_cache, meta, scale)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.view(len(lens), heads, dim).float(), ref, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize(
    "heads, kv_heads, dim, block, lens, window",
    [
        (4, 1, 256, 16, [1, 300, 700, 513, 512], 512),  # Gemma 3: windows of 512, partitions of 256
        (9, 3, 64, 16, [40, 700, 257], 100),  # windows that start inside a block and a partition
    ],
)
@pytest.mark.parametrize("isa_level", cpu_levels(), indirect=True, scope="module")
def test_native_decode_kernel_reads_only_a_rows_window(native, isa_level, heads, kv_heads, dim, block, lens, window):
    gen = torch.Generator().manual_seed(1)
    num_blocks = sum(-(-n // block) for n in lens) + 3
    k_cache, v_cache = (torch.randn(num_blocks, block, kv_heads, dim, generator=gen).bfloat16() for _ in range(2))
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(-(-n // block))] for n in lens]
    width = max(map(len, tables))
    q = torch.randn(len(lens), heads, dim, generator=gen).bfloat16()
    starts = torch.tensor([max(0, n - window) for n in lens])
    args = (torch.tensor([t + [0] * (width - len(t)) for t in tables]), torch.tensor(lens), dim**-0.5, 256)
    queries = q.view(len(lens), kv_heads, heads // kv_heads, dim)
    got = native.paged_decode_attention(queries, k_cache, v_cache, *args, starts).view(len(lens), heads, dim)
    for i, (n, table) in enumerate(zip(lens, tables)):
        slots = torch.tensor([table[p // block] * block + p % block for p in range(starts[i], n)])
        keys = k_cache.view(-1, kv_heads, dim)[slots].double().repeat_interleave(heads // kv_heads, dim=1)
        values = v_cache.view(-1, kv_heads, dim)[slots].double().repeat_interleave(heads // kv_heads, dim=1)
        weights = (torch.einsum("hd,nhd->hn", q[i].double(), keys) * dim**-0.5).softmax(-1)
        ref = torch.einsum("hn,nhd->hd", weights, values)
        torch.testing.assert_close(got[i].double(), ref, atol=2e-2, rtol=2e-2)
    # a row's window, not the batch, decides its bits: alone it gives the same result
    for i in range(len(lens)):
        alone = native.paged_decode_attention(
            queries[i : i + 1], k_cache, v_cache, args[0][i : i + 1], args[1][i : i + 1], *args[2:], starts[i : i + 1]
        )
        assert torch.equal(alone.view(heads, dim), got[i])


def test_native_decode_kernel_rejects_bad_input_by_name(native):
    cache = torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16)
    q = torch.zeros(1, 2, 3, 64, dtype=torch.bfloat16)
    tables, lens = torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="share a dtype"):
        native.paged_decode_attention(q.float(), cache, cache, tables, lens, 1.0, 256)
    with pytest.raises(RuntimeError, match="multiple of the block size"):
        native.paged_decode_attention(q, cache, cache, tables, lens, 1.0, 100)
    with pytest.raises(RuntimeError, match="int64"):
        native.paged_decode_attention(q, cache, cache, tables.int(), lens, 1.0, 256)
    # ids and lengths the kernel would read the cache with, unchecked, are refused first
    with pytest.raises(RuntimeError, match="row 0: block 4 is outside the cache's 4 blocks"):
        native.paged_decode_attention(q, cache, cache, tables + 4, lens, 1.0, 256)
    with pytest.raises(RuntimeError, match="row 0: block -1 is outside"):
        native.paged_decode_attention(q, cache, cache, tables - 1, lens, 1.0, 256)
    with pytest.raises(RuntimeError, match="row 0: context length 17 is beyond its block table of 1 blocks of 16"):
        native.paged_decode_attention(q, cache, cache, tables, lens * 17, 1.0, 256)
    with pytest.raises(RuntimeError, match="row 0: start 1 is outside its context of 1"):
        native.paged_decode_attention(q, cache, cache, tables, lens, 1.0, 256, lens)


def test_the_quantized_kernel_reads_a_bf16_cache_as_format_0(native):
    # The AVX2 kernel's dense bfloat16 format: the same attention as the reference.
    assert native.has_quant_decode(), "every x86 CPU runs the quantized attention (its scalar variant at the least)"
    q, k, v, k_cache, v_cache, meta, _ = _step([(40, 1), (300, 1), (0, 1)], num_blocks=160)
    q, k_cache, v_cache = [x.to(torch.bfloat16).repeat_interleave(8, dim=-1) for x in (q, k_cache, v_cache)]
    n, heads, dim = q.shape
    none = torch.empty(0, dtype=torch.float16)
    got = native.quant_decode_attention(
        q.view(n, KV_HEADS, heads // KV_HEADS, dim),
        0,
        k_cache,
        none,
        None,
        v_cache,
        none,
        None,
        meta.decode_block_tables,
        meta.decode_context_lens,
        0.125,
        256,
    ).view(n, heads, dim)
    ref = paged_attention_reference(q, k_cache, v_cache, meta, 0.125)
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("isa_level", cpu_levels(), indirect=True, scope="module")
def test_decodes_use_the_native_kernel_where_it_has_a_vector_variant(native, isa_level):
    cpu = torch.device("cpu")
    kernel = fast.native_decode_kernel(cpu, torch.bfloat16, 9, 3, 64, 16)
    assert (kernel is not None) == (isa_level != "scalar")
    if kernel is None:
        return  # the scalar variant is the others' reference (test_native_decode_kernel_matches_reference)
    assert native.dense_attention_isa() == {"avx512_vnni": "avx512", "amx": "avx512_bf16"}.get(isa_level, isa_level)
    assert fast.native_decode_kernel(cpu, torch.float32, 9, 3, 64, 16) is None  # float32 keeps PyTorch's path
    assert fast.native_decode_kernel(cpu, torch.bfloat16, 9, 3, 48, 16) is None  # no fast path for this head size
    q, k, v, k_cache, v_cache, meta, _ = _step([(40, 1), (70, 1)])
    expanded = [x.to(torch.bfloat16).repeat_interleave(8, dim=-1) for x in (q, k, v, k_cache, v_cache)]
    q, k, v, k_cache, v_cache = expanded  # head dim 64
    got = paged_attention(q, k, v, k_cache, v_cache, meta, DenseStep(kernel, []), 0.125)
    ref = paged_attention_reference(q, k_cache, v_cache, meta, 0.125)
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)
