"""Cache features together: long-context policies on quantized KV (run, swapped whole, or refused
naming both features), and streams where their layout cannot hold them.

The matrix is policy x kv_cache_dtype (x swap). Dense pools are covered by tests/test_kv_policies.py;
the edits themselves (rotation, slot and token moves) per layout by tests/test_kv_layers.py.
"""

from pathlib import Path

import pytest

from kvbank import LLM, SamplingParams
from kvbank.cache.policies import parse_policy

SHIFTING = ["sink_window(sinks=4,window=64)", "context_shift(keep=16)"]
SCORED = ["h2o(heavy=40,recent=40)", "snapkv(budget=96,window=16)"]
#: the policies each quantized layout runs; the rest are refused
RUNS = {"int8": SHIFTING + SCORED, "fp8_e4m3": SHIFTING + SCORED, "int4": SHIFTING, "int2": SHIFTING}


@pytest.fixture(scope="module", params=sorted(RUNS))
def llm(request):
    # The default configuration (bfloat16, packed weights, batch-invariant) with a quantized pool;
    # a small context so that context_shift shifts and every policy evicts within 250 tokens.
    return LLM(kv_cache_dtype=request.param, max_model_len=256, num_gpu_blocks=96, max_num_batched_tokens=64)


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


def test_streams_are_refused_on_quantized_kv_naming_both(llm):
    dtype = llm.engine.config.kv_cache_dtype
    with pytest.raises(ValueError, match=rf"kv_policy=frame_window\(.*\) cannot run with kv_cache_dtype='{dtype}'"):
        llm.open_stream("You watch a stream of notes.")
    assert _all_free(llm)
