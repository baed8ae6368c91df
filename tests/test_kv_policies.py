"""Long-context KV policies: spelling, limits, exactness against a reference, bounded memory."""

import math
import re

import pytest
import torch
from policy_reference import Recorder, attention_weights, reference_logits
from tiny_models import tiny_llama_config

from kvbank import LLM, SamplingParams
from kvbank.cache.limits import EDITS, TOKEN_EDITS
from kvbank.cache.policies import H2O, ContextShift, FrameWindow, Limits, SinkWindow, SnapKV, parse_policy

BS = 16


@pytest.fixture(scope="module")
def llm():
    # A small context so that context_shift shifts and every policy evicts within a few hundred tokens.
    return LLM(dtype="float32", max_model_len=256, num_gpu_blocks=96, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def default_llm():
    """The same small engine in the default configuration (bfloat16, packed weights, batch-invariant),
    for what does not compare logits against a float32 reference: bookkeeping, forks, preemption."""
    return LLM(max_model_len=256, num_gpu_blocks=96, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def text_ids(llm):
    from pathlib import Path

    text = (Path(__file__).parent / "data" / "austen_excerpt.txt").read_text()
    return llm.get_tokenizer().encode(text)


def _assert_all_free(llm):
    manager = llm.engine.manager
    assert manager.num_free_blocks == llm.engine.num_blocks
    assert all(block.ref_count == 0 for block in manager.pool.blocks)


# --- spelling and errors -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("full", "full"),
        ("sink_window(sinks=4,window=1024)", "sink_window(sinks=4,window=1024)"),
        (" sink_window( window = 512 ) ", "sink_window(sinks=4,window=512)"),
        ("h2o(heavy=256,recent=256)", "h2o(heavy=256,recent=256)"),
        ("snapkv(budget=1024,window=64,kernel=5)", "snapkv(budget=1024,window=64,kernel=5)"),
        ("snapkv(compression_ratio=0.75)", "snapkv(window=64,kernel=5,compression_ratio=0.75)"),
        ("context_shift(keep=256)", "context_shift(keep=256)"),
    ],
)
def test_policy_spelling_round_trips(spec, expected):
    policy = parse_policy(spec)
    assert str(policy) == expected
    assert parse_policy(str(policy)) == policy
    assert SamplingParams(kv_policy=spec).kv_policy == policy


def test_policy_objects_are_accepted_as_they_are():
    policy = SinkWindow(sinks=8, window=256)
    assert SamplingParams(kv_policy=policy).kv_policy is policy


@pytest.mark.parametrize(
    "spec, message",
    [
        ("lru", "is not one of full, sink_window, h2o, snapkv, context_shift"),
        ("sink_window(window=-5)", "window=-5 must be an integer >= 1"),
        ("sink_window(sinks=-1)", "sinks=-1 must be an integer >= 0"),
        ("sink_window(size=5)", "'size=5' is not a parameter of sink_window"),
        ("h2o(heavy=1.5)", "heavy=1.5 must be an integer >= 0"),
        ("snapkv(budget=32,window=64)", "budget=32 must be an integer >= 65"),
        ("snapkv(compression_ratio=1.5)", "compression_ratio=1.5 must be in [0, 1)"),
        ("snapkv(kernel=4)", "kernel=4 must be odd"),
        ("snapkv(budget=100,compression_ratio=0.5)", "gives both budget and compression_ratio"),
        ("context_shift(keep=x)", "keep='x' must be a number"),
    ],
)
def test_bad_policies_are_refused_with_the_value(spec, message):
    with pytest.raises(ValueError, match="kv_policy") as error:
        SamplingParams(kv_policy=spec)
    assert message in str(error.value)


