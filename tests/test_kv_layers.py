"""The KV-layer seam: formats, the kind registry, KIVI residual slots, padded quantized prefill."""

import pytest
import torch
from tiny_models import tiny_config

from kvbank import LLM, SamplingParams
from kvbank.attention import quantized
from kvbank.attention.rope import apply_rope, rotation_tables
from kvbank.cache import layers, quant
from kvbank.cache.format import KVFormat
from kvbank.cache.layers.kivi import ResidualSlots
from kvbank.cache.layers.token import TokenKind, TokenLayer
from kvbank.cache.limits import EDITS, TOKEN_EDITS
from kvbank.cache.storage import KVStorage, plan_pool

SMALL = tiny_config()  # 4 layers of 4 heads over 2 KV heads of 64 dims


def test_format_names_kinds_codecs_and_cache_namespace():
    fmt = KVFormat("int4", skip_layers=(0, -1), group_size=16)
    assert fmt.kinds(4, torch.bfloat16) == ["dense", "kivi", "kivi", "dense"]
    assert [k.name for k, _ in fmt.codecs(4, torch.bfloat16)] == ["bfloat16", "int4", "int4", "bfloat16"]
    assert KVFormat().namespace == b""
    assert fmt.namespace == b"|kv=int4/0,-1/16/r2"
    assert KVFormat("int4").namespace != KVFormat("int4", group_size=16).namespace
    assert KVFormat("float32").kinds(1, torch.float32) == ["dense"]  # the model's own dtype is dense
    assert KVFormat("float32").kinds(1, torch.bfloat16) == ["token"]
    with pytest.raises(ValueError, match="kv_cache_dtype='q4_0' is not one of"):
        KVFormat("q4_0")
    with pytest.raises(ValueError, match="has layer 4, but the model has 4 layers"):
        KVFormat("int8", (4,)).codecs(4, torch.bfloat16)
    with pytest.raises(ValueError, match="kv_quant_group_size=0"):
        KVFormat("int4", group_size=0)


def test_storage_gives_each_layer_to_its_kind_and_sizes_like_the_plan():
    fmt = KVFormat("int4", skip_layers=(1,))
    storage = KVStorage(SMALL, 10, 16, torch.bfloat16, torch.device("cpu"), fmt, reserved_seqs=3, batch_invariant=False)
    assert [kind.name for kind in storage.kinds] == ["kivi", "dense"]
    assert [type(layer).__name__ for layer in storage.layers] == ["KiviLayer", "DenseLayer", "KiviLayer", "KiviLayer"]
    plan = plan_pool(SMALL, torch.bfloat16, 2**20, 16, fmt, reserved_seqs=3)
    assert storage.nbytes == 10 * plan.bytes_per_block
    assert storage.extra_nbytes == 3 * plan.residual_bytes_per_seq == 3 * 3 * 2 * 16 * 2 * 64 * 2


class _Float32Mirror(quant.FullPrecision):
    """A codec whose layers a kind registered only here stores."""

    kind = "mirror"

    def __init__(self) -> None:
        super().__init__(torch.float32)


class _MirrorKind(TokenKind):
    """A new storage kind: per-token float32, reusing the per-token layer."""

    name = "mirror"


def test_a_new_storage_kind_is_one_class_and_one_registry_line(monkeypatch):
    """What a new kind needs: its module's class, a registry line, and a codec that names it."""
    monkeypatch.setitem(layers.KINDS, "mirror", _MirrorKind)
    monkeypatch.setitem(quant.CODECS, "mirror", lambda *_: (_Float32Mirror(), _Float32Mirror()))
    prompt = list(range(100, 160))
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    mirror = LLM(kv_cache_dtype="mirror", num_gpu_blocks=32, enable_prefix_caching=False)
    assert {kind.name for kind in mirror.engine.runner.storage.kinds} == {"mirror"}
    assert all(isinstance(layer, TokenLayer) for layer in mirror.engine.runner.storage.layers)
    stock = LLM(kv_cache_dtype="float32", num_gpu_blocks=32, enable_prefix_caching=False)
    assert (
        mirror.generate([prompt], greedy)[0].outputs[0].token_ids
        == stock.generate([prompt], greedy)[0].outputs[0].token_ids
    )


