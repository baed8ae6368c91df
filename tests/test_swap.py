"""Preemption by swap on the bundled model (bfloat16, batch-invariant): exact tokens, fallback, freeing."""

import pytest

from kvbank import LLM, SamplingParams
from kvbank.cache.swap import Swapper

PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
TEXT = (
    "Once upon a time, in a small village by the sea, there lived an old fisherman who told stories "
    "about the storms he had seen, the whales that followed his boat and the lighthouse keeper's daughter."
)
#: 4 sequences of ~70 tokens want ~20 blocks of 16; 10 blocks force preemptions.
SMALL_POOL = 10


def _prompts(llm: LLM) -> list[list[int]]:
    tokens = llm.get_tokenizer().encode(TEXT)
    return [tokens[i * 5 :] + tokens[: i * 5] for i in range(4)]


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]


def _assert_all_free(llm: LLM) -> None:
    manager = llm.engine.manager
    assert manager.num_free_blocks == llm.engine.num_blocks
    assert llm.engine.swapper.bytes_used == 0 and not llm.engine.swapper.swapped


@pytest.fixture(scope="module")
def reference() -> tuple[list[list[int]], list[list[int]]]:
    llm = LLM(num_gpu_blocks=64)
    prompts = _prompts(llm)
    tokens = _tokens(llm, prompts)
    assert llm.stats()["num_preemptions"] == 0
    return prompts, tokens


@pytest.fixture(scope="module")
def swapping() -> LLM:
    return LLM(num_gpu_blocks=SMALL_POOL, preemption_mode="swap")


def test_swap_preemption_gives_the_same_tokens_as_recompute_and_as_no_preemption(reference, swapping):
    prompts, expected = reference
    recompute = LLM(num_gpu_blocks=SMALL_POOL, preemption_mode="recompute")
    assert _tokens(recompute, prompts) == expected
    assert recompute.stats()["num_preemptions"] > 0 and recompute.stats()["num_swaps_out"] == 0

    assert _tokens(swapping, prompts) == expected
    stats = swapping.stats()
    assert stats["num_swaps_out"] > 0 and stats["num_swaps_in"] == stats["num_swaps_out"]
    assert stats["num_preemptions"] >= stats["num_swaps_out"]
    _assert_all_free(swapping)


def test_full_swap_space_falls_back_to_recompute(reference):
    prompts, expected = reference
    one_block = LLM(num_gpu_blocks=SMALL_POOL, preemption_mode="swap", swap_space_gb=1e-9)
    assert _tokens(one_block, prompts) == expected
    stats = one_block.stats()
    assert stats["num_preemptions"] > 0 and stats["num_swaps_out"] == 0
    _assert_all_free(one_block)


def test_aborting_a_swapped_sequence_frees_its_host_memory(reference, swapping):
    prompts, _ = reference
    engine = swapping.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, PARAMS, request_id=f"r{i}")
    while not engine.swapper.swapped:
        engine.step()
    victim = next(iter(engine.swapper.swapped))
    assert engine.swapper.bytes_used > 0
    engine.abort_request(victim.request.request_id)
    assert victim not in engine.swapper.swapped
    while engine.has_unfinished_requests():
        engine.step()
    _assert_all_free(swapping)


def test_auto_swaps_only_from_the_crossover_length(swapping):
    engine = swapping.engine
    swapper = Swapper(engine.storage, engine.manager, "auto", space_bytes=0, crossover_tokens=64)

    class Victim:
        num_computed_tokens = 63

    assert not swapper.wants_swap(Victim())
    Victim.num_computed_tokens = 64
    assert swapper.wants_swap(Victim())


def test_an_unknown_preemption_mode_is_refused():
    with pytest.raises(ValueError, match="preemption_mode='sometimes'"):
        LLM(preemption_mode="sometimes")
