"""Prompt caching on the bundled model: exact outputs, whole-block hits, salts, pressure, pins."""

import pytest

from kvbank import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
SYSTEM = (
    "You are a careful assistant for a public library. You answer questions about opening hours, "
    "borrowing rules, late fees and events, briefly and politely, and you never invent facts."
)
QUESTIONS = [
    "When do you open on Saturdays?",
    "How many books can I borrow?",
    "Is there a fee for late DVDs?",
    "Do you host a chess club?",
]


@pytest.fixture(scope="module")
def llm():
    """The default configuration: bfloat16, packed weights, batch-invariant."""
    return LLM(num_gpu_blocks=256)


def _caching(llm, on: bool) -> None:
    llm.engine.manager.enable_prefix_caching = on


def _chat_prompt(llm, question):
    return llm.render_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _generate(llm, prompts, caching=True, params=GREEDY):
    _caching(llm, caching)
    try:
        return llm.generate(prompts, params)
    finally:
        _caching(llm, True)


def test_shared_system_prompt_hits_and_outputs_are_identical(llm):
    prompts = [_chat_prompt(llm, q) for q in QUESTIONS]
    cold = _generate(llm, prompts, caching=False)
    _generate(llm, prompts[:1])  # warms the cache with the system prompt
    warm = _generate(llm, prompts)
    assert [o.outputs[0].token_ids for o in warm] == [o.outputs[0].token_ids for o in cold]
    # Only the first prompt was cached before: the others, admitted with it, share its system prompt.
    shared = [_common_prefix(prompts[0], p) for p in prompts[1:]]
    assert [o.num_cached_tokens for o in warm[1:]] == [n // 16 * 16 for n in shared]
    assert min(shared) >= 32  # two whole blocks at least: real hits
    assert all(o.num_cached_tokens == 0 for o in cold)


def test_requests_arriving_together_compute_their_shared_prompt_once(llm):
    # A cold cache and four chats on one system prompt at once: the first computes it, the others
    # wait for it to be cached (a step) and take it, instead of computing it beside the first.
    prompts = [_chat_prompt(llm, q) for q in QUESTIONS]
    cold = _generate(llm, prompts, caching=False)
    llm.engine.reset_prefix_cache()
    waits = llm.engine.stats()["num_prefix_waits"]
    together = _generate(llm, prompts)
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in cold]
    shared = [_common_prefix(prompts[0], p) for p in prompts[1:]]
    assert together[0].num_cached_tokens == 0
    assert [o.num_cached_tokens for o in together[1:]] == [n // 16 * 16 for n in shared]
    assert llm.engine.stats()["num_prefix_waits"] == waits + 3


def test_decodes_sharing_a_long_prefix_read_it_once_and_match_alone(monkeypatch):
    """The cascade decode of the non-invariant path (the default reads every row alone, so a
    shared prefix is read once per row there); float32, where that path still matches alone."""
    from pathlib import Path

    from kvbank.attention import fast

    llm = LLM(dtype="float32", batch_invariant=False, num_gpu_blocks=256)
    text = (Path(__file__).parent / "data" / "austen_excerpt.txt").read_text()
    manual = llm.render_chat([{"role": "system", "content": text[:1200]}], add_generation_prompt=False)
    prompts = [
        manual + llm.get_tokenizer().encode(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n")
        for q in QUESTIONS
    ]
    alone = [_generate(llm, [p])[0].outputs[0].token_ids for p in prompts]
    cascades = []
    decode = fast._cascade_decode
    monkeypatch.setattr(fast, "_cascade_decode", lambda q, *rest: cascades.append(q.shape[0]) or decode(q, *rest))
    together = [o.outputs[0].token_ids for o in _generate(llm, prompts)]
    assert together == alone
    assert cascades and max(cascades) == len(prompts)  # the four decodes read the manual's blocks once


def test_num_cached_tokens_counts_whole_blocks_and_keeps_the_last_token(llm):
    prompt = list(range(1000, 1048))  # exactly 3 blocks
    first = _generate(llm, [prompt])[0]
    assert first.num_cached_tokens == 0
    again = _generate(llm, [prompt])[0]
    assert again.num_cached_tokens == 32  # the last block holds the token that must run
    longer = _generate(llm, [prompt + [7, 8, 9]])[0]
    assert longer.num_cached_tokens == 48
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_multi_turn_chat_reuses_earlier_turns_including_generated_tokens(llm):
    params = SamplingParams(temperature=0, max_tokens=24)
    ids = _chat_prompt(llm, QUESTIONS[0])
    turns_cached, turns_ids = [], []
    for question in QUESTIONS[1:3]:
        out = _generate(llm, [ids], params=params)[0]
        answer = out.outputs[0].token_ids
        turns_cached.append(out.num_cached_tokens)
        # Continue the exact token sequence: prompt + answer + the next user turn.
        follow = llm.get_tokenizer().encode(f"\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")
        previous = len(ids) + len(answer)
        ids = ids + answer + follow
        turns_ids.append((previous, ids))
    last = _generate(llm, [ids], params=params)[0]
    previous = turns_ids[-1][0]
    # Every full block of the earlier turns is reused except the one holding the last sampled
    # token, whose K/V was never computed.
    assert last.num_cached_tokens == (previous - 1) // 16 * 16
    cold = _generate(llm, [ids], caching=False, params=params)[0]
    assert last.outputs[0].token_ids == cold.outputs[0].token_ids


def test_salts_isolate_tenants(llm):
    prompt = _chat_prompt(llm, "Tell me about salt.")
    a1 = _generate(llm, [{"prompt_token_ids": prompt, "cache_salt": "tenant-a"}])[0]
    b1 = _generate(llm, [{"prompt_token_ids": prompt, "cache_salt": "tenant-b"}])[0]
    a2 = _generate(llm, [{"prompt_token_ids": prompt, "cache_salt": "tenant-a"}])[0]
    assert a1.num_cached_tokens == 0 and b1.num_cached_tokens == 0
    assert a2.num_cached_tokens == (len(prompt) - 1) // 16 * 16
    assert a1.outputs[0].token_ids == b1.outputs[0].token_ids == a2.outputs[0].token_ids


def test_colliding_hashes_still_give_exact_outputs(llm, monkeypatch):
    prompts = [_chat_prompt(llm, q) for q in QUESTIONS[:2]] + [list(range(2000, 2040))]
    expected = [o.outputs[0].token_ids for o in _generate(llm, prompts, caching=False)]
    monkeypatch.setattr("kvbank.cache.manager.block_hash", lambda parent, tokens: b"collide")
    collider = LLM(num_gpu_blocks=64)
    for _ in range(2):
        got = [o.outputs[0].token_ids for o in collider.generate(prompts, GREEDY)]
        assert got == expected


@pytest.mark.slow
def test_pool_pressure_evicts_correctly_and_pins_survive():
    small = LLM(num_gpu_blocks=40, max_pinned_fraction=0.25)
    system = small.render_chat([{"role": "system", "content": SYSTEM}], add_generation_prompt=False)
    pinned = small.pin_prefix(system)
    assert pinned == len(system) // 16 * 16 and small.stats()["num_pinned_blocks"] == pinned // 16
    distinct = [list(range(3000 + 100 * i, 3000 + 100 * i + 60)) for i in range(12)]  # 4 blocks each
    expected = [o.outputs[0].token_ids for o in small.generate(distinct, GREEDY)]
    for _ in range(2):  # far more distinct prefixes than fit
        assert [o.outputs[0].token_ids for o in small.generate(distinct, GREEDY)] == expected
    user = small.render_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}])
    assert small.generate([user], GREEDY)[0].num_cached_tokens == pinned
    with pytest.raises(ValueError, match="max_pinned_fraction"):
        small.pin_prefix(distinct[0] * 3)
    assert small.unpin_prefix(system) == pinned and small.stats()["num_pinned_blocks"] == 0
    assert small.engine.manager.num_free_blocks == small.engine.num_blocks


def test_stats_report_queries_hits_and_rate(llm):
    before = llm.stats()
    prompt = list(range(5000, 5040))
    _generate(llm, [prompt])
    _generate(llm, [prompt])
    after = llm.stats()
    assert after["prefix_cache_queries"] - before["prefix_cache_queries"] == 80
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == 32
    assert after["prefix_cache_hit_rate"] == pytest.approx(after["prefix_cache_hits"] / after["prefix_cache_queries"])
