"""The scheduler on a real block manager, with steps played by hand (no model): admission, budgets, preemption."""

from kvbank.cache.manager import KVCacheManager
from kvbank.engine.pacing import StepPacer
from kvbank.engine.params import SamplingParams
from kvbank.engine.scheduler import Scheduler
from kvbank.engine.sequence import Request, Sequence, SequenceStatus

BLOCK = 4


def _scheduler(num_blocks=64, max_num_seqs=8, budget=64, prefix_caching=False) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, BLOCK, prefix_caching, max_pinned_fraction=0.5), max_num_seqs, budget)


def _add(scheduler: Scheduler, name: str, prompt_len: int, first: int = 100, priority: int = 0) -> Sequence:
    prompt = list(range(first, first + prompt_len))
    seq = Sequence(Request(name, None, prompt, SamplingParams(priority=priority), b"", 0.0), 0, prompt, None)
    scheduler.add(seq)
    return seq


def _step(scheduler: Scheduler) -> list[tuple[str, int]]:
    """Schedule, then do what the runner would: mark the tokens computed and sample after a whole prompt."""
    batch = scheduler.schedule()
    for item in batch:
        item.seq.num_computed_tokens += item.num_tokens
        scheduler.manager.commit(item.seq)
        if item.seq.num_computed_tokens == item.seq.num_tokens:
            item.seq.token_ids.append(7)
    return [(item.seq.request.request_id, item.num_tokens) for item in batch]


def test_waiting_requests_are_admitted_in_arrival_order_within_the_token_budget():
    scheduler = _scheduler(budget=25)
    for name in "abc":
        _add(scheduler, name, 10)
    assert _step(scheduler) == [("a", 10), ("b", 10), ("c", 5)]  # c's prompt is cut to fit the budget
    assert _step(scheduler) == [("a", 1), ("b", 1), ("c", 5)]


def test_long_prompts_are_prefilled_in_chunks_of_the_budget():
    scheduler = _scheduler(budget=16)
    seq = _add(scheduler, "a", 40)
    assert [_step(scheduler) for _ in range(4)] == [[("a", 16)], [("a", 16)], [("a", 8)], [("a", 1)]]
    assert seq.num_output_tokens == 2


def test_max_num_seqs_bounds_the_running_set_until_one_finishes():
    scheduler = _scheduler(max_num_seqs=2)
    a, _, c = (_add(scheduler, name, 5) for name in "abc")
    assert _step(scheduler) == [("a", 5), ("b", 5)]
    assert _step(scheduler) == [("a", 1), ("b", 1)] and c.status is SequenceStatus.WAITING
    scheduler.finish(a)
    assert _step(scheduler) == [("b", 1), ("c", 5)]


def test_single_token_steps_go_before_prefill_chunks_whatever_their_age():
    scheduler = _scheduler(budget=10, prefix_caching=True)
    _add(scheduler, "x", 9)
    _step(scheduler)
    scheduler.finish(scheduler.running[0])  # x's two full blocks stay cached
    _add(scheduler, "a", 15, first=500)
    assert _step(scheduler) == [("a", 10)]
    _add(scheduler, "b", 9)  # x's prompt: only its last token is computed
    assert _step(scheduler) == [("b", 1), ("a", 5)]


def test_a_full_pool_preempts_the_newest_sequence_and_recomputes_it_later():
    scheduler = _scheduler(num_blocks=2)
    a, b = _add(scheduler, "a", BLOCK), _add(scheduler, "b", BLOCK)
    assert _step(scheduler) == [("a", BLOCK), ("b", BLOCK)]  # one block each: the pool is full
    assert _step(scheduler) == [("a", 1)]  # a needs a second block: b gives its one up
    assert scheduler.num_preemptions == 1 and list(scheduler.waiting) == [b]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    scheduler.finish(a)
    assert _step(scheduler) == [("b", BLOCK + 1)]  # its prompt and its sampled token again
    scheduler.finish(b)
    assert scheduler.manager.num_free_blocks == 2


