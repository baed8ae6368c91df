"""Block pool and cache manager bookkeeping, without a model."""

import pytest

from kvbank.cache.blocks import BlockPool
from kvbank.cache.manager import KVCacheManager
from kvbank.cache.prefix import root_hash
from kvbank.engine.params import SamplingParams
from kvbank.engine.sequence import Request, Sequence

BS = 4


def _manager(num_blocks: int) -> KVCacheManager:
    """A manager with prefix caching on; only the pinning test depends on the pin limit, and names its own."""
    return KVCacheManager(num_blocks, BS, enable_prefix_caching=True, max_pinned_fraction=0.5)


def _seq(tokens, salt=None, prompt_logprobs=None):
    params = SamplingParams(prompt_logprobs=prompt_logprobs)
    request = Request("r", None, list(tokens), params, root_hash(b"model", salt), 0.0)
    return Sequence(request, 0, list(tokens), None)


def _run(manager, seq):
    """Allocate, pretend the whole prompt was computed, and index its full blocks."""
    assert manager.can_allocate(seq)
    manager.allocate(seq)
    seq.num_computed_tokens = seq.num_tokens
    manager.commit(seq)
    return seq


def test_allocate_and_free_restore_the_pool():
    manager = _manager(8)
    seq = _run(manager, _seq(range(10)))
    assert len(seq.block_table) == 3 and manager.num_free_blocks == 5
    manager.free(seq)
    assert manager.num_free_blocks == 8 and not seq.block_table


def test_prefix_hit_shares_full_blocks_but_recomputes_the_last_token():
    manager = _manager(16)
    first = _run(manager, _seq(range(12)))
    first_table = list(first.block_table)
    manager.free(first)
    again = _seq(range(12))
    manager.allocate(again)
    # 12 tokens = 3 full blocks, but the last token must run to give logits: 2 blocks hit.
    assert again.num_computed_tokens == 8
    assert again.block_table[:2] == first_table[:2]


def test_salts_and_collisions_never_share(monkeypatch):
    manager = _manager(16)
    manager.free(_run(manager, _seq(range(9), salt="a")))
    other = _seq(range(9), salt="b")
    manager.allocate(other)
    assert other.num_computed_tokens == 0
    manager.free(other)
    monkeypatch.setattr("kvbank.cache.manager.block_hash", lambda parent, tokens: b"same")
    collider = _manager(16)
    collider.free(_run(collider, _seq(range(9))))
    different = _seq(range(100, 109))
    collider.allocate(different)
    assert different.num_computed_tokens == 0


def test_eviction_takes_empty_blocks_first_then_least_recent_tails():
    manager = _manager(4)
    seq = _run(manager, _seq(range(9)))  # blocks: 2 full + 1 partial
    cached = list(seq.block_table[:2])
    manager.free(seq)
    assert list(manager.pool.cached) == [cached[1], cached[0]]  # tail first in LRU order
    filler = _seq(range(500, 511))  # 3 blocks: the two empty ones, then the LRU tail
    manager.allocate(filler)
    assert cached[0] not in filler.block_table and cached[1] in filler.block_table


def test_fork_shares_and_copy_on_write_splits_the_partial_block():
    manager = _manager(8)
    parent = _run(manager, _seq(range(6)))  # 1 full + 1 partial block
    child = parent.fork(1, None)
    manager.fork(parent, child)
    assert manager.num_free_blocks == 6
    parent.token_ids.append(7)
    child.token_ids.append(8)
    assert manager.can_append(child, 1)
    copies = manager.append_slots(child, 1)
    assert copies == [(parent.block_table[1], child.block_table[1])]
    assert child.block_table[0] == parent.block_table[0] and child.block_table[1] != parent.block_table[1]
    assert manager.append_slots(parent, 1) == []  # now the only owner: writes in place
    manager.free(parent)
    manager.free(child)
    assert manager.num_free_blocks == 8


def test_prompt_logprobs_requests_skip_the_cache():
    manager = _manager(16)
    manager.free(_run(manager, _seq(range(9))))
    wants_logprobs = _seq(range(9), prompt_logprobs=1)
    manager.allocate(wants_logprobs)
    assert wants_logprobs.num_computed_tokens == 0


def test_pool_refuses_to_release_a_free_block():
    pool = BlockPool(2)
    block = pool.take()
    pool.release(block)
    with pytest.raises(AssertionError):
        pool.release(block)


def test_a_hash_that_ignores_the_prefix_never_serves_a_block_computed_after_another_prefix(monkeypatch):
    monkeypatch.setattr("kvbank.cache.manager.block_hash", lambda parent, tokens: bytes(str(list(tokens)), "ascii"))
    manager = _manager(16)
    shared = [7, 7, 7, 7]
    manager.free(_run(manager, _seq([1, 2, 3, 4] + shared + [0])))
    manager.free(_run(manager, _seq([5, 6, 7, 8] + shared + [0])))
    probe = _seq([5, 6, 7, 8] + shared + [9])
    manager.allocate(probe)
    # Block 0 is a true hit; block 1's tokens are cached, but only after the other prefix.
    assert probe.num_computed_tokens == BS


def test_pinned_prefix_survives_eviction_and_counts_against_the_limit():
    manager = KVCacheManager(6, BS, enable_prefix_caching=True, max_pinned_fraction=0.5)
    pinned = _seq(range(9))
    manager.free(_run(manager, pinned))
    root = pinned.root_hash
    assert manager.pin(list(range(9)), root) == 8
    assert manager.num_free_blocks == 4
    for start in (100, 200, 300):  # churn through the rest of the pool
        manager.free(_run(manager, _seq(range(start, start + 12))))
    again = _seq(list(range(8)) + [42])
    manager.allocate(again)
    assert again.num_computed_tokens == 8
    manager.free(again)
    with pytest.raises(ValueError, match="max_pinned_fraction"):
        manager.free(_run(manager, _seq(range(500, 509))))
        manager.pin(list(range(500, 508)), root)
    assert manager.unpin(list(range(9)), root) == 8
    assert manager.num_free_blocks == 6 and not manager.pinned_blocks
