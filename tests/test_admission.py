"""Admission: requests that could never fit fail at once with the numbers, pins never starve a
request in flight, and `n` forks count against `max_num_seqs`."""

import pytest

from kvbank import LLM, SamplingParams
from kvbank.engine.llm_engine import LLMEngine


@pytest.fixture(scope="module")
def small() -> LLM:
    """The issue's shape: 64 blocks of 16 tokens, half of them pinnable."""
    return LLM(num_gpu_blocks=64, max_model_len=1000)


def _unpin_all(llm: LLM) -> None:
    for root, tokens in list(llm.engine.manager.pins):
        llm.engine.manager.unpin(list(tokens), root)


@pytest.mark.slow
def test_a_request_that_cannot_fit_beside_pinned_blocks_fails_naming_the_numbers(small):
    prefix = list(range(1000, 1500))
    try:
        assert small.pin_prefix(prefix) == 496  # 31 whole blocks
        with pytest.raises(ValueError, match=r"needs 60 KV blocks but only 33 of the pool's 64 .* 31 are pinned"):
            small.generate([list(range(2000, 2900))], SamplingParams(max_tokens=50))
        assert not small.engine.has_unfinished_requests()
        # Sharing the pinned prefix counts: the same 900 tokens that start with it fit.
        out = small.generate([prefix + list(range(3000, 3400))], SamplingParams(max_tokens=50, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 50
    finally:
        _unpin_all(small)
    assert small.engine.manager.num_free_blocks == 64


@pytest.mark.slow
def test_a_pin_that_would_starve_a_request_in_flight_is_refused(small):
    prefix = list(range(1000, 1500))
    small.generate([prefix], SamplingParams(max_tokens=1))  # cached, not pinned yet
    engine: LLMEngine = small.engine
    request = engine.add_request(list(range(2000, 2900)), SamplingParams(max_tokens=50, ignore_eos=True))
    try:
        with pytest.raises(ValueError, match="would leave 33 unpinned, but a request in flight needs up to 60"):
            engine.pin_prefix(prefix)
        assert not engine.manager.pinned_blocks
        while not request.finished:
            engine.step()
        assert len(request.seqs[0].output_token_ids) == 50
    finally:
        engine.abort_request(request.request_id)
        _unpin_all(small)


def test_forks_count_against_max_num_seqs():
    llm = LLM(max_num_seqs=4, num_gpu_blocks=128)
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=8, ignore_eos=True)
    engine = llm.engine
    for i in range(3):
        engine.add_request(list(range(100 + i, 140 + i)), params)
    most = 0
    while engine.has_unfinished_requests():
        engine.step()
        most = max(most, len(engine.scheduler.running))
    assert most == 3  # one request of 3 at a time: 3 + 3 > 4
    with pytest.raises(ValueError, match="n=5 is more sequences than max_num_seqs=4"):
        engine.add_request([1, 2, 3], SamplingParams(n=5))


def test_kivi_residual_slots_stay_within_their_reservation_under_forks():
    """Every running sequence has at most one open block, so n forks within max_num_seqs never
    grow the residual table (they once did, and it never shrank)."""
    llm = LLM(kv_cache_dtype="int4", max_num_seqs=8, num_gpu_blocks=128)
    engine = llm.engine
    residual = engine.runner.storage.kind("kivi").residual
    reserved = residual.capacity
    request = engine.add_request(
        list(range(100, 150)), SamplingParams(n=8, temperature=1.0, seed=3, max_tokens=20, ignore_eos=True)
    )
    most = 0
    while not request.finished:
        engine.step()
        most = max(most, len(residual.of_block))
    assert most == 8 and residual.capacity == reserved == 8
    assert not residual.of_block
