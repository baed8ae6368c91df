"""Cache features together: long-context policies on quantized KV (run, swapped whole, or refused
naming both features) with a host tier behind the pool, and streams with recall on every layout.

The matrix is policy x kv_cache_dtype (x swap). Dense pools are covered by tests/test_kv_policies.py;
the edits themselves (rotation, slot and token moves) per layout by tests/test_kv_layers.py.
"""

from pathlib import Path

import pytest
import torch
from policy_reference import Recorder, assert_lead_unread, cache_reference_logits
from stream_notes import NOTES

from kvbank import LLM, SamplingParams
from kvbank.attention.rope import apply_rope, rotation_tables
from kvbank.cache.policies import parse_policy

SHIFTING = ["sink_window(sinks=4,window=64)", "context_shift(keep=16)"]
SCORED = ["h2o(heavy=40,recent=40)", "snapkv(budget=96,window=16)"]
#: the policies each quantized layout runs; the rest are refused
RUNS = {"int8": SHIFTING + SCORED, "fp8_e4m3": SHIFTING + SCORED, "int4": SHIFTING, "int2": SHIFTING}


@pytest.fixture(scope="module", params=sorted(RUNS))
def llm(request):
    # The default configuration (bfloat16, packed weights, batch-invariant) with a quantized pool;
    # a small context so that context_shift shifts and every policy evicts within 250 tokens; a host
    # tier takes what the policies' sequences share and what streams evict. A tier load waits as
    # long as it takes (by default one slower than recomputing is abandoned, which on a busy
    # machine would turn a served prefix into a recomputed one).
    return LLM(
        kv_cache_dtype=request.param,
        max_model_len=256,
        num_gpu_blocks=96,
        max_num_batched_tokens=64,
        kv_host_gb=0.05,
        kv_tier_load_timeout=120.0,
    )


@pytest.fixture(scope="module")
def text_ids(llm):
    text = (Path(__file__).parent / "data" / "austen_excerpt.txt").read_text()
    return llm.get_tokenizer().encode(text)


def _all_free(llm) -> bool:
    manager = llm.engine.manager
    return manager.num_free_blocks == llm.engine.num_blocks and all(b.ref_count == 0 for b in manager.pool.blocks)


def _params(policy: str, max_tokens: int = 48) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, kv_policy=policy)


@pytest.mark.parametrize("policy", SHIFTING + SCORED)
def test_each_policy_runs_on_quantized_kv_or_is_refused_naming_both(llm, text_ids, policy):
    dtype, name = llm.engine.config.kv_cache_dtype, parse_policy(policy).name
    prompt = {"prompt_token_ids": text_ids[: 250 if name == "context_shift" else 180]}
    if policy not in RUNS[dtype]:
        with pytest.raises(ValueError, match=rf"kv_policy={name}\(.*\) cannot run with kv_cache_dtype='{dtype}'"):
            llm.generate([prompt], _params(policy))
        assert _all_free(llm)
        return
    evicted = llm.engine.stats()[f"evicted_tokens_{name}"]
    out = llm.generate([prompt], _params(policy))[0].outputs[0]
    assert len(out.token_ids) == 48
    assert llm.engine.stats()[f"evicted_tokens_{name}"] > evicted
    assert _all_free(llm)


@pytest.mark.parametrize("which", [0, -1], ids=["sink_window", "last_that_runs"])
def test_a_preempted_policy_sequence_on_quantized_kv_is_swapped_whole_and_keeps_its_tokens(llm, text_ids, which):
    policy = RUNS[llm.engine.config.kv_cache_dtype][which]  # sink_window, and snapkv or context_shift
    # Both runs compute the prompt in the same chunks (no prefix hits): a policy's evictions follow them.
    ids = text_ids[: 250 if policy.startswith("context_shift") else 180]
    engine = llm.engine
    engine.reset_prefix_cache()
    alone = llm.generate([{"prompt_token_ids": ids}], _params(policy, 30))[0].outputs[0].token_ids
    engine.reset_prefix_cache()
    request = engine.add_request(ids, _params(policy, 30))
    seq = request.seqs[0]
    ready = lambda: seq.num_evicted and seq.num_output_tokens > 5 and seq.num_computed_tokens % 16
    while engine.requests and not ready():
        engine.step()  # evicted, and its last block open (for int4/int2: in a residual slot)
    assert ready(), "the sequence finished before it evicted with an open block"
    swaps, saved_mode = engine.swapper.num_swaps_out, engine.swapper.mode
    engine.swapper.mode = "swap"
    try:
        engine.scheduler._preempt(seq)
        while engine.requests:
            engine.step()
    finally:
        engine.swapper.mode = saved_mode
    assert engine.swapper.num_swaps_out == swaps + 1
    assert seq.output_token_ids == alone
    assert _all_free(llm)