def test_engine_refuses_policies_it_cannot_hold(llm, text_ids):
    engine = llm.engine
    with pytest.raises(ValueError, match=r"holds up to 2080 tokens per sequence \(130 KV blocks\).*only 96 blocks"):
        engine.add_request([1, 2, 3], SamplingParams(kv_policy="h2o(heavy=2000,recent=64)"))
    with pytest.raises(ValueError, match="past the model's context of 256"):
        engine.add_request([1, 2, 3], SamplingParams(kv_policy="sink_window(sinks=4,window=200)"))
    with pytest.raises(ValueError, match="leaves no room to generate; a kv_policy such as sink_window runs past it"):
        engine.add_request(text_ids[:300], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="exceeds max_model_len=256; a kv_policy such as sink_window runs past it"):
        engine.add_request(text_ids[:200], SamplingParams(max_tokens=100))
    # Compressing policies keep the tokens' own positions, so they stay within the context.
    with pytest.raises(ValueError, match="exceeds max_model_len=256$"):
        engine.add_request(text_ids[:200], SamplingParams(max_tokens=100, kv_policy="snapkv(budget=96,window=16)"))
    assert not engine.requests
    _assert_all_free(llm)


#: which policies each KV layout runs (the rest are refused, naming the policy and the dtype)
RUNS_ON = {
    "auto": {"sink_window", "context_shift", "h2o", "snapkv", "frame_window"},
    "int8": {"sink_window", "context_shift", "h2o", "snapkv", "frame_window"},
    "int4": {"sink_window", "context_shift"},
}
EDITS_OF = {"auto": frozenset(EDITS), "int8": TOKEN_EDITS, "int4": frozenset({"rotate"})}


@pytest.mark.parametrize("dtype", sorted(RUNS_ON))
@pytest.mark.parametrize("spec", ["sink_window(window=64)", "context_shift", "h2o", "snapkv", "frame_window"])
def test_each_kv_layout_runs_the_policies_its_edits_allow_and_refuses_the_rest(spec, dtype):
    limits = Limits(BS, 4096, 8192, 256, kv_edits=EDITS_OF[dtype], kv_cache_dtype=dtype)
    policy = FrameWindow() if spec == "frame_window" else parse_policy(spec)  # a stream's, not a request's
    if policy.name in RUNS_ON[dtype]:
        policy.check(limits)
    else:
        with pytest.raises(
            ValueError, match=rf"kv_policy={re.escape(str(policy))} cannot run with kv_cache_dtype='{dtype}'"
        ):
            policy.check(limits)
    parse_policy("full").check(limits)


# --- exactness ---------------------------------------------------------------------------------


def _budget_covers_everything(llm, ids, policy):
    params = dict(temperature=0, max_tokens=24, logprobs=2)
    full = llm.generate([{"prompt_token_ids": ids}], SamplingParams(**params))[0].outputs[0]
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(**params, kv_policy=policy))[0].outputs[0]
    return full, out


@pytest.mark.parametrize(
    "policy",
    [
        "sink_window(sinks=4,window=160)",
        "context_shift(keep=32)",
        "h2o(heavy=100,recent=100)",
        "snapkv(budget=200,window=16)",
        "snapkv(compression_ratio=0.0,window=16)",
    ],
)
def test_policies_whose_budget_covers_the_sequence_equal_full(llm, text_ids, policy):
    full, out = _budget_covers_everything(llm, text_ids[:150], policy)
    assert out.token_ids == full.token_ids
    chosen = lambda completion: [e[t].logprob for e, t in zip(completion.logprobs, completion.token_ids)]
    assert chosen(out) == pytest.approx(chosen(full), abs=1e-5)
    assert llm.engine.stats()[f"evicted_tokens_{parse_policy(policy).name}"] == 0
    _assert_all_free(llm)


def _kept_and_positions(engine, seq):
    """What the documented semantics say the next step attends over: tokens and their positions."""
    c = engine.model_config
    kept = engine.editor.held_tokens(seq, c.num_layers, c.num_kv_heads)
    if seq.kv_policy.unbounded:
        # Shifting policies: positions are places in the cache; the new token sits at the next one.
        positions = torch.arange(kept.shape[-1]).expand_as(kept)
        return kept, positions, kept.shape[-1]
    return kept, kept, seq.num_computed_tokens


