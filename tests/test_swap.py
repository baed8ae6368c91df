"""Preemption by swap on the bundled model (bfloat16, batch-invariant): exact tokens, fallback, freeing.

One small-pool engine serves every test (loading the model dominates); each run sets the swapper's
mode and space and looks at how the counters moved.
"""

import pytest

from kvbank import LLM, SamplingParams
from kvbank.cache.swap import SWAP_CROSSOVER_TOKENS

PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
TEXT = "Once upon a time, in a small village by the sea, there lived an old fisherman who told stories."
#: One ~40-token sequence fits in 6 blocks of 8; four together want ~20, so they preempt each other.
BLOCK_SIZE, SMALL_POOL = 8, 8
COUNTERS = ("num_preemptions", "num_swaps_out", "num_swaps_in")


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(block_size=BLOCK_SIZE, num_gpu_blocks=SMALL_POOL)


@pytest.fixture(scope="module")
def prompts(llm) -> list[list[int]]:
    tokens = llm.get_tokenizer().encode(TEXT)
    return [tokens[i * 3 :] + tokens[: i * 3] for i in range(4)]


@pytest.fixture(scope="module")
def unpreempted(llm, prompts) -> list[list[int]]:
    """Each prompt alone: it fits, so nothing is preempted."""
    before = llm.stats()["num_preemptions"]
    tokens = [llm.generate([p], PARAMS)[0].outputs[0].token_ids for p in prompts]
    assert llm.stats()["num_preemptions"] == before
    return tokens


def _run(llm: LLM, prompts, mode: str, space_bytes: int = 2**30) -> tuple[list[list[int]], dict[str, int]]:
    swapper = llm.engine.swapper
    swapper.mode, swapper.space_bytes = mode, space_bytes
    before = llm.stats()
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS)]
    after = llm.stats()
    return tokens, {name: after[name] - before[name] for name in COUNTERS}


def _assert_all_free(llm: LLM) -> None:
    assert llm.engine.manager.num_free_blocks == llm.engine.num_blocks
    assert llm.engine.swapper.bytes_used == 0 and not llm.engine.swapper.swapped
    assert llm.stats()["swap_bytes_used"] == 0


def test_swap_preemption_gives_the_same_tokens_as_recompute_and_as_no_preemption(llm, prompts, unpreempted):
    recomputed, counts = _run(llm, prompts, "recompute")
    assert recomputed == unpreempted
    assert counts["num_preemptions"] > 0 and counts["num_swaps_out"] == 0

    swapped, counts = _run(llm, prompts, "swap")
    assert swapped == unpreempted
    assert counts["num_swaps_out"] > 0 and counts["num_swaps_in"] == counts["num_swaps_out"]
    assert counts["num_preemptions"] >= counts["num_swaps_out"]
    _assert_all_free(llm)


def test_full_swap_space_falls_back_to_recompute(llm, prompts, unpreempted):
    tokens, counts = _run(llm, prompts, "swap", space_bytes=llm.engine.swapper.bytes_per_block - 1)
    assert tokens == unpreempted
    assert counts["num_preemptions"] > 0 and counts["num_swaps_out"] == 0
    _assert_all_free(llm)


def test_aborting_a_swapped_sequence_frees_its_host_memory(llm, prompts):
    engine = llm.engine
    engine.swapper.mode, engine.swapper.space_bytes = "swap", 2**30
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, PARAMS, request_id=f"abort-{i}")
    while not engine.swapper.swapped:
        engine.step()
    victim = next(iter(engine.swapper.swapped))
    held = engine.swapper.bytes_used
    engine.abort_request(victim.request.request_id)
    assert victim not in engine.swapper.swapped and engine.swapper.bytes_used < held
    while engine.has_unfinished_requests():
        engine.step()
    _assert_all_free(llm)


def test_auto_preemption_swaps_long_victims_and_keeps_the_tokens(prompts, unpreempted):
    # The engine's own `auto`: every victim here holds ~40 computed tokens, past the crossover
    # (kvbank/cache/swap.py), so every one is swapped.
    auto = LLM(block_size=BLOCK_SIZE, num_gpu_blocks=SMALL_POOL, preemption_mode="auto")
    before = auto.stats()
    tokens = [o.outputs[0].token_ids for o in auto.generate(prompts, PARAMS)]
    after = auto.stats()
    counts = {name: after[name] - before[name] for name in COUNTERS}
    assert tokens == unpreempted
    assert counts["num_preemptions"] > 0
    assert counts["num_swaps_out"] == counts["num_swaps_in"] == counts["num_preemptions"]
    assert after["swap_bytes_used"] == 0