def test_residual_slots_grow_for_a_burst_and_shrink_back_keeping_live_data():
    slots = ResidualSlots(num_layers=2, reserved=2, shape=(4, 1, 2), dtype=torch.float32, device=torch.device("cpu"))
    for block_id in range(10):
        slot = slots.slot(block_id)
        slots.k[0][slot] = block_id
        slots.v[1][slot] = -block_id
    assert slots.capacity == 16
    for block_id in range(10):
        if block_id not in (3, 7):
            slots.release(block_id)
    slots.shrink()
    assert slots.capacity == 4  # 2 live blocks: twice that, never below reserved
    for block_id in (3, 7):
        assert torch.all(slots.k[0][slots.of_block[block_id]] == block_id)
        assert torch.all(slots.v[1][slots.of_block[block_id]] == -block_id)
    assert sorted(slots.free + list(slots.of_block.values())) == [0, 1, 2, 3]
    slots.release(3)
    slots.release(7)
    slots.shrink()
    assert slots.capacity == 2 and not slots.of_block


def test_quantized_prefill_calls_the_kernel_with_padded_shapes(monkeypatch):
    """Prompts of many lengths give the flash kernel few shapes, so its per-shape cache stays small."""
    seen = set()
    sdpa = quantized.F.scaled_dot_product_attention

    def record(q, k, v, **kw):
        seen.add((q.shape[-2], k.shape[-2]))
        return sdpa(q, k, v, **kw)

    monkeypatch.setattr(quantized.F, "scaled_dot_product_attention", record)
    monkeypatch.setattr(quantized, "DEQUANT_CHUNK_TOKENS", None)  # one range: the concatenating path
    # the reference path's prefill (batch-invariant mode attends every token natively where it can)
    llm = LLM(kv_cache_dtype="int8", num_gpu_blocks=64, enable_prefix_caching=False, batch_invariant=False)
    for n in range(33, 64, 3):
        llm.generate([list(range(200, 200 + n))], SamplingParams(max_tokens=1))
    prefill = {shape for shape in seen if shape[0] > 3}
    assert prefill == {(64, 64)}, prefill


# --- edits a long-context policy makes, per layout -----------------------------------------------

LAYOUTS = ["auto", "int8", "fp8_e4m3", "int4", "int2"]


def _edit_storage(dtype: str) -> KVStorage:
    return KVStorage(
        SMALL, 12, 16, torch.bfloat16, torch.device("cpu"), KVFormat(dtype), reserved_seqs=2, batch_invariant=False
    )


def _fill(storage: KVStorage, blocks: list[int], seed: int) -> None:
    """Random K/V written into whole blocks of every layer as each layout stores them."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.tensor(blocks)
    for layer in storage.layers:
        for side in range(2):
            x = torch.randn(len(blocks), 16, 2, 64, generator=generator).to(torch.bfloat16)
            if not hasattr(layer, "codecs"):
                layer.tensors[side][ids] = x
                continue
            for name, value in layer.codecs[side].quantize(x).items():
                layer.sides[side][name][ids] = value


def _read(storage: KVStorage, blocks: list[int], side: int = 0) -> list[torch.Tensor]:
    """Every layer's keys (side 0) or values of `blocks`, dequantized: [blocks, 16, heads, dim] each."""
    ids = torch.tensor(blocks)
    return [
        layer.codecs[side].dequantize({n: t[ids] for n, t in layer.sides[side].items()}, torch.float32)
        if hasattr(layer, "codecs")
        else layer.tensors[side][ids].float()
        for layer in storage.layers
    ]


def _roundtrip(storage: KVStorage, x: torch.Tensor) -> torch.Tensor:
    layer = storage.layers[0]
    if not hasattr(layer, "codecs"):
        return x.to(torch.bfloat16).float()
    return layer.codecs[0].dequantize(layer.codecs[0].quantize(x.to(torch.bfloat16)), torch.float32)