def test_a_request_of_higher_priority_is_admitted_before_twenty_queued_ones():
    scheduler = _scheduler(num_blocks=128, max_num_seqs=2)
    queued = [_add(scheduler, f"low{i}", 5, priority=1) for i in range(20)]
    assert _step(scheduler) == [("low0", 5), ("low1", 5)]
    _add(scheduler, "urgent", 5, priority=-1)
    scheduler.finish(queued[0])
    assert _step(scheduler) == [("low1", 1), ("urgent", 5)]  # before the 18 that arrived earlier


def test_a_full_pool_preempts_the_lowest_priority_not_the_newest():
    scheduler = _scheduler(num_blocks=2)
    a = _add(scheduler, "a", BLOCK, priority=5)
    _add(scheduler, "b", BLOCK, priority=0)
    assert _step(scheduler) == [("b", BLOCK), ("a", BLOCK)]  # b runs first: it ranks higher
    assert _step(scheduler) == [("b", 1)]  # b needs a second block: a, of lower priority, gives its one up
    assert list(scheduler.waiting) == [a] and scheduler.num_preemptions == 1


def test_an_urgent_request_preempts_running_ones_of_lower_priority_when_the_pool_is_full():
    scheduler = _scheduler(num_blocks=4)
    a = _add(scheduler, "a", 2 * BLOCK, priority=1)
    b = _add(scheduler, "b", 2 * BLOCK, priority=2)
    assert _step(scheduler) == [("a", 2 * BLOCK), ("b", 2 * BLOCK)]  # the pool is full
    _add(scheduler, "urgent", BLOCK, priority=0)
    # b, the lowest priority, gives its blocks up: the urgent request is admitted in this step and
    # a keeps running beside it
    assert _step(scheduler) == [("a", 1), ("urgent", BLOCK)]
    assert b.status is SequenceStatus.WAITING and b.block_table == [] and scheduler.num_preemptions == 1
    assert a.status is SequenceStatus.RUNNING


def test_requests_of_equal_priority_never_preempt_each_other_to_be_admitted():
    scheduler = _scheduler(num_blocks=2, max_num_seqs=1)
    _add(scheduler, "a", BLOCK, priority=3)
    assert _step(scheduler) == [("a", BLOCK)]
    _add(scheduler, "b", BLOCK, priority=3)
    assert _step(scheduler) == [("a", 1)] and scheduler.num_preemptions == 0


def _add_tokens(scheduler: Scheduler, name: str, prompt: list[int]) -> Sequence:
    seq = Sequence(Request(name, None, prompt, SamplingParams(), b"", 0.0), 0, list(prompt), None)
    scheduler.add(seq)
    return seq


def test_a_prompt_sharing_blocks_a_running_prefill_computes_waits_for_them_to_be_cached():
    # a's 40-token prompt takes two steps; b and c share its first 32 tokens, d shares nothing.
    scheduler = _scheduler(budget=24, prefix_caching=True)
    shared = list(range(100, 132))
    _add_tokens(scheduler, "a", shared + list(range(500, 508)))
    assert _step(scheduler) == [("a", 24)]
    b = _add_tokens(scheduler, "b", shared + list(range(600, 610)))
    c = _add_tokens(scheduler, "c", [*shared, 700])
    _add(scheduler, "d", 6, first=900)
    assert _step(scheduler) == [("a", 16), ("d", 6)]  # b and c wait for a's blocks 6 and 7; d does not
    # a's prompt is cached now: b and c take its first 8 blocks and compute only the rest.
    assert _step(scheduler) == [("a", 1), ("d", 1), ("c", 1), ("b", 10)]
    assert b.num_computed_tokens == 42 and c.num_computed_tokens == 33
    assert scheduler.gauges()["num_prefix_waits"] == 2


def test_without_prefix_caching_nothing_waits_for_a_running_prefill():
    scheduler = _scheduler(budget=24)
    _add(scheduler, "a", 40)
    assert _step(scheduler) == [("a", 24)]
    _add(scheduler, "b", 40)
    assert _step(scheduler) == [("a", 16), ("b", 8)]
    assert scheduler.gauges()["num_prefix_waits"] == 0