@pytest.mark.parametrize(
    "policy, prompt_len",
    [
        (SinkWindow(sinks=BS, window=64), 180),
        (SinkWindow(sinks=0, window=64), 180),
        (ContextShift(keep=20), 250),
        (H2O(heavy=40, recent=40), 150),
        (SnapKV(budget=96, window=16, kernel=5), 150),
    ],
    ids=str,
)
def test_logits_after_eviction_equal_a_fresh_computation_on_the_kept_tokens(llm, text_ids, policy, prompt_len):
    engine = llm.engine
    engine.reset_prefix_cache()  # the recorder must see every token computed
    recorder = Recorder(engine)
    try:
        request = engine.add_request(
            text_ids[:prompt_len], SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, kv_policy=policy)
        )
        seq = request.seqs[0]
        checks, logits = [], []
        while engine.requests:
            # A decode step on a cache the policy has already evicted from.
            check = seq.num_computed_tokens >= seq.num_prompt_tokens and seq.num_pending == 1 and seq.num_evicted
            if check:
                kept, positions, position = _kept_and_positions(engine, seq)
                checks.append((seq.token_ids[seq.num_computed_tokens], kept.clone(), positions.clone(), position))
            engine.step()
            if check:
                logits.append(recorder.logits[-1][0])
        assert len(checks) >= 40, "the policy evicted too late for the check to mean anything"
        # Every check's reference forward sees only the K/V recorded up to its step: `kept` names those rows.
        expected = reference_logits(recorder, checks)
        for i, got in enumerate(logits):
            torch.testing.assert_close(got, expected[i], atol=2e-4, rtol=1e-4, msg=lambda m, i=i: f"check {i}: {m}")
    finally:
        recorder.remove()
    assert engine.stats()[f"evicted_tokens_{policy.name}"] > 0
    _assert_all_free(llm)


def _pooled(votes: torch.Tensor, kernel: int) -> torch.Tensor:
    """The mean of each token's votes and its neighbours' within kernel // 2, fewer at the edges."""
    reach, n = kernel // 2, votes.shape[-1]
    return torch.stack([votes[..., max(0, j - reach) : j + reach + 1].mean(-1) for j in range(n)], dim=-1)


