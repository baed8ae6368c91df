"""kvbank's KV formats as transformers caches: against DynamicCache on tiny random checkpoints of
every architecture kvbank supports (Llama, Mistral, Qwen2, Qwen3) and on the bundled model."""

from pathlib import Path

import pytest
import torch
from tiny_models import (
    TINY_HEAD_DIM,
    TINY_HEADS,
    TINY_KV_HEADS,
    TINY_LAYERS,
    TINY_VOCAB,
    smollm2_135m_hf,
    tiny_hf_config,
    tiny_llama_config,
)
from transformers import (
    AutoModelForCausalLM,
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    LogitsProcessor,
    LogitsProcessorList,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)
from transformers.models.llama.modeling_llama import rotate_half

from kvbank import LLM, SamplingParams
from kvbank.cache.policies import keep_top
from kvbank.cache.quant import codecs_for
from kvbank.integrations.hf import (
    BLOCK_SIZE,
    QUANTIZED_DTYPES,
    KVBankQuantizedCache,
    SinkWindowCache,
    SnapKVCache,
    bytes_per_token,
)

DTYPES = ["int8", "fp8_e4m3", "int4", "int2"]
TEXT = (Path(__file__).parent / "data" / "austen_excerpt.txt").read_text()
HEADS, KV_HEADS, DIM, LAYERS = TINY_HEADS, TINY_KV_HEADS, TINY_HEAD_DIM, TINY_LAYERS


ARCHS = {
    "llama": (LlamaConfig, {}),
    "mistral": (MistralConfig, {"sliding_window": None}),
    "qwen2-bias": (Qwen2Config, {}),
    "qwen3-qknorm": (Qwen3Config, {"head_dim": DIM}),
}


def _tiny(arch: str, folder=None, **overrides):
    """A tiny random checkpoint of `arch` (saved and loaded again when `folder` is given)."""
    config_cls, extra = ARCHS[arch]
    extra = {**extra, **overrides}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_hf_config(config_cls, **extra), dtype=torch.float32).eval()
    with torch.no_grad():  # biases and norms start at 0 and 1; make them matter
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.2)
    if folder is None:
        return model
    model.save_pretrained(folder)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def model():
    return _tiny("llama")


@pytest.fixture(scope="module", params=sorted(ARCHS))
def arch_model(request, tmp_path_factory):
    return _tiny(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(0, TINY_VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))


def _greedy(model, prompt, cache, **kwargs):
    return model.generate(prompt, max_new_tokens=30, do_sample=False, past_key_values=cache, **kwargs)


@pytest.mark.parametrize("kv_dtype", DTYPES)
def test_a_residual_covering_the_generation_gives_dynamic_cache_output(model, prompt, kv_dtype):
    expected = _greedy(model, prompt, DynamicCache())
    assert torch.equal(
        _greedy(model, prompt, KVBankQuantizedCache(kv_dtype, residual_length=128, group_size=16)), expected
    )


@pytest.mark.parametrize("kv_dtype", DTYPES)
def test_old_blocks_are_stored_in_the_engine_format(model, prompt, kv_dtype):
    cache = KVBankQuantizedCache(kv_dtype, residual_length=0, group_size=16)
    out = _greedy(model, prompt, cache)
    tokens = out.shape[1] - 1  # the last token is sampled, never cached
    assert cache.get_seq_length() == tokens
    unit = BLOCK_SIZE if kv_dtype in ("int4", "int2") else 1  # int8/fp8 store every token at once
    units = tokens // unit
    key, value = codecs_for(kv_dtype, torch.float32, 16)
    per_unit = key.bytes_per_block(unit, KV_HEADS, DIM) + value.bytes_per_block(unit, KV_HEADS, DIM)
    exact = 2 * (tokens - units * unit) * KV_HEADS * DIM * 4  # float32 K and V of the partial block
    assert cache.nbytes == LAYERS * prompt.shape[0] * (units * per_unit + exact)
    dynamic = DynamicCache()
    _greedy(model, prompt, dynamic)
    full = sum(layer.keys.nbytes + layer.values.nbytes for layer in dynamic.layers)
    assert cache.nbytes < full / (1.9 if kv_dtype in ("int8", "fp8_e4m3") else 3)