@pytest.mark.parametrize("policy", SHIFTING)
def test_the_prefix_an_evicting_sequence_computed_before_evicting_reaches_the_tier_and_is_served(llm, text_ids, policy):
    """What an evicting sequence can still share (its blocks computed before the first eviction)
    goes to the host tier from a quantized pool, and nothing computed after it; once the pool has
    dropped it, another request with that prefix loads exactly that from the tier."""
    engine = llm.engine
    ids = text_ids[300:550] if policy.startswith("context_shift") else text_ids[300:480]
    engine.reset_prefix_cache()
    request = engine.add_request(ids, _params(policy, 8))
    seq = request.seqs[0]
    while engine.requests:
        engine.step()
    assert seq.num_evicted
    published = len(seq.chain_serials)  # indexed before the first eviction, never after
    assert published > 0
    assert engine.offload.flush()
    assert llm.reset_prefix_cache() > 0  # the pool forgets; the tier keeps
    loads = llm.tier_stats()["offload"]["loads"]
    timeouts = llm.tier_stats()["offload"]["load_timeouts"]
    again = llm.generate([{"prompt_token_ids": ids + [13, 14, 15]}], _params("full", 2))[0]
    assert llm.tier_stats()["offload"]["load_timeouts"] == timeouts
    bs = engine.block_size
    if policy.startswith("sink_window"):
        # the window evicted during the prompt: its later blocks were never published
        assert published < len(ids) // bs and again.num_cached_tokens == published * bs
    else:
        # context_shift shifts once the context is full, after the prompt: the whole prompt was
        # published, and the tier serves whole stored chunks of it
        assert published >= len(ids) // bs and 0 < again.num_cached_tokens <= (len(ids) + 2) // bs * bs
        assert again.num_cached_tokens % bs == 0
    assert llm.tier_stats()["offload"]["loads"] == loads + 1
    assert _all_free(llm)


#: six notes that leave the window, then one it keeps
KEPT = NOTES[:6] + NOTES[-1:]


def test_streams_run_with_recall_on_every_quantized_kv_layout(llm):
    """Frames leave from the middle of a stream, so tokens move between blocks: per token on int8
    and fp8, a block at a time on int4 and int2 (whose keys share a range per block)."""
    dtype = llm.engine.config.kv_cache_dtype
    system = "You read notes one at a time and answer questions about them briefly."
    with llm.open_stream(system, policy="frame_window(frames=2,sinks=4)") as session:
        blocks = []
        for i, (who, what, value) in enumerate(KEPT):
            session.append(f"Note {i}: the {what} of {who} is {value}.")
            blocks.append(session.stats()["blocks"])
        assert session.stats()["evicted_frames"] == 5 and session.stats()["recallable_frames"] == 5
        assert max(blocks[2:]) <= blocks[2] + 1, blocks  # the window's blocks, not the stream's
        answer = session.ask("What is the height of the volcano?", SamplingParams(temperature=0, max_tokens=12))
        if dtype != "int2":  # 2-bit keys: this model's answer changes with the kernel variant, evictions or not
            assert "3,200" in answer.outputs[0].text  # a kept frame, read from the quantized pool
        assert answer.outputs[0].token_ids
        recalled = session.ask(
            "What is the locker code of Maria?", SamplingParams(temperature=0, max_tokens=4), recall=2
        )
        assert len(recalled.recalled_frames) == 2 and session.stats()["recall_recalled"] == 2
        assert session.stats()["recall_corrupt"] == session.stats()["recall_missing"] == 0
        assert len(recalled.outputs[0].token_ids) == 4
    assert _all_free(llm)


def test_a_streams_rows_never_read_the_slots_before_its_lead(llm):
    """After frames left, a stream's sequence starts `lead` slots into its first block; the
    default configuration's kernels (the fused stack, every format) start each row there: garbage
    written into those slots changes no token and no logprob of a question."""
    system = "You read notes one at a time and answer questions about them briefly."
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    with llm.open_stream(system, policy="frame_window(frames=2,sinks=4)") as session:
        for i, (who, what, value) in enumerate(KEPT):
            session.append(f"Note {i}: the {what} of {who} is {value}.")
        assert_lead_unread(llm, session, "What is the height of the volcano?", params)
    assert _all_free(llm)


# --- logits on a quantized cache after evictions, against a plain forward over what it holds --------