@pytest.mark.parametrize(
    ("computed", "swapped"), [(SWAP_CROSSOVER_TOKENS - 1, False), (SWAP_CROSSOVER_TOKENS, True)], ids=["below", "at"]
)
def test_auto_preemption_recomputes_below_the_crossover_and_swaps_from_it(llm, monkeypatch, computed, swapped):
    """The engine's `auto` against its own crossover: a victim preempted one token short of it is
    recomputed, one preempted at it is swapped. Below the crossover the victim still holds a full
    block (swappable), so only the crossover decides."""
    from kvbank.cache import swap

    assert SWAP_CROSSOVER_TOKENS - 1 >= BLOCK_SIZE, "no full block below the crossover: its boundary is untestable here"
    engine = llm.engine
    engine.swapper.mode, engine.swapper.space_bytes = "auto", 2**30
    decided = []
    original = swap.Swapper.wants_swap

    def recording(self, seq):
        decided.append((seq.request.request_id, seq.num_computed_tokens, original(self, seq)))
        return decided[-1][2]

    monkeypatch.setattr(swap.Swapper, "wants_swap", recording)
    tokens = llm.get_tokenizer().encode(" ".join([TEXT] * 3))
    # The older sequence fills 6 of the 8 blocks, the victim the other 2 with its prompt alone;
    # the step after both prefills the older one needs a 7th block and preempts the victim,
    # which has computed exactly its prompt.
    older, victim = tokens[: 6 * BLOCK_SIZE], tokens[-computed:]
    before = llm.stats()
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    _finish(engine, [("older", older, params), ("victim", victim, params)])
    after = llm.stats()
    counts = {name: after[name] - before[name] for name in COUNTERS}
    assert decided == [("victim", computed, swapped)]
    assert counts == {"num_preemptions": 1, "num_swaps_out": int(swapped), "num_swaps_in": int(swapped)}
    _assert_all_free(llm)


def test_an_unknown_preemption_mode_is_refused():
    with pytest.raises(ValueError, match="preemption_mode='sometimes'"):
        LLM(preemption_mode="sometimes")


def test_forked_siblings_swapped_apart_keep_their_tokens(llm, prompts, unpreempted):
    engine = llm.engine
    engine.swapper.mode, engine.swapper.space_bytes = "swap", 2**30
    before = llm.stats()["num_swaps_out"]
    forks = llm.generate([prompts[0]], SamplingParams(n=3, temperature=0, max_tokens=16, ignore_eos=True))[0]
    assert [c.token_ids for c in forks.outputs] == [unpreempted[0]] * 3
    assert llm.stats()["num_swaps_out"] > before
    _assert_all_free(llm)


def _finish(engine, requests) -> list[list[int]]:
    for request_id, prompt, params in requests:
        engine.add_request(prompt, params, request_id=request_id)
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output.outputs[0].token_ids
    return [outputs[request_id] for request_id, _, _ in requests]


@pytest.mark.parametrize("policy", ["sink_window(sinks=4,window=16)", "h2o(heavy=8,recent=8)"])
def test_sequences_a_policy_has_edited_are_swapped_whole_and_keep_their_tokens(prompts, monkeypatch, policy):
    """A sequence that has evicted tokens (moved slots, re-rotated keys, H2O's score buffers)
    cannot be recomputed from its tokens. Here it arrives second and evicts; the first, a plain sequence,
    grows until the pool is full and preempts it: it is swapped whole (every block, the open tail,
    the unrotated copies, the cache state) and finishes exactly as it does alone."""
    from kvbank.cache import swap

    full = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    windowed = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True, kv_policy=policy)
    # The plain sequence alone needs 13 blocks of 8, the windowed one 9 for its prompt and 3 once it
    # has evicted: together they do not fit. One chunk holds each prompt: evictions then happen at
    # the same steps alone and together.
    small = LLM(block_size=BLOCK_SIZE, num_gpu_blocks=15, max_num_batched_tokens=72, preemption_mode="swap")
    engine = small.engine
    long = prompts[1] + prompts[2] + prompts[3]  # past what either policy keeps, so both evict at once
    alone = _finish(engine, [("a", prompts[0], full)]) + _finish(engine, [("b", long, windowed)])
    name = policy.split("(")[0]
    assert small.stats()["num_preemptions"] == 0 and small.stats()[f"evicted_tokens_{name}"] > 0
    whole = []
    original = swap.Swapper.swap_out

    def recording(self, seq):
        whole.append(swap.edited(seq))
        original(self, seq)

    monkeypatch.setattr(swap.Swapper, "swap_out", recording)
    together = _finish(engine, [("a2", prompts[0], full), ("b2", long, windowed)])
    stats = small.stats()
    assert together == alone
    assert whole and all(whole), "the windowed sequence was not preempted after it evicted: no whole swap tested"
    assert stats["num_swaps_in"] == stats["num_swaps_out"] == len(whole)
    assert engine.manager.num_free_blocks == engine.num_blocks and stats["swap_bytes_used"] == 0