def test_bfloat16_covering_caches_give_dynamic_cache_output_and_store_the_engine_bytes(prompt):
    model = _tiny("llama").to(torch.bfloat16)
    expected = _greedy(model, prompt, DynamicCache())
    for cache in (
        KVBankQuantizedCache("int4", residual_length=128, group_size=16),
        SinkWindowCache(sinks=4, window=200, model=model),
        SnapKVCache(budget=100, window=16, model=model),
    ):
        assert torch.equal(_greedy(model, prompt, cache), expected), type(cache).__name__
    for kv_dtype in DTYPES:
        cache = KVBankQuantizedCache(kv_dtype, residual_length=0, group_size=16)
        tokens = _greedy(model, prompt, cache).shape[1] - 1
        unit = BLOCK_SIZE if kv_dtype in ("int4", "int2") else 1
        key, value = codecs_for(kv_dtype, torch.bfloat16, 16)
        per_unit = key.bytes_per_block(unit, KV_HEADS, DIM) + value.bytes_per_block(unit, KV_HEADS, DIM)
        exact = 2 * (tokens % unit) * KV_HEADS * DIM * 2  # bfloat16 K and V of the partial block
        assert cache.nbytes == LAYERS * prompt.shape[0] * ((tokens // unit) * per_unit + exact), kv_dtype


def test_beam_search_reorders_the_stored_blocks(model, prompt):
    expected = model.generate(prompt, max_new_tokens=12, num_beams=3, do_sample=False)
    covering = KVBankQuantizedCache("int8", residual_length=128, group_size=16)
    beams = model.generate(prompt, max_new_tokens=12, num_beams=3, do_sample=False, past_key_values=covering)
    assert torch.equal(beams, expected)
    # Stored blocks (nothing exact): each returned beam's score must be what its own tokens score
    # alone, fed through a fresh cache the same way. A beam that attended another beam's blocks
    # (a missed or wrong reorder) scores otherwise.
    stored = KVBankQuantizedCache("int8", residual_length=0, group_size=16)
    beams = model.generate(
        prompt,
        max_new_tokens=12,
        min_new_tokens=12,
        num_beams=3,
        num_return_sequences=3,
        length_penalty=0.0,  # scores are plain sums of log-probabilities
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
        past_key_values=stored,
    )
    assert stored.get_seq_length() > BLOCK_SIZE
    length = prompt.shape[1]
    assert beams.sequences.shape == (3 * prompt.shape[0], length + 12)
    assert len({tuple(row.tolist()) for row in beams.sequences}) == len(beams.sequences)
    for row, score in zip(beams.sequences, beams.sequences_scores):
        alone = KVBankQuantizedCache("int8", residual_length=0, group_size=16)
        with torch.no_grad():
            logits = model(row[None, :length], past_key_values=alone).logits[0, -1]
            total = 0.0
            for t in range(length, len(row)):
                total += logits.log_softmax(-1)[row[t]].item()
                logits = model(row[None, t : t + 1], past_key_values=alone).logits[0, -1]
        assert total == pytest.approx(score.item(), abs=1e-2)


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="kv_dtype='int3' is not one of"):
        KVBankQuantizedCache("int3")
    with pytest.raises(ValueError, match="residual_length=-1"):
        KVBankQuantizedCache("int8", residual_length=-1)
    torch.manual_seed(0)
    tiny = LlamaForCausalLM(
        tiny_llama_config(
            vocab_size=64,
            hidden_size=48,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    )
    with pytest.raises(ValueError, match="group_size=64 must divide the head dimension 24"):
        tiny.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, past_key_values=KVBankQuantizedCache("int4"))


def test_every_architecture_generates_as_dynamic_cache_with_covering_caches(arch_model, prompt):
    expected = _greedy(arch_model, prompt, DynamicCache())
    for cache in (
        KVBankQuantizedCache("int4", residual_length=128, group_size=16),
        KVBankQuantizedCache("fp8_e4m3", residual_length=128),
        SinkWindowCache(sinks=4, window=200, model=arch_model),
        SnapKVCache(budget=100, window=16, model=arch_model),
    ):
        assert torch.equal(_greedy(arch_model, prompt, cache), expected), type(cache).__name__
    stored = KVBankQuantizedCache("int4", residual_length=0, group_size=16)
    out = _greedy(arch_model, prompt, stored)
    assert out.shape == expected.shape and stored.layers[0].num_stored == 64


def test_sliding_window_models_keep_quantized_caches_and_refuse_evicting_ones(prompt):
    mistral = _tiny("mistral", sliding_window=24)
    expected = _greedy(mistral, prompt, DynamicCache())
    assert torch.equal(_greedy(mistral, prompt, KVBankQuantizedCache("int8", residual_length=128)), expected)
    with pytest.raises(ValueError, match="sliding window of 24 tokens"):
        SinkWindowCache(sinks=4, window=64, model=mistral)
    with pytest.raises(ValueError, match="sliding window of 24 tokens"):
        SnapKVCache(budget=32, window=8, model=mistral)


def test_caches_are_reset_for_reuse_and_refuse_to_be_cropped(model, prompt):
    expected = _greedy(model, prompt, DynamicCache())
    for cache in (
        KVBankQuantizedCache("int8", residual_length=0),
        KVBankQuantizedCache("int4", residual_length=16, group_size=16),
        SinkWindowCache(sinks=4, window=200, model=model),
    ):
        first = _greedy(model, prompt, cache)
        cache.reset()
        assert cache.get_seq_length() == 0
        assert torch.equal(_greedy(model, prompt, cache), first), type(cache).__name__
        if isinstance(cache, SinkWindowCache):
            assert torch.equal(first, expected)
        # Assisted decoding crops the cache after rejected guesses: refused, never silently wrong
        # (5.24+ refuses caches that are not croppable; before, the crop itself raises).
        cache.reset()
        repeats = torch.tensor([[5, 6, 7, 8, 9] * 6])
        with pytest.raises(ValueError, match="crop"):
            model.generate(
                repeats, max_new_tokens=30, do_sample=False, past_key_values=cache, prompt_lookup_num_tokens=3
            )
    snap = SnapKVCache(budget=24, window=8, model=model)
    _greedy(model, prompt, snap)
    with pytest.raises(ValueError, match="serves one prompt"):
        snap.reset()


# --- SinkWindowCache -------------------------------------------------------------------------------


def test_a_window_covering_the_generation_gives_dynamic_cache_output(model, prompt):
    expected = _greedy(model, prompt, DynamicCache())
    assert torch.equal(_greedy(model, prompt, SinkWindowCache(sinks=4, window=200, model=model)), expected)


def test_sink_window_memory_is_constant_over_a_4k_token_generation(model, prompt):
    cache = SinkWindowCache(sinks=4, window=64, model=model)
    sizes = []

    class Watch(LogitsProcessor):
        def __call__(self, input_ids, scores):
            sizes.append(cache.nbytes)
            return scores

    out = model.generate(
        prompt[:1],
        max_new_tokens=4000,
        min_new_tokens=4000,
        do_sample=False,
        past_key_values=cache,
        logits_processor=LogitsProcessorList([Watch()]),
    )
    assert out.shape[1] == prompt.shape[1] + 4000 and cache.get_seq_length() == out.shape[1] - 1
    assert len(set(sizes[100:])) == 1, "the cache holds the same bytes once the window is full"
    assert all(layer.keys.shape[-2] == 4 + 64 for layer in cache.layers)


def test_sinks_are_handed_over_rotated_to_sit_just_before_the_window(arch_model):
    model = arch_model
    rotary = model.model.rotary_emb
    base = torch.randn(1, KV_HEADS, 200, DIM)

    def at(positions):
        cos, sin = rotary(base, torch.tensor([positions]))
        return (
            base[..., : len(positions), :] * cos[:, None] + rotate_half(base[..., : len(positions), :]) * sin[:, None]
        )

    cache = SinkWindowCache(sinks=4, window=16, model=model)
    keys = at(list(range(100)))  # a prompt of 100 tokens, rotated at their positions by the model's rotary
    cache.update(keys, keys.clone(), 0)
    step = base[..., 100:101, :]  # the next token's key (its rotation does not matter here)
    handed, _ = cache.update(step, step.clone(), 0)
    # Kept: the sinks and tokens 84..99, computed there; the sinks are handed over as if at 80..83.
    sinks = base[..., :4, :]
    cos, sin = rotary(base, torch.tensor([list(range(80, 84))]))
    torch.testing.assert_close(handed[..., :4, :], sinks * cos[:, None] + rotate_half(sinks) * sin[:, None])
    torch.testing.assert_close(handed[..., 4:20, :], keys[..., 84:100, :])
    assert cache.get_seq_length() == 101 and cache.get_mask_sizes(1, 0) == (4 + 16 + 1, 101 - 20)


def test_bytes_per_token_match_the_engine_for_the_bundled_model_shape():
    sizes = bytes_per_token(smollm2_135m_hf(torch_dtype="bfloat16"))
    assert sizes["auto"] == 23040 and sizes["int8"] == 11880
    assert sizes["int4"] == pytest.approx(6423.75) and sizes["int2"] == pytest.approx(3543.75)


# --- SnapKVCache ---------------------------------------------------------------------------------


def test_a_budget_covering_the_prompt_gives_dynamic_cache_output(model, prompt):
    expected = _greedy(model, prompt, DynamicCache())
    assert torch.equal(_greedy(model, prompt, SnapKVCache(budget=100, window=16, model=model)), expected)


def test_snapkv_keeps_what_the_window_attends_to_most_and_unhooks_itself(arch_model, prompt):
    model = arch_model
    cache = SnapKVCache(budget=24, window=8, kernel=5, model=model)
    _greedy(model, prompt, cache)
    assert all(layer.keys.shape[-2] == 24 + 29 for layer in cache.layers)  # the budget, then 29 generated
    assert cache.get_seq_length() == prompt.shape[1] + 29
    assert not any(m._forward_pre_hooks for m in model.modules())
    # The same choice from the model's own attention weights over the whole prompt.
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            attentions = model(prompt, output_attentions=True).attentions
    finally:
        model.set_attn_implementation("sdpa")
    length = prompt.shape[1]
    for layer, weights in zip(cache.layers, attentions):
        votes = weights[:, :, -8:, : length - 8].sum(2).view(prompt.shape[0], KV_HEADS, -1, length - 8).sum(2)
        pooled = torch.nn.functional.avg_pool1d(votes.flatten(0, 1).unsqueeze(1), 5, 1, 2, False, False)
        assert torch.equal(layer.kept, keep_top(pooled.view(votes.shape), 24 - 8, 8))


def test_snapkv_arguments_are_checked(model):
    with pytest.raises(ValueError, match="budget=8 must be an integer > window=8"):
        SnapKVCache(budget=8, window=8, model=model)
    with pytest.raises(ValueError, match="kernel=4 must be a positive odd integer"):
        SnapKVCache(budget=32, window=8, kernel=4, model=model)
    with pytest.raises(ValueError, match="needs the model"):
        SnapKVCache(budget=32, window=8)


# --- the bundled model, loaded by transformers from its GGUF ----------------------------------------


@pytest.fixture(scope="module")
def smollm(bundled_transformers_model):
    return bundled_transformers_model


def test_the_bundled_model_generates_the_same_with_covering_caches(smollm):
    ids = torch.tensor([[1, 504, 3575, 282, 4649, 314, 12, 504, 3575, 282, 4649, 314]])
    expected = smollm.generate(
        ids, max_new_tokens=24, min_new_tokens=24, do_sample=False, past_key_values=DynamicCache()
    )
    for cache in (
        KVBankQuantizedCache("int4", residual_length=64),
        KVBankQuantizedCache("int8", residual_length=64),
        SinkWindowCache(sinks=4, window=64, model=smollm),
    ):
        assert torch.equal(
            smollm.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False, past_key_values=cache), expected
        )
    stored = KVBankQuantizedCache("int4", residual_length=0)  # head dim 64: groups of 64
    out = smollm.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False, past_key_values=stored)
    assert out.shape == expected.shape and stored.layers[0].num_stored == 32