# --- steps bounded in time (engine/pacing.py) ----------------------------------------------------

#: a fake machine's costs: a step's fixed part, each decode row, each prefill token (seconds)
STEP_S, ROW_S, TOKEN_S = 0.004, 0.001, 0.0005
TARGET_S = 0.030


def _cost(batch: list[tuple[str, int]]) -> tuple[int, int, float]:
    rows = sum(1 for _, n in batch if n == 1)
    tokens = sum(n for _, n in batch if n > 1)
    return tokens, rows, STEP_S + ROW_S * rows + TOKEN_S * tokens


def _paced_step(scheduler: Scheduler, pacer: StepPacer) -> tuple[list[tuple[str, int]], float]:
    """One step with the pacer's budget, timed on the fake clock; the pacer learns from it."""
    decoding = sum(1 for s in scheduler.running if s.num_schedulable == 1)
    scheduler.prefill_budget = pacer.prefill_budget(decoding)
    batch = _step(scheduler)
    tokens, rows, seconds = _cost(batch)
    pacer.observe(tokens, rows, seconds)
    return batch, seconds


def test_a_long_prompt_beside_eight_decodes_keeps_every_step_near_the_target_and_alone_gets_the_budget():
    scheduler = _scheduler(num_blocks=512, max_num_seqs=16, budget=512)
    pacer = StepPacer(TARGET_S, max_tokens=512, min_tokens=BLOCK)
    for name in "abcdefgh":
        _add(scheduler, name, 8)
    for _ in range(4):  # the eight prompts in, then decodes: the pacer learns a decode step's cost
        _paced_step(scheduler, pacer)
    long = _add(scheduler, "long", 1000, first=5000)
    paced, over = pacer.num_paced_steps, pacer.num_steps_over_target
    times = []
    while long.num_computed_tokens < 1000:
        batch, seconds = _paced_step(scheduler, pacer)
        assert sum(1 for _, n in batch if n == 1) == 8, "every decode runs in every step"
        times.append(seconds)
    # The first step runs on the assumed cost per token; from then on every step stays within one
    # decode row's cost of the target.
    assert max(times[1:]) <= TARGET_S + ROW_S, times
    assert pacer.num_paced_steps - paced == len(times)
    assert pacer.num_steps_over_target - over == sum(t > TARGET_S for t in times)
    assert len(times) < 1000 / ((TARGET_S - STEP_S - 8 * ROW_S) / TOKEN_S) + 4  # and prefill keeps pace
    alone = _scheduler(num_blocks=512, budget=512)
    lone = StepPacer(TARGET_S, max_tokens=512, min_tokens=BLOCK)
    _add(alone, "long", 1000)
    assert _paced_step(alone, lone)[0] == [("long", 512)], "with nothing decoding, the chunk is the budget"


def _add_for(scheduler: Scheduler, name: str, tenant: str | None, prompt_len: int = 5) -> Sequence:
    seq = _add(scheduler, name, prompt_len)
    seq.request.tenant = tenant
    return seq


def test_a_tenant_with_thirty_queued_requests_does_not_starve_one_with_a_single_request():
    scheduler = _scheduler(num_blocks=256, max_num_seqs=2)
    busy = [_add_for(scheduler, f"busy{i}", "tenant-a") for i in range(30)]
    assert _step(scheduler) == [("busy0", 5), ("busy1", 5)]
    _add_for(scheduler, "lone", "tenant-b")  # arrives behind 28 queued requests of tenant-a
    scheduler.finish(busy[0])
    assert _step(scheduler) == [("busy1", 1), ("lone", 5)]  # the next prefill turn is its
    scheduler.finish(busy[1])
    assert [name for name, _ in _step(scheduler)] == ["lone", "busy2"]  # then tenant-a's queue goes on
    assert set(scheduler.served) == {"tenant-a"}, "a tenant that waits no more is forgotten"
