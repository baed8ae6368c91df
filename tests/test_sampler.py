"""The sampler on hand-made logits: penalties, logit bias, truncation rules, min_tokens, seeds."""

import math

import pytest
import torch
from conftest import cpu_levels

from kvbank.engine.params import SamplingParams
from kvbank.engine.sampler import Sampler, _apply_penalties, greedy_tokens
from kvbank.engine.sequence import Request, Sequence
from kvbank.kernels import isa

EOS = 0


def _seq(prompt: list[int], output: list[int] = (), seed: int | None = None, **params) -> Sequence:
    request = Request("r", None, prompt, SamplingParams(**params), b"", 0.0)
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return Sequence(request, 0, prompt + list(output), generator)


def _sampler() -> Sampler:
    return Sampler(frozenset({EOS}), str, torch.Generator().manual_seed(0))


def _greedy(logits: list[float], seq: Sequence) -> int:
    return _sampler()(torch.tensor([logits]), [seq])[0].token_id


def _draws(probs: list[float], rows: int = 400, **params) -> set[int]:
    seq = _seq([1], seed=0, **params)
    logits = torch.tensor(probs).log().expand(rows, -1)
    return {sample.token_id for sample in _sampler()(logits, [seq] * rows)}


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    row = torch.tensor([2.0, -1.0, 0.5, 3.0])
    _apply_penalties(row, _seq([0], [1], repetition_penalty=2.0))
    assert row.tolist() == [1.0, -2.0, 0.5, 3.0]  # prompt and output tokens alike; unseen ones untouched


def test_presence_and_frequency_penalties_count_output_tokens_only():
    row = torch.zeros(4)
    _apply_penalties(row, _seq([3], [1, 1, 2], presence_penalty=0.5, frequency_penalty=0.25))
    assert row.tolist() == [0.0, -1.0, -0.75, 0.0]


def test_logit_bias_is_added_before_choosing():
    assert _greedy([1.0, 3.0, 2.0], _seq([1], temperature=0)) == 1
    assert _greedy([1.0, 3.0, 2.0], _seq([1], temperature=0, logit_bias={2: 1.5})) == 2
    assert _greedy([1.0, 3.0, 2.0], _seq([1], temperature=0, logit_bias={1: -100, 2: -100})) == 0


def test_logit_bias_of_minus_100_bans_a_token_from_sampling():
    assert _draws([0.5, 0.3, 0.2], logit_bias={1: -100}) == {0, 2}