@pytest.mark.parametrize("dtype", LAYOUTS)
def test_rotating_whole_blocks_of_keys_is_a_rotation_up_to_one_requantization(dtype):
    storage = _edit_storage(dtype)
    _fill(storage, [0, 1], seed=1)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 64, 2).double() / 64))
    cos, sin = rotation_tables(torch.tensor([37]), inv_freq)
    before, values = _read(storage, [0, 1]), _read(storage, [0, 1], side=1)
    storage.copy_blocks([(0, 2), (1, 3)])
    storage.rotate_keys([0, 1], [2, 3], (cos[0], sin[0]))
    for was, got in zip(before, _read(storage, [2, 3])):
        exact = apply_rope(was.double(), cos[0].double(), sin[0].double()).float()
        # The only loss allowed is storing the rotated keys once more (a code may round the other way)
        bound = 3 * (_roundtrip(storage, exact) - exact).abs().max()
        assert (got - exact).abs().max() <= bound
        assert (got - was).abs().max() > 10 * bound or dtype == "int2"  # the keys did turn
    assert all(torch.equal(a, b) for a, b in zip(_read(storage, [2, 3], side=1), values))  # values stay
    assert all(torch.equal(a, b) for a, b in zip(_read(storage, [0, 1]), before))  # the source stays


def test_an_open_int4_block_rotates_its_keys_in_its_residual_slot():
    storage = _edit_storage("int4")
    residual = storage.kinds[0].residual
    keys = torch.randn(4, 16, 2, 64).to(torch.bfloat16)
    for i, layer_keys in enumerate(keys):
        residual.k[i][residual.slot(5)] = layer_keys
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 64, 2).double() / 64))
    cos, sin = rotation_tables(torch.tensor([-11]), inv_freq)
    storage.copy_blocks([(5, 6)])
    storage.rotate_keys([5, 6], [5, 6], (cos[0], sin[0]))  # in place, as a rebase does
    for i, layer_keys in enumerate(keys):
        exact = apply_rope(layer_keys.double(), cos[0].double(), sin[0].double())
        for block in (5, 6):
            torch.testing.assert_close(residual.k[i][residual.of_block[block]].double(), exact, atol=0.02, rtol=0.01)


@pytest.mark.parametrize("dtype", ["auto", "int8", "fp8_e4m3"])
def test_moving_tokens_and_single_slots_copies_them_exactly(dtype):
    storage = _edit_storage(dtype)
    _fill(storage, [0, 1, 2], seed=2)
    keys, values = _read(storage, [0, 1, 2]), _read(storage, [0, 1, 2], side=1)
    flat = lambda blocks: [x.reshape(-1, 2, 64) for x in blocks]
    src, dst = torch.tensor([3, 17, 40]), torch.tensor([64, 65, 66])  # slots of blocks 0-2 -> block 4
    storage.move_tokens(src, dst)
    for was, now in zip(flat(keys) + flat(values), flat(_read(storage, [4])) + flat(_read(storage, [4], side=1))):
        assert torch.equal(now[:3], was[src])
    # move_slots: per layer and head its own slots (as compaction does)
    per_head = torch.stack([torch.stack([src + h + layer for h in range(2)]) for layer in range(4)])
    storage.move_slots(per_head, torch.tensor([80, 81, 82]).expand(4, 2, 3))
    for layer, (was, now) in enumerate(zip(flat(keys), flat(_read(storage, [5])))):
        for h in range(2):
            assert torch.equal(now[:3, h], was[src + h + layer, h])


@pytest.mark.parametrize("skip", [(), (1,)], ids=["int8", "int8_dense_layer_1"])
def test_gathered_tokens_are_the_pool_dequantized_and_scattered_ones_read_back_the_same(skip):
    """What recall reads and writes: tokens of one layout (or a mixed pool, layer by layer) handed
    out in the model dtype, equal to each layer's stored tokens; written back, they store the same."""
    storage = KVStorage(
        SMALL,
        12,
        16,
        torch.bfloat16,
        torch.device("cpu"),
        KVFormat("int8", skip),
        reserved_seqs=2,
        batch_invariant=False,
    )
    _fill(storage, [0, 1, 2], seed=3)
    slots = torch.tensor([5, 16, 17, 47])
    keys, values = storage.gather_tokens(slots)
    assert keys.shape == values.shape == (4, 4, 2, 64) and keys.dtype == torch.bfloat16
    for side, got in ((0, keys), (1, values)):
        for layer, stored in enumerate(_read(storage, [0, 1, 2], side)):
            want = stored.reshape(-1, 2, 64)[slots].to(torch.bfloat16)  # dequantized, in the model dtype
            assert torch.equal(got[layer], want)
    storage.scatter_tokens(torch.tensor([64, 65, 66, 67]), keys, values)
    again = storage.gather_tokens(torch.tensor([64, 65, 66, 67]))
    assert torch.equal(again[0], keys) and torch.equal(again[1], values)  # a stored token re-stores exactly