def _pool_contents(engine, seq) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the (keys, values) [slots, kv_heads, dim] the pool holds for `seq`'s slots, in
    float32: per-token layers' codes dequantized; KIVI's full blocks dequantized, its open block
    from its residual slot."""
    bs, n = engine.block_size, seq.num_slots
    table = torch.tensor(seq.block_table[: -(-n // bs)])
    out = []
    for layer in engine.storage.layers:
        if hasattr(layer, "residual"):
            keys, values = (x[0].float() for x in layer.read(table.unsqueeze(0)))
            if n % bs:
                slot = layer.residual.of_block[seq.block_table[n // bs]]
                start = n // bs * bs
                keys[start:] = layer.residual.k[layer.index][slot].float()[: keys.shape[0] - start]
                values[start:] = layer.residual.v[layer.index][slot].float()[: values.shape[0] - start]
        else:
            slots = table[torch.arange(n) // bs] * bs + torch.arange(n) % bs
            keys, values = layer.token_values(slots, torch.float32)
        out.append((keys[:n], values[:n]))
    return out


def _rotated(recorder, engine, seq, layer: int) -> torch.Tensor:
    """The keys [slots, kv_heads, dim] the policy's semantics put in `seq`'s slots of `layer`: each
    held token's recorded key rotated (float64 tables) to position slot + rope_offset."""
    held = engine.editor.held_tokens(seq, len(engine.storage.layers), engine.model_config.num_kv_heads)[layer, 0]
    keys, _ = recorder.kv(layer)
    positions = torch.arange(held.shape[0]) + seq.rope_offset
    cos, sin = rotation_tables(positions, recorder.model.rope_inv_freq)
    return apply_rope(keys[held].double(), cos[:, None].double(), sin[:, None].double()).float()


def _codec_step(layer, exact: torch.Tensor, block_size: int) -> torch.Tensor:
    """The largest error of storing `exact` keys [slots, kv_heads, dim] once in `layer`'s format
    (KIVI: its whole blocks; an open block stays in full precision)."""
    codec = layer.codecs[0]
    if hasattr(layer, "residual"):
        exact = exact[: exact.shape[0] // block_size * block_size].reshape(-1, block_size, *exact.shape[1:])
    return (codec.dequantize(codec.quantize(exact), torch.float32) - exact).abs().max()


def _own_writes(layers) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Hook every layer's write: the dict then holds, per layer, the last K/V it wrote (until
    `del layer.write` takes the hook off)."""
    own = {}
    for index, layer in enumerate(layers):

        def write(k, v, meta, layer=layer, index=index, original=layer.write):
            own[index] = (k[-1].clone(), v[-1].clone())
            return original(k, v, meta)

        layer.write = write
    return own


def _as_attended(layers, stored: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, a step's own K/V as its attention reads them: KIVI unquantized (the step's
    scratch block), a per-token layout through its codecs."""
    if hasattr(layers[0], "residual"):
        return [stored[i] for i in range(len(layers))]
    return [
        tuple(
            codec.dequantize(codec.quantize(x.unsqueeze(0)), torch.float32)[0]
            for codec, x in zip(layers[i].codecs, stored[i])
        )
        for i in range(len(layers))
    ]


@pytest.fixture(scope="module", params=["int8", "int4"])
def float32_llm(request):
    return LLM(
        dtype="float32", kv_cache_dtype=request.param, max_model_len=256, num_gpu_blocks=96, max_num_batched_tokens=64
    )