def _scores_at_prompt_end(policy, weights: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Each earlier token's score by the policy's documented rule, from attention weights
    [kv_heads, queries, keys]: H2O sums every prompt query's attention, SnapKV pools the window's."""
    if isinstance(policy, H2O):
        return weights.sum(1)[:, : prompt_len - policy.recent]
    window = weights[:, prompt_len - policy.window :, : prompt_len - policy.window].sum(1)
    return _pooled(window, policy.kernel)


@pytest.mark.parametrize(
    "policy", [H2O(heavy=40, recent=40), SnapKV(budget=96, window=16, kernel=5), SnapKV(budget=40, window=8, kernel=3)]
)
def test_scored_policies_keep_the_tokens_that_attention_computed_independently_ranks_highest(llm, text_ids, policy):
    # The kept set after the prompt, against scores recomputed in float64 from the recorded
    # queries and keys: every kept token scores at least as high as every dropped one, which a
    # choice by position or at random fails. Exactly, not up to rounding: the engine's float32
    # scores are within 3.4e-6 of a score of these (measured, every policy here), and at this
    # text's cut the lowest kept and highest dropped differ by at least 5.5e-5 of a score (H2O;
    # SnapKV 1.9e-4 and 2.4e-4), so rounding cannot reorder them.
    engine = llm.engine
    engine.reset_prefix_cache()
    prompt_len, recent = 150, policy.recent if isinstance(policy, H2O) else policy.window
    recorder = Recorder(engine)
    try:
        request = engine.add_request(
            text_ids[:prompt_len], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, kv_policy=policy)
        )
        seq = request.seqs[0]
        while seq.num_computed_tokens < prompt_len:
            engine.step()
        c = engine.model_config
        kept = engine.editor.held_tokens(seq, c.num_layers, c.num_kv_heads)
        weights = [attention_weights(recorder, layer) for layer in range(c.num_layers)]
        while engine.requests:
            engine.step()
    finally:
        recorder.remove()
    top = policy.heavy if isinstance(policy, H2O) else policy.budget - policy.window
    assert kept.shape[-1] == top + recent
    window = torch.arange(prompt_len - recent, prompt_len)
    for layer in range(c.num_layers):
        scores = _scores_at_prompt_end(policy, weights[layer], prompt_len)
        for head in range(c.num_kv_heads):
            chosen = kept[layer, head]
            assert torch.equal(chosen[top:], window), (layer, head)
            held = torch.zeros(scores.shape[-1], dtype=torch.bool)
            held[chosen[:top]] = True
            lowest_kept, highest_dropped = scores[head][held].min(), scores[head][~held].max()
            assert lowest_kept >= highest_dropped, (layer, head, lowest_kept, highest_dropped)
    _assert_all_free(llm)


def test_sink_window_keeps_the_sinks_and_a_block_granular_window(default_llm, text_ids):
    engine = default_llm.engine
    request = engine.add_request(
        text_ids[:100],
        SamplingParams(temperature=0, max_tokens=170, ignore_eos=True, kv_policy="sink_window(sinks=4,window=64)"),
    )
    seq = request.seqs[0]
    seen = set()
    while engine.requests:
        engine.step()
        if seq.num_evicted and not seq.is_finished:
            recent = seq.num_slots - BS  # 4 sinks take one whole block
            assert 64 <= recent < 64 + BS
            held = engine.editor.held_tokens(seq, 1, 1)[0, 0].tolist()
            assert held[:BS] == list(range(BS))
            assert held[BS:] == list(range(seq.num_computed_tokens - recent, seq.num_computed_tokens))
            seen.add(len(seq.block_table) + len(seq.pristine_blocks))
    # 270 tokens through a cache of about 100, past the context of 256.
    assert request.seqs[0].num_tokens == 270 and seen and max(seen) <= 1 + 5 + 1 + 1
    _assert_all_free(default_llm)


# --- constant memory far past the context --------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A random Llama small enough to run 15,000 tokens (15 times its context) in seconds; memory
    bookkeeping is what is tested here (accuracy is tested on the bundled model above)."""
    transformers = pytest.importorskip("transformers")
    config = tiny_llama_config(
        vocab_size=320, hidden_size=256, intermediate_size=256, max_position_embeddings=1024, tie_word_embeddings=True
    )
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny-llama")
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return str(folder)


def _blocks_in_use(engine) -> int:
    return engine.num_blocks - engine.manager.num_free_blocks


def _run_counting_blocks(engine, prompt, params) -> tuple[list[int], object]:
    request = engine.add_request(prompt, params)
    used = []
    while engine.requests:
        engine.step()
        used.append(_blocks_in_use(engine))
    return used, request


@pytest.mark.slow
def test_sink_window_scores_10k_tokens_and_generates_5k_in_constant_blocks(tiny_folder):
    # The default configuration otherwise: bfloat16, batch-invariant native attention.
    llm = LLM(tiny_folder, num_gpu_blocks=64, max_num_batched_tokens=256)
    engine, policy = llm.engine, "sink_window(sinks=4,window=256)"
    bound = 1 + 16 + 1 + 16 + 1  # sinks (and their pristine copy), window, one block more, a chunk
    tokens = torch.randint(0, 320, (10_000,), generator=torch.Generator().manual_seed(1)).tolist()
    used, request = _run_counting_blocks(
        engine, tokens, SamplingParams(max_tokens=1, prompt_logprobs=0, kv_policy=policy)
    )
    assert len(request.prompt_logprobs) == 10_000
    assert all(math.isfinite(entry[t].logprob) for entry, t in zip(request.prompt_logprobs[1:], tokens[1:]))
    # Admission reserves the policy's whole bound at once; from the first eviction on the count is flat.
    steady = used[3:-1]  # the last step finishes the request
    assert max(used) <= bound and max(steady) - min(steady) <= 1, (max(used), min(steady), max(steady))
    assert _blocks_in_use(engine) == 0

    used, request = _run_counting_blocks(
        engine, tokens[:50], SamplingParams(max_tokens=5_000, ignore_eos=True, temperature=0, kv_policy=policy)
    )
    assert request.seqs[0].num_output_tokens == 5_000
    steady = used[len(used) // 10 : -1]
    window_bound = 1 + 16 + 1 + 1 + 1  # sinks, their pristine copy, window, a block more, the open block
    assert max(used) <= bound and max(steady) <= window_bound and max(steady) - min(steady) <= 1
    assert _blocks_in_use(engine) == 0
    assert engine.stats()["evicted_tokens_sink_window"] >= 10_000 + 5_000 - 2 * 300


@pytest.mark.parametrize("policy", ["sink_window(sinks=4,window=64)", "snapkv(budget=96,window=16)"])
def test_n_completions_fork_a_policys_cache_and_each_equals_one_alone(default_llm, text_ids, policy):
    params = dict(temperature=0, max_tokens=30, ignore_eos=True, kv_policy=policy)
    prompt = {"prompt_token_ids": text_ids[:200]}
    alone = default_llm.generate([prompt], SamplingParams(**params))[0].outputs[0].token_ids
    both = default_llm.generate([prompt], SamplingParams(n=2, **params))[0].outputs
    assert [o.token_ids for o in both] == [alone, alone]
    _assert_all_free(default_llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_preempted_sequence_that_evicted_is_recomputed_or_swapped_whole(default_llm, text_ids, mode):
    # With swap off it is recomputed from its tokens (its cache state reset); with swap it leaves
    # whole and comes back with its evictions, rotary offset and sink copies as they were
    # (tests/test_swap.py checks that it then gives the tokens it gives alone).
    engine = default_llm.engine
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, kv_policy="sink_window(sinks=4,window=64)")
    request = engine.add_request(text_ids[:200], params)
    seq = request.seqs[0]
    while not (seq.num_evicted and seq.num_output_tokens > 5):
        engine.step()
    swaps, saved_mode = engine.swapper.num_swaps_out, engine.swapper.mode
    state = (seq.num_computed_tokens, seq.num_evicted, seq.rope_offset, len(seq.pristine_blocks))
    engine.swapper.mode = mode
    try:
        engine.scheduler._preempt(seq)
        assert (seq.num_computed_tokens, seq.num_evicted, seq.rope_offset, seq.pristine_blocks) == (0, 0, 0, [])
        engine.step()  # back in: recomputing from the first token, or exactly as it left
        if mode == "swap":
            assert (seq.num_computed_tokens - 1, seq.num_evicted, seq.rope_offset, len(seq.pristine_blocks)) == state
        while engine.requests:
            engine.step()
    finally:
        engine.swapper.mode = saved_mode
    assert seq.num_output_tokens == 30 and engine.swapper.num_swaps_out == swaps + (mode == "swap")
    _assert_all_free(default_llm)


@pytest.mark.parametrize("policy", ["sink_window(sinks=4,window=64)", "context_shift(keep=16)"])
def test_prefix_hits_longer_than_the_window_stay_within_the_positions(default_llm, text_ids, policy):
    # A cached prefix longer than what the policy keeps is used only as far as the positions allow.
    default_llm.generate([text_ids[:240]], SamplingParams(max_tokens=4))
    out = default_llm.generate([text_ids[:340]], SamplingParams(temperature=0, max_tokens=8, kv_policy=policy))[0]
    assert len(out.outputs[0].token_ids) == 8 and 0 < out.num_cached_tokens <= 256 - 64
    _assert_all_free(default_llm)