def test_the_bundled_model_scores_text_as_the_engine_does_in_each_codec(smollm):
    """Per-token log-probabilities of 64 tokens of text (4 blocks: int4/int2 tokens see earlier
    blocks stored and their own block exact; int8/fp8 see every token stored), float32, the text
    fed in 16-token chunks, against the engine's prompt_logprobs in the same format through its
    reference attention (--no-batch-invariant; the default native kernel rounds differently, and
    a quantized cache turns rounding into different codes: over longer texts both paths and this
    cache agree in perplexity within 0.5%, bench/hf_cache.py). The engine prefills in the same
    16-token chunks: with the whole text in one step its matmuls have other shapes, which on some
    CPUs round differently, and a last-bit difference in a key is a different int8 code."""
    scores = {}
    for kv in ["auto", *QUANTIZED_DTYPES]:
        llm = LLM(
            dtype="float32",
            kv_cache_dtype=kv,
            kv_cache_memory_gb=0.05,
            enable_prefix_caching=False,
            batch_invariant=False,
            max_num_batched_tokens=BLOCK_SIZE,
        )
        ids = llm.get_tokenizer().encode(TEXT)[:64]
        out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
        engine = torch.tensor([scored[t].logprob for scored, t in zip(out.prompt_logprobs[1:], ids[1:])])
        del llm
        cache = DynamicCache() if kv == "auto" else KVBankQuantizedCache(kv, residual_length=0)
        ours = []
        with torch.no_grad():
            for start in range(0, 64, BLOCK_SIZE):
                logits = smollm(torch.tensor([ids[start : start + BLOCK_SIZE]]), past_key_values=cache).logits[0]
                targets = (ids + [0])[start + 1 : start + BLOCK_SIZE + 1]  # the last one is cut below
                ours.append(logits.log_softmax(-1)[torch.arange(BLOCK_SIZE), targets])
        ours = torch.cat(ours)[:63]
        assert (ours - engine).abs().max() < 2e-3, kv
        assert abs(ours.mean() - engine.mean()) < 1e-3, kv  # perplexity within 0.1%
        scores[kv] = engine
    # The formats do change the scores (int2 and fp8_e5m2 by far more than the tolerance above).
    for kv in ("int2", "fp8_e5m2"):
        assert (scores[kv] - scores["auto"]).abs().max() > 0.05, kv
