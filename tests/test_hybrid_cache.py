"""The hybrid KV layout's bookkeeping (kvbank/cache/hybrid.py, the manager's window tables), without
a model: windows release what they have passed, a prefix hit needs its window's blocks, pins keep
them, and memory stays bounded by the window at 8k and 32k tokens. The engine-level checks (the
same bits as a cache that keeps every token, prefix hits, preemption) run on Gemma 3 in
test_gemma3.py."""

import pytest
import torch
from tiny_models import tiny_config

from kvbank.cache.blocks import blocks_for
from kvbank.cache.hybrid import kv_groups
from kvbank.cache.manager import GONE, KVCacheManager
from kvbank.cache.prefix import root_hash
from kvbank.cache.storage import plan_pool
from kvbank.engine.params import SamplingParams
from kvbank.engine.sequence import Request, Sequence

BS = 4
WINDOW = 10
#: two full-attention layers and four windowed ones: blocks hold two layers, two window tables
LAYER_WINDOWS = (WINDOW, WINDOW, None, WINDOW, WINDOW, None)
#: Gemma 3 270M: 18 layers, every sixth attends to everything, the others to 512 positions
GEMMA3_WINDOWS = tuple(None if i % 6 == 5 else 512 for i in range(18))


def _seq(tokens):
    request = Request("r", None, list(tokens), SamplingParams(), root_hash(b"model", None), 0.0)
    return Sequence(request, 0, list(tokens), None)


def _held(seq):
    """Blocks each window table holds now."""
    return [sum(1 for b in table if b != GONE) for table in seq.window_tables]


def _computed(tokens):
    """A 64-block hybrid pool and a sequence of `tokens` tokens computed in it."""
    manager = KVCacheManager(
        64, BS, enable_prefix_caching=True, max_pinned_fraction=0.5, groups=kv_groups(LAYER_WINDOWS)
    )
    seq = _seq(range(tokens))
    _decode(manager, seq, steps=0)
    return manager, seq


def _evict_oldest(manager, count):
    """Drop the `count` least recently used cached blocks (their blocks go back empty)."""
    taken = manager.take_blocks(len(manager.pool.empty) + count)
    for block_id in taken:
        manager.pool.release(manager.pool.blocks[block_id])


def _decode(manager, seq, steps, budget=None):
    """Admit `seq`, compute its prompt in chunks of `budget`, then decode `steps` tokens; returns
    the most blocks any window table held during a step."""
    assert manager.can_allocate(seq, budget)
    manager.allocate(seq, budget)
    most = 0
    while True:
        num_new = min(seq.num_tokens - seq.num_computed_tokens, budget or seq.num_tokens)
        if seq.num_computed_tokens:  # the first chunk's blocks came with allocate
            assert manager.can_append(seq, num_new)
            assert manager.append_slots(seq, num_new) == []
        most = max(most, *_held(seq))  # what the step reads and writes
        seq.num_computed_tokens += num_new
        manager.commit(seq)
        if seq.num_computed_tokens == seq.num_tokens:
            if steps == 0:
                return most
            seq.token_ids.append(7)
            steps -= 1


def test_the_layout_groups_layers_by_table_and_shares_block_places():
    groups = kv_groups(LAYER_WINDOWS)
    assert groups.slots == 2 and groups.num_window_tables == 2
    assert groups.layer_table == (1, 1, 0, 2, 2, 0) and groups.layer_slot == (0, 1, 0, 0, 1, 1)
    assert kv_groups(LAYER_WINDOWS, swa_full=True) is None
    assert kv_groups((None, None)) is None and kv_groups((8, 8)) is None  # nothing to split
    with pytest.raises(ValueError, match="sizes .*swa_full=True"):
        kv_groups((8, 16, None))


def test_window_tables_release_the_blocks_the_window_has_passed():
    manager = KVCacheManager(
        64, BS, enable_prefix_caching=True, max_pinned_fraction=0.5, groups=kv_groups(LAYER_WINDOWS)
    )
    seq = _seq(range(30))
    most = _decode(manager, seq, steps=40, budget=8)
    # a decode reads positions p - 9 .. p: 3 or 4 blocks of 4; a chunk of 8 and its window: 5
    assert _held(seq) == [4, 4] or _held(seq) == [3, 3]
    assert most <= manager.groups.chunk_blocks(8, BS)
    assert len(seq.block_table) == blocks_for(70, BS)  # full-attention layers keep every token
    first = manager.groups.first_block(seq.num_computed_tokens, BS)
    assert all(b == GONE for table in seq.window_tables for b in table[:first])
    in_use = len(seq.block_table) + sum(_held(seq))
    assert manager.num_free_blocks == 64 - in_use
    manager.free(seq)
    assert manager.num_free_blocks == 64 and not seq.window_tables


