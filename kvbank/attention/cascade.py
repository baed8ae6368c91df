"""Shared-prefix ("cascade") decode attention.

When many decoding sequences start with the same cached blocks (a shared system prompt, the
prompt of an `n > 1` request), plain paged attention gathers and reads those blocks once per
sequence. Here the shared blocks are gathered once and attended by all of the group's queries
together, each sequence's remaining blocks are attended as usual, and the two partial results
are merged by their log-sum-exp. Decoding is bound by reading K/V, so this cuts the attention
time roughly in proportion to the sharing.

This file finds the groups (plain Python on block ids) and describes them in the step's
metadata; the kernel is `fast._cascade_decode`.
"""

from __future__ import annotations

import torch

from kvbank.attention.fast import DenseStep, padded_key_length, padded_length
from kvbank.attention.metadata import SharedPrefix, additive_mask, index_tensor, table_tensor

#: A group shares at least this many tokens; below that the extra kernel call costs more than it saves.
MIN_SHARED_TOKENS = 128


def find_shared_prefixes(
    tables: list[list[int]], lens: list[int], block_size: int, min_blocks: int
) -> list[tuple[list[int], int]]:
    """Groups of decodes that share leading blocks: (decode indices, number of shared blocks).

    Only blocks wholly before a decode's own token are shared: those are full and visible to it.
    Groups are chosen to maximise the blocks not read twice, and each shares >= `min_blocks`.
    """
    usable = [min(len(t), (n - 1) // block_size) for t, n in zip(tables, lens)]
    order = sorted(range(len(tables)), key=lambda i: tables[i][: usable[i]])
    lcp = [_common_length(tables[a], tables[b], min(usable[a], usable[b])) for a, b in zip(order, order[1:])]
    return _best_groups(order, lcp, 0, len(order), min_blocks)[1]


def _common_length(a: list[int], b: list[int], limit: int) -> int:
    n = 0
    while n < limit and a[n] == b[n]:
        n += 1
    return n


def _best_groups(
    order: list[int], lcp: list[int], lo: int, hi: int, min_blocks: int
) -> tuple[int, list[tuple[list[int], int]]]:
    # order[lo:hi] is sorted, so its common prefix is its smallest adjacent one: keep the run
    # whole, or split it there and do better in the two halves.
    if hi - lo < 2:
        return 0, []
    cut = min(range(lo, hi - 1), key=lcp.__getitem__)
    shared = lcp[cut]
    whole = (hi - lo - 1) * shared if shared >= min_blocks else 0
    left, right = _best_groups(order, lcp, lo, cut + 1, min_blocks), _best_groups(order, lcp, cut + 1, hi, min_blocks)
    if left[0] + right[0] > whole:
        return left[0] + right[0], left[1] + right[1]
    return whole, [(order[lo:hi], shared)] if whole else []


def share_prefixes(
    step: DenseStep,
    tables: list[list[int]],
    lens: list[int],
    block_size: int,
    mask_dtype: torch.dtype,
    device: torch.device,
    min_tokens: int = MIN_SHARED_TOKENS,
) -> None:
    """Record the decodes' shared prefixes in `step` (decode tables and context lengths as lists)."""
    # Shared ranges are whole multiples of the flash kernel's key padding, so they need none.
    unit = padded_key_length(1, block_size) // block_size
    min_blocks = padded_length(max(1, min_tokens // block_size), unit)
    groups = [
        (rows, shared // unit * unit) for rows, shared in find_shared_prefixes(tables, lens, block_size, min_blocks)
    ]
    if not groups:
        return
    skip = [0] * len(tables)
    for rows, shared in groups:
        prefix = SharedPrefix(index_tensor(rows, device), index_tensor(tables[rows[0]][:shared], device))
        step.shared_prefixes.append(prefix)
        for i in rows:
            skip[i] = shared
    suffixes = [table[s:] for table, s in zip(tables, skip)]
    step.suffix_block_tables = table_tensor(suffixes, device)
    width = step.suffix_block_tables.shape[1]
    remaining = index_tensor([n - s * block_size for n, s in zip(lens, skip)], device)
    hidden = torch.arange(width * block_size, device=device).unsqueeze(0) >= remaining.unsqueeze(1)
    step.suffix_mask = additive_mask(~hidden, mask_dtype)[:, None, None, :]