@pytest.mark.parametrize("policy", SHIFTING)
def test_logits_after_evictions_on_quantized_kv_equal_a_forward_over_the_dequantized_cache(float32_llm, policy):
    """Decode steps after the policy evicted (block moves, sink re-rotation in quantized form,
    rebases): the pool holds each kept token's key rotated to its slot's position within a few
    codec steps, and the engine's logits equal a plain float32 forward whose attention reads
    exactly the pool's dequantized K/V of the kept slots at RoPE positions slot + rope_offset, then
    the token's own K/V as the engine stored it. Float32 (the reference's dtype); the bfloat16
    default runs the same edits in the matrix tests above."""
    engine = float32_llm.engine
    engine.reset_prefix_cache()  # the recorder must see every token computed
    text = (Path(__file__).parent / "data" / "austen_excerpt.txt").read_text()
    ids = float32_llm.get_tokenizer().encode(text)[: 250 if policy.startswith("context_shift") else 180]
    layers = engine.storage.layers
    recorder, own = Recorder(engine), _own_writes(layers)
    try:
        request = engine.add_request(ids, _params(policy, 40))
        seq = request.seqs[0]
        checks, logits, owners, eligible = [], [], [], 0
        while engine.requests:
            check = seq.num_computed_tokens >= seq.num_prompt_tokens and seq.num_pending == 1 and seq.num_evicted
            check = check and (eligible := eligible + 1) % 3 == 1  # every third step: the reference is slow
            if check:
                cache = _pool_contents(engine, seq)
                for index in (0, len(layers) // 2, len(layers) - 1):
                    exact = _rotated(recorder, engine, seq, index)
                    bound = 3 * _codec_step(layers[index], exact, engine.block_size)
                    assert (cache[index][0] - exact).abs().max() <= bound, f"layer {index}: keys off their positions"
                position = seq.num_slots + seq.rope_offset
                checks.append([seq.token_ids[seq.num_computed_tokens], position, cache, None])
            engine.step()
            if check:
                logits.append(recorder.logits[-1][0])
                owners.append(dict(own))
        assert len(checks) >= 10, "the policy evicted too late for the check to mean anything"
        for check, stored in zip(checks, owners):
            check[3] = _as_attended(layers, stored)
        expected = cache_reference_logits(recorder, [tuple(c) for c in checks])
        for i, got in enumerate(logits):
            torch.testing.assert_close(got, expected[i], atol=2e-4, rtol=1e-4, msg=lambda m, i=i: f"check {i}: {m}")
    finally:
        recorder.remove()
        for layer in layers:
            del layer.write  # _own_writes' hook
    assert engine.stats()[f"evicted_tokens_{parse_policy(policy).name}"] > 0


def test_a_streams_quantized_pool_holds_each_kept_tokens_kv_at_its_position(float32_llm):
    """After many frames left a stream, nothing after them moved: token i sits at slot lead + i
    (the lead's whole blocks gone), its value exactly as first stored (an open block's in full
    precision), its key rotated to slot + rope_offset within a few codec steps however many frames
    came and went (int4/int2: no block is quantized again as the window moves, only the blocks the
    leading tokens are written into). A one-token question's logits then equal a plain float32
    forward over exactly those slots, so the slots before the lead (old tokens) are never read."""
    engine, frames = float32_llm.engine, 3
    layers = engine.storage.layers
    recorder, own = Recorder(engine), _own_writes(layers)
    try:
        system = "You read notes one at a time."
        with float32_llm.open_stream(system, policy=f"frame_window(frames={frames},sinks=4)") as session:
            for i in range(24):
                who, what, value = NOTES[i % len(NOTES)]
                session.append(f"Note {i}: the {what} of {who} is {value}.")
            seq = engine.streams_host.get(session.stream_id).seq
            assert session.stats()["evicted_frames"] == 24 - frames
            n, keep, bs, lead = seq.num_slots, seq.frames.keep_tokens, engine.block_size, seq.lead
            assert 0 < lead < bs and n - lead == seq.num_computed_tokens
            pool = _pool_contents(engine, seq)
            cache = [(k[lead:], v[lead:]) for k, v in pool]  # token order
            opened = n // bs * bs if hasattr(layers[0], "residual") and n % bs else n
            in_open = torch.arange(lead, n) >= opened  # tokens in KIVI's open block
            positions = torch.arange(lead, n) + seq.rope_offset
            for index in (0, len(layers) // 2, len(layers) - 1):
                layer, (k, v) = layers[index], recorder.kv(index)
                total = k.shape[0]
                held = torch.cat((torch.arange(keep), torch.arange(total - (n - lead - keep), total)))
                codec = layer.codecs[1]
                stored = codec.dequantize(codec.quantize(v[held]), torch.float32)
                assert torch.equal(cache[index][1][~in_open], stored[~in_open]), f"layer {index}: values"
                for token in in_open.nonzero().flatten().tolist():  # as written, or as stored and moved in
                    assert torch.equal(cache[index][1][token], v[held][token]) or torch.equal(
                        cache[index][1][token], stored[token]
                    )
                cos, sin = rotation_tables(positions, recorder.model.rope_inv_freq)
                exact = apply_rope(k[held].double(), cos[:, None].double(), sin[:, None].double()).float()
                bound = 3 * _codec_step(layer, exact, bs)
                assert (cache[index][0] - exact).abs().max() <= bound, f"layer {index}: keys off their positions"
            token = float32_llm.get_tokenizer().encode(" Note", add_special_tokens=False)[0]
            session.ask([token], SamplingParams(temperature=0, max_tokens=1))
            got = recorder.logits[-1][0]
            mine = _as_attended(layers, own)
            expected = cache_reference_logits(recorder, [(token, n + seq.rope_offset, cache, mine)])[0]
            torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)
    finally:
        recorder.remove()
        for layer in layers:
            del layer.write  # _own_writes' hook
    assert _all_free(float32_llm)