@pytest.mark.parametrize("tokens", [8192, 32768])
def test_gemma3_memory_is_bounded_by_the_window_at_8k_and_32k(tokens):
    """Gemma 3's layout: 3 layers' K/V for every token, 15 layers' for the latest 528 positions."""
    groups = kv_groups(GEMMA3_WINDOWS)
    assert (groups.slots, groups.num_window_tables, groups.window) == (3, 5, 512)
    manager = KVCacheManager(
        blocks_for(tokens, 16) + 5 * 160, 16, enable_prefix_caching=True, max_pinned_fraction=0.5, groups=groups
    )
    seq = _seq(range(tokens - 64))
    most = _decode(manager, seq, steps=64, budget=2048)
    assert _held(seq) in ([32] * 5, [33] * 5)  # constant: the window, whatever the length
    assert most == groups.chunk_blocks(2048, 16) - 1  # a 2,048-token chunk and the 511 positions before it
    assert len(seq.block_table) == tokens // 16
    held = len(seq.block_table) + sum(_held(seq))
    assert tokens // 16 + 5 * 32 <= held <= groups.blocks_per_sequence(tokens, 16)
    # the pool's arithmetic agrees: 3 x 1,024 bytes per token, plus 5 window tables of 33 blocks
    config = tiny_config(arch="gemma3", num_layers=18, num_heads=4, num_kv_heads=1, head_dim=256)
    plan = plan_pool(config, torch.bfloat16, 2**30, 16, groups=groups)
    every = plan_pool(config, torch.bfloat16, 2**30, 16)
    assert plan.bytes_per_block == 3 * 16 * 1024 and every.bytes_per_block == 18 * 16 * 1024
    assert plan.bytes_per_token_at(tokens) == (tokens // 16 + 5 * 33) * 3 * 16 * 1024 / tokens
    assert plan.sequences_that_fit(tokens) > 4 * every.sequences_that_fit(tokens)


def test_a_prefix_hit_needs_every_window_tables_blocks_before_its_first_computed_token():
    manager, first = _computed(40)
    manager.free(first)
    again = _seq(range(41))
    assert manager.can_allocate(again)
    manager.allocate(again)
    assert again.num_computed_tokens == 40  # the last token is recomputed; 10 whole blocks hit
    lo = manager.groups.first_block(40, BS)
    # the window's cached blocks, and a fresh one for the token to compute
    assert all(b == GONE for t in again.window_tables for b in t[:lo]) and _held(again) == [10 - lo + 1] * 2
    manager.free(again)
    # evict the blocks released first: the window blocks the first sequence moved past
    _evict_oldest(manager, 2 * lo)
    assert len(manager.pool.cached) == 10 + 2 * (10 - lo)
    probe = _seq(range(41))
    manager.allocate(probe)
    assert probe.num_computed_tokens == 40  # the hit's own window is still cached
    manager.free(probe)
    # now the window before token 40 is gone: every full-attention block is still cached, but no
    # hit can start without its window
    _evict_oldest(manager, 2 * (10 - lo))
    assert len(manager.pool.cached) == 10 and not any(manager.pool.blocks[b].group for b in manager.pool.cached)
    assert len(manager.cached_prefix(_seq(range(41)), 10)) == 10
    late = _seq(range(41))
    manager.allocate(late)
    assert late.num_computed_tokens == 0


def test_a_pinned_prefix_keeps_its_windows_blocks():
    manager, first = _computed(40)
    manager.free(first)
    assert manager.pin(list(range(40)), first.root_hash) == 40
    lo = manager.groups.first_block(40, BS)
    assert len(manager.pinned_blocks) == 10 + 2 * (10 - lo)
    manager.take_blocks(manager.num_free_blocks - 3)  # every unpinned block but 3 is taken
    again = _seq(range(41))
    manager.allocate(again)
    assert again.num_computed_tokens == 40


def test_forks_share_window_blocks_and_split_the_one_they_write():
    manager, parent = _computed(14)
    child = parent.fork(1, None)
    manager.fork(parent, child)
    assert child.window_tables == parent.window_tables
    copies = manager.append_slots(child, 1)  # position 14 lies in the shared, partly written block 3
    index = 14 // BS
    assert len(copies) == 3  # the full-attention block and one block per window table
    assert child.block_table[index] != parent.block_table[index]
    assert all(c[index] != p[index] for c, p in zip(child.window_tables, parent.window_tables))
    manager.free(child)
    manager.free(parent)
    assert manager.num_free_blocks == 64
