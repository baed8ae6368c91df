"""The KV-layer seam: formats, the kind registry, KIVI residual slots, padded quantized prefill."""

import pytest
import torch
from tiny_models import tiny_config

from kvbank import LLM, SamplingParams
from kvbank.attention import quantized
from kvbank.cache import layers, quant
from kvbank.cache.format import KVFormat
from kvbank.cache.layers.kivi import ResidualSlots
from kvbank.cache.layers.token import TokenKind, TokenLayer
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
    storage = KVStorage(SMALL, 10, 16, torch.bfloat16, torch.device("cpu"), fmt, reserved_seqs=3)
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