@pytest.mark.parametrize(
    "bias, message",
    [
        ({-1: 1.0}, "logit_bias token id=-1"),
        ({"5": 1.0}, "logit_bias token id='5'"),
        ({5: 101.0}, r"logit_bias\[5\]=101.0 must be a number in \[-100, 100\]"),
        ({5: math.nan}, r"logit_bias\[5\]=nan"),
        ([5], "must be a dict"),
    ],
)
def test_bad_logit_bias_is_rejected_by_name(bias, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(logit_bias=bias)


def test_token_ids_outside_the_vocabulary_are_rejected_with_the_limit():
    SamplingParams(logit_bias={99: 1.0}, stop_token_ids=[99]).check_token_ids(100)
    with pytest.raises(ValueError, match=r"logit_bias token id=100 is out of range \[0, 100\)"):
        SamplingParams(logit_bias={100: 1.0}).check_token_ids(100)
    with pytest.raises(ValueError, match=r"stop_token_ids=150 is out of range \[0, 100\)"):
        SamplingParams(stop_token_ids=[3, 150]).check_token_ids(100)


def test_greedy_picks_the_first_of_tied_tokens():
    assert _greedy([1.0, 3.0, 3.0, 0.0], _seq([1], temperature=0)) == 1


def _hard_rows() -> torch.Tensor:
    """Rows argmax can get wrong: ties across and within vector lanes, -inf, one element, tails."""
    rows = torch.randn(12, 49157, generator=torch.Generator().manual_seed(3))
    rows[1, [7, 23, 40000]] = 9.0  # tied maxima in different lanes: the first wins
    rows[2, [16, 32]] = 9.0  # tied in the same lane
    rows[3] = float("-inf")
    rows[4, -1] = 50.0  # the maximum in the scalar tail
    rows[5, 100:110] = 7.0
    rows[6] = 0.0
    rows[7, 30000] = float("nan")  # torch's argmax picks a NaN (the first one)
    rows[7, 40000] = float("nan")
    rows[8, 0] = float("nan")
    rows[9, -2] = float("nan")
    rows[10, 5] = float("inf")
    return rows


@pytest.mark.parametrize("level", cpu_levels())
def test_native_greedy_argmax_matches_torch_at_every_level(native, level):
    rows = _hard_rows()
    expected = rows.argmax(dim=-1)
    variant = level if level in ("scalar", "avx2") else "avx512"
    with isa.capped(native, level):  # (a KVBANK_ISA cap below `level` would refuse the variant)
        for vocab in (1, 5, 8, 16, 17, 49157):
            part = rows[:, :vocab]  # strided rows: the row pitch is the full width
            assert torch.equal(native.argmax_rows(part, isa=variant), part.argmax(dim=-1)), vocab
        assert torch.equal(native.argmax_rows(rows, isa=variant), expected)
        assert torch.equal(greedy_tokens(rows), expected)


def test_native_greedy_argmax_refuses_what_it_cannot_read(native):
    with pytest.raises(RuntimeError, match="logits must be float32 \\[rows, vocab\\]"):
        native.argmax_rows(torch.zeros(2, 4, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="isa must be auto, avx512, avx2 or scalar, not avx512_vnni"):
        native.argmax_rows(torch.zeros(2, 4), isa="avx512_vnni")


def test_top_k_keeps_the_k_most_likely_tokens():
    assert _draws([0.4, 0.3, 0.2, 0.1], top_k=2) == {0, 1}
    assert _draws([0.4, 0.3, 0.2, 0.1]) == {0, 1, 2, 3}


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    assert _draws([0.4, 0.3, 0.2, 0.1], top_p=0.5) == {0, 1}  # 0.4 < 0.5: the second token is needed
    assert _draws([0.4, 0.3, 0.2, 0.1], top_p=0.3) == {0}  # the most likely token always stays


def test_min_p_drops_tokens_below_a_fraction_of_the_most_likely():
    assert _draws([0.5, 0.3, 0.2], min_p=0.5) == {0, 1}  # threshold 0.25
    assert _draws([0.5, 0.3, 0.2], min_p=0.3) == {0, 1, 2}  # threshold 0.15


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    logits = [9.0, 1.0, 2.0, 8.0]  # EOS (0) first, then stop token 3
    params = dict(temperature=0, min_tokens=3, stop_token_ids=[3])
    assert _greedy(logits, _seq([1], [2, 2], **params)) == 2  # two outputs: both masked
    assert _greedy(logits, _seq([1], [2, 2, 2], **params)) == EOS  # three: free again
    assert _greedy(logits, _seq([1], [2], ignore_eos=True, **params)) == EOS  # ignore_eos: EOS is not banned
    assert _greedy(logits, _seq([1], [2], temperature=0, stop_token_ids=[3])) == EOS  # no min_tokens


def test_stop_token_ids_are_not_masked_without_min_tokens():
    assert _greedy([1.0, 1.0, 2.0, 8.0], _seq([1], temperature=0, stop_token_ids=[3])) == 3


def test_seeded_draws_repeat_and_do_not_depend_on_batch_neighbours():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))

    def sequence(seed: int, rows: list[int], steps: int = 20) -> list[int]:
        seqs = [_seq([1], seed=seed if i == 0 else 99 + i, temperature=1.0) for i in range(len(rows))]
        sampler = _sampler()
        return [sampler(logits[rows], seqs)[0].token_id for _ in range(steps)]

    alone = sequence(7, [0])
    assert sequence(7, [0]) == alone
    assert sequence(7, [0, 1, 2]) == alone
    assert sequence(8, [0]) != alone


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"stop_token_ids": list(range(1025))}, "stop_token_ids has 1025 ids; at most 1024 are allowed"),
        ({"stop_token_ids": [True]}, "stop_token_ids=.* must be non-negative integers"),
        ({"stop": ["x"] * 65}, "stop has 65 strings; at most 64 are allowed"),
        ({"stop": "y" * 1025}, r"stop=.*\(1025 characters\).* is longer than 1024 characters"),
        ({"logit_bias": {i: 1.0 for i in range(1025)}}, "logit_bias has 1025 entries; at most 1024 are allowed"),
    ],
    ids=["stop-ids", "stop-id-bool", "stop-strings", "stop-string-length", "logit-bias"],
)
def test_what_is_checked_per_token_is_bounded(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)
    at_limit = {
        name: value[:-1] if not isinstance(value, dict) else dict(list(value.items())[:-1])
        for name, value in fields.items()
    }
    if fields.get("stop_token_ids") != [True]:
        SamplingParams(**at_limit)


def test_stop_token_ids_stop_generation_through_a_set():
    params = SamplingParams(stop_token_ids=[7, 3, 7])
    assert params.stop_token_set == frozenset({3, 7}) and params.stop_token_ids == [7, 3, 7]
