"""Session files (llama.cpp's slot save): a conversation's KV saved to one file, loaded into a fresh
engine and served from the prefix cache with identical outputs; damaged or foreign files refused."""

import pytest

from kvbank import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# About 140 tokens with the reply: eight whole blocks of 16 and a part block.
DOCUMENT = " ".join(
    [
        "The harbour office opens at six, the ferry leaves at seven and returns at noon,",
        "and the lighthouse keeper logs every ship that passes the northern rocks.",
    ]
    * 4
)


@pytest.fixture(scope="module")
def saver():
    return LLM(dtype="float32", num_gpu_blocks=64)


@pytest.fixture(scope="module")
def conversation(saver):
    return saver.generate(DOCUMENT, GREEDY)[0]


@pytest.fixture(scope="module")
def session_file(saver, conversation, tmp_path_factory):
    path = tmp_path_factory.mktemp("sessions") / "harbour.kv"
    saved = saver.save_session(conversation, path, cache_salt="tenant-a")
    assert saved == len(conversation.prompt_token_ids) + len(conversation.outputs[0].token_ids)
    return path


@pytest.fixture(scope="module")
def loader():
    """A second engine: nothing of the saver's pool is in it."""
    return LLM(dtype="float32", num_gpu_blocks=64)


def _tokens(output) -> list[int]:
    return [*output.prompt_token_ids, *output.outputs[0].token_ids]


def test_loaded_session_is_served_from_the_cache_with_identical_output(saver, conversation, session_file, loader):
    tokens = loader.load_session(session_file, cache_salt="tenant-a")
    assert tokens == _tokens(conversation)
    follow_up = {"prompt_token_ids": [*tokens, *saver.get_tokenizer().encode(" What time is it?")]}
    saver.engine.manager.enable_prefix_caching = False
    try:
        cold = saver.generate(follow_up, GREEDY)[0]
    finally:
        saver.engine.manager.enable_prefix_caching = True
    warm = loader.generate({**follow_up, "cache_salt": "tenant-a"}, GREEDY)[0]
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    assert warm.num_cached_tokens == len(tokens) // 16 * 16


def test_loading_twice_copies_nothing_new(session_file, loader):
    loader.load_session(session_file, cache_salt="tenant-a")
    free = loader.engine.manager.num_free_blocks
    states = loader.engine.block_states()
    loader.load_session(session_file, cache_salt="tenant-a")
    assert loader.engine.block_states() == states and loader.engine.manager.num_free_blocks == free


def test_saving_computes_a_prefix_the_pool_lacks(saver, tmp_path):
    text = "A prompt nobody has sent before, long enough to fill a couple of blocks of sixteen tokens each."
    tokens = saver.get_tokenizer().encode(text)
    assert saver.save_session(text, tmp_path / "fresh.kv") == len(tokens)
    assert saver.load_session(tmp_path / "fresh.kv") == tokens


def test_wrong_salt_is_refused(session_file, loader):
    for salt in (None, "tenant-b"):
        with pytest.raises(ValueError, match="another cache_salt"):
            loader.load_session(session_file, cache_salt=salt)


def test_flipped_byte_is_refused_naming_the_file(session_file, loader, tmp_path):
    blob = bytearray(session_file.read_bytes())
    blob[len(blob) // 2] ^= 0x40
    damaged = tmp_path / "flipped.kv"
    damaged.write_bytes(blob)
    with pytest.raises(ValueError, match=f"{damaged}.*checksum"):
        loader.load_session(damaged, cache_salt="tenant-a")


def test_truncated_file_is_refused_naming_the_file(session_file, loader, tmp_path):
    truncated = tmp_path / "truncated.kv"
    truncated.write_bytes(session_file.read_bytes()[:-100])
    with pytest.raises(ValueError, match=f"{truncated}.*truncated"):
        loader.load_session(truncated, cache_salt="tenant-a")


def test_a_pool_too_small_for_the_session_refuses_it(session_file):
    small = LLM(dtype="float32", num_gpu_blocks=4)
    with pytest.raises(ValueError, match=r"needs \d+ free KV blocks but the pool has 4 of 4 free"):
        small.load_session(session_file, cache_salt="tenant-a")
    assert small.engine.manager.num_free_blocks == 4


def test_a_prompt_shorter_than_a_block_has_nothing_to_save(saver, tmp_path):
    with pytest.raises(ValueError, match="fills no block"):
        saver.save_session([1, 2, 3], tmp_path / "short.kv")