def test_each_layout_names_the_edits_it_takes():
    assert _edit_storage("auto").edits == frozenset(EDITS)
    assert _edit_storage("int8").edits == _edit_storage("fp8_e5m2").edits == TOKEN_EDITS
    assert _edit_storage("int4").edits == _edit_storage("int2").edits == {"rotate", "tokens", "gather"}
    mixed = KVStorage(
        SMALL, 4, 16, torch.bfloat16, torch.device("cpu"), KVFormat("int4", skip_layers=(0,)), batch_invariant=False
    )
    assert mixed.edits == {"rotate", "tokens", "gather"}
    with pytest.raises(NotImplementedError, match="the kivi KV layout cannot move single tokens of one layer"):
        mixed.kind("kivi").move_slots(torch.tensor([[[0]]]), torch.tensor([[[1]]]))


def _open(storage: KVStorage, block: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Random K/V (model dtype) in a residual slot of `block`, every layer: the block is open."""
    generator, residual = torch.Generator().manual_seed(seed), storage.kinds[0].residual
    slot = residual.slot(block)
    keys = [torch.randn(16, 2, 64, generator=generator).to(torch.bfloat16) for _ in storage.layers]
    values = [torch.randn(16, 2, 64, generator=generator).to(torch.bfloat16) for _ in storage.layers]
    for i in range(len(storage.layers)):
        residual.k[i][slot], residual.v[i][slot] = keys[i], values[i]
    return keys, values


@pytest.mark.parametrize("dtype", ["int4", "int2"])
def test_kivi_token_moves_copy_values_exactly_and_requantize_the_keys_blocks_once(dtype):
    """A stream's leading tokens are written again before its kept frames: tokens move between
    blocks, keys rotated on the way. KIVI values are per token: their codes move as stored. Keys
    share a range per block and channel: a block that takes tokens is stored again whole, so its
    keys are within one more quantization of what it holds; an open block takes tokens in full
    precision, and one leaving an open block is quantized as a write would."""
    storage = _edit_storage(dtype)
    residual = storage.kinds[0].residual
    _fill(storage, [0, 1, 2, 3], seed=5)
    open_keys, open_values = _open(storage, 6, seed=6)
    keys, values = _read(storage, [0, 1, 2, 3, 4]), _read(storage, [0, 1, 2, 3], side=1)
    flat = lambda xs: [x.reshape(-1, 2, 64) for x in xs]
    step = lambda exact: (_roundtrip(storage, exact.unsqueeze(0))[0] - exact).abs().max()
    # slots of blocks 0-2 -> the start of closed block 4; two tokens of closed block 0 -> open
    # block 6; two of open block 6 -> closed block 7
    src = torch.tensor([3, 17, 40, 1, 2, 96 + 9, 96 + 10])
    dst = torch.tensor([64, 65, 66, 96 + 4, 96 + 5, 112, 113])
    storage.move_tokens(src, dst)
    for layer, (was_k, was_v, now_k, now_v) in enumerate(
        zip(flat(keys), flat(values), flat(_read(storage, [4, 7])), flat(_read(storage, [4, 7], side=1)))
    ):
        assert torch.equal(now_v[:3], was_v[src[:3]])  # values: codes moved as stored
        # block 4 = the three moved keys over what it held, quantized again: within a step of that
        exact = torch.cat((was_k[src[:3]], was_k[67:80]))
        assert (now_k[:16] - exact).abs().max() <= 2 * step(exact)
        slot6 = residual.of_block[6]
        # into the open block: the source's dequantized K/V, in the model dtype
        assert torch.equal(residual.k[layer][slot6][4:6], was_k[1:3].to(torch.bfloat16))
        assert torch.equal(residual.v[layer][slot6][4:6], was_v[1:3].to(torch.bfloat16))
        # out of the open block into a closed one: values quantized per token as a write would
        codec = storage.layers[layer].codecs[1]
        want = codec.dequantize(codec.quantize(open_values[layer][9:11]), torch.float32)
        assert torch.equal(now_v[16:18], want)
    assert 7 not in residual.of_block and 4 not in residual.of_block  # closed blocks stay in the pool
    # block 3 -> block 8, keys rotated on the way: values as stored, keys within a step of rotated
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 64, 2).double() / 64))
    cos, sin = rotation_tables(torch.tensor([29]), inv_freq)
    storage.move_tokens(torch.arange(48, 64), torch.arange(128, 144), (cos[0], sin[0]))
    for was_k, was_v, now_k, now_v in zip(keys, values, _read(storage, [8]), _read(storage, [8], side=1)):
        assert torch.equal(now_v[0], was_v[3])
        exact = apply_rope(was_k[3].double(), cos[0].double(), sin[0].double()).float()
        assert (now_k[0] - exact).abs().max() <= 3 * step(exact)
        assert (now_k[0] - was_k[3]).abs().max() > 10 * step(exact) or dtype == "int2"  # the keys did turn


@pytest.mark.parametrize("dtype", ["int4", "int2"])
def test_kivi_gathers_dequantized_tokens_and_scatters_them_into_whole_blocks(dtype):
    """What recall reads and writes on a KIVI pool: gathered tokens are the pool's dequantized
    blocks (an open block's from its residual slot); scattered into fresh blocks (the last opened
    first, as a recalled table's last partial block is) they read back within one quantization."""
    storage = _edit_storage(dtype)
    residual = storage.kinds[0].residual
    _fill(storage, [0, 1], seed=7)
    open_keys, open_values = _open(storage, 2, seed=8)
    slots = torch.tensor([5, 16, 31, 32, 40])
    keys, values = storage.gather_tokens(slots)
    assert keys.shape == values.shape == (4, 5, 2, 64) and keys.dtype == torch.bfloat16
    for side, got, opened in ((0, keys, open_keys), (1, values, open_values)):
        for layer, stored in enumerate(_read(storage, [0, 1], side)):
            assert torch.equal(got[layer][:3], stored.reshape(-1, 2, 64)[slots[:3]].to(torch.bfloat16))
            assert torch.equal(got[layer][3:], opened[layer][[0, 8]])
    # 20 tokens into blocks 4 (whole) and 5 (4 tokens: the sequence's open last block)
    many = torch.arange(20) % 5
    storage.open_block(5)
    target = torch.cat((torch.arange(64, 80), torch.arange(80, 84)))
    storage.scatter_tokens(target, keys[:, many], values[:, many])
    back_k, back_v = storage.gather_tokens(target)
    assert 5 in residual.of_block and 4 not in residual.of_block
    assert torch.equal(back_k[:, 16:], keys[:, many[16:]]) and torch.equal(back_v[:, 16:], values[:, many[16:]])
    for layer in range(4):
        codecs = storage.layers[layer].codecs
        want_v = codecs[1].dequantize(codecs[1].quantize(values[layer, many[:16]]), torch.float32)
        assert torch.equal(back_v[layer, :16], want_v.to(torch.bfloat16))  # per token, as a write
        block = keys[layer, many[:16]].float().unsqueeze(0)
        want_k = codecs[0].dequantize(codecs[0].quantize(block), torch.float32)[0]
        assert torch.equal(back_k[layer, :16], want_k.to(torch.bfloat16))  # the block quantized whole


def test_opening_a_closed_kivi_block_moves_its_tokens_to_a_residual_slot():
    storage = _edit_storage("int4")
    residual = storage.kinds[0].residual
    _fill(storage, [3], seed=9)
    keys, values = _read(storage, [3]), _read(storage, [3], side=1)
    storage.open_block(3)
    slot = residual.of_block[3]
    for layer in range(4):
        assert torch.equal(residual.k[layer][slot], keys[layer][0].to(torch.bfloat16))
        assert torch.equal(residual.v[layer][slot], values[layer][0].to(torch.bfloat16))
    storage.open_block(3)  # already open: unchanged
    assert residual.of_block == {3: slot}
