"""Greedy output of the default configuration (bfloat16, packed 4-bit weights, CPU) does not depend
on what else runs: the same request gives the same tokens, and the same log-probabilities to the
bit, alone, among copies of itself, among other prompts, and after a busy period filled the prefix
cache with K/V from batched steps. Every test runs at each instruction-set level the CPU has from
avx2 up (kvbank/kernels/isa.h): the property holds for every variant of the kernels."""

import pytest
import torch
from conftest import cpu_levels

from kvbank import LLM, SamplingParams
from kvbank.attention import AttentionMetadata
from kvbank.attention.fast import DECODE_PARTITION, DenseStep, native_decode_kernel, paged_attention

LEVELS = cpu_levels("avx2")
pytestmark = [
    pytest.mark.parametrize("isa_level", LEVELS, indirect=True, scope="module"),
    pytest.mark.skipif(
        not LEVELS, reason="batch invariance is kept from avx2 up, and this CPU (or build) runs no such level"
    ),
]
GREEDY = SamplingParams(temperature=0, max_tokens=16, logprobs=0)


@pytest.fixture(scope="module")
def llm(native, isa_level):
    # A small token budget makes longer prompts prefill in chunks whose size depends on the load.
    llm = LLM(max_num_batched_tokens=96, num_gpu_blocks=512)
    assert llm.engine.runner.storage.kind("dense").attend_rows, (
        f"the default configuration attends by rows at {isa_level}"
    )
    assert llm.engine.runner.model.layers[0].native is not None, f"the model runs on the integer kernels at {isa_level}"
    assert llm.engine.stats()["kernel_isa"]["active"] == isa_level
    assert llm.engine.stats()["batch_invariant"], "the engine reports the property it keeps"
    return llm


def _chat(llm: LLM, text: str) -> list[int]:
    return llm.render_chat([{"role": "user", "content": text}])


def _answers(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    outputs = llm.generate(prompts, GREEDY)
    return [
        (o.outputs[0].token_ids, [step[token] for step, token in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
        for o in outputs
    ]


def test_greedy_answer_is_the_same_alone_batched_mixed_and_after_a_busy_period(llm):
    request = _chat(llm, "Explain why the sky is blue, and what colour sunsets are.")
    others = [_chat(llm, f"Tell story {i} about a {'very ' * (9 * i)}small cat.") for i in range(5)]
    alone = _answers(llm, [request])[0]
    assert len(alone[0]) == GREEDY.max_tokens
    together = _answers(llm, [request] * 16)
    assert all(answer == alone for answer in together)
    mixed = _answers(llm, others[:2] + [request] + others[2:])
    assert mixed[2] == alone
    assert _answers(llm, [request])[0] == alone  # its prompt's K/V now come from the batched steps


@pytest.mark.parametrize(
    "policy", ["sink_window(sinks=4,window=128)", "h2o(heavy=64,recent=64)", "snapkv(budget=128,window=32)"]
)
def test_greedy_answer_under_a_kv_policy_is_the_same_alone_and_batched(llm, policy):
    # Evictions are per sequence and attention per row, so the default configuration stays invariant.
    request = _chat(llm, "Write about the history of the number zero. " * 12)
    others = [_chat(llm, f"List {i} reasons to learn {'the violin ' * (3 * i)}.") for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=0, ignore_eos=True, kv_policy=policy)

    def answers(prompts):
        return [
            (o.outputs[0].token_ids, [s[t] for s, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in llm.generate(prompts, params)
        ]

    alone = answers([request])[0]
    mixed = answers(others[:1] + [request] + others[1:] + [request])
    assert mixed[1] == alone and mixed[-1] == alone
    assert llm.engine.stats()[f"evicted_tokens_{policy.split('(')[0]}"] > 0


def _pool_with(lengths: list[int], heads: int, dim: int, block: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    blocks = sum(-(-n // block) for n in lengths)
    k_cache, v_cache = (torch.randn(blocks, block, heads, dim, generator=generator).to(torch.bfloat16) for _ in "kv")
    order = torch.randperm(blocks, generator=generator).tolist()  # blocks of a sequence lie anywhere
    tables, first = [], 0
    for n in lengths:
        count = -(-n // block)
        tables.append(order[first : first + count])
        first += count
    return k_cache, v_cache, tables


def _attend(q: torch.Tensor, k_cache, v_cache, rows: list[tuple[list[int], int]], kernel) -> torch.Tensor:
    """Attention of query rows, each given as (its sequence's block table, its position)."""
    width = max(len(table) for table, _ in rows)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(len(rows), dtype=torch.long),
        num_decode_tokens=0,
        decode_block_tables=None,
        decode_context_lens=None,
        prefills=[],
        block_size=k_cache.shape[1],
        dtype=k_cache.dtype,
    )
    step = DenseStep(kernel, [])
    step.row_block_tables = torch.tensor([table + [0] * (width - len(table)) for table, _ in rows])
    step.row_context_lens = torch.tensor([position + 1 for _, position in rows])
    return paged_attention(q, None, None, k_cache, v_cache, meta, step, 0.125)


def test_a_query_rows_attention_is_the_same_however_its_prompt_is_chunked_and_batched(native, isa_level):
    heads, kv_heads, dim, block = 9, 3, 64, 16
    kernel = native_decode_kernel(torch.device("cpu"), torch.bfloat16, heads, kv_heads, dim, block)
    assert kernel is not None and kernel.dense_attention_isa() != "scalar"
    prompt, other = 600, 2 * DECODE_PARTITION + 40  # both span several partitions
    k_cache, v_cache, (table, other_table) = _pool_with([prompt, other], kv_heads, dim, block, seed=0)
    queries = torch.randn(prompt, heads, dim, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    whole = _attend(queries, k_cache, v_cache, [(table, p) for p in range(prompt)], kernel)
    for start, end in ((0, 1), (0, 97), (255, 300), (511, 600), (599, 600)):  # chunks, and a decode at the end
        others = [(other_table, p) for p in (5, 300, other - 1)]
        rows = others[:1] + [(table, p) for p in range(start, end)] + others[1:]
        q = torch.cat((queries[:1], queries[start:end], queries[:2]))
        chunk = _attend(q, k_cache, v_cache, rows, kernel)[1 : 1 + end - start]
        assert torch.equal(chunk, whole[start:end]), (start, end)


def test_a_tokens_kv_is_the_same_from_prefill_and_from_decode(llm, monkeypatch):
    written: list[list[tuple[torch.Tensor, torch.Tensor]]] = []  # per step, per layer: the last token's K, V
    rows: list[int] = []  # per step: how many tokens it computed
    layers = llm.engine.runner.storage.layers
    # The layer-by-layer path, whose writes go through `write`; the one-call decoder stack writes
    # the same bits in native code (the last test here compares the two).
    monkeypatch.setattr(type(llm.engine.runner.model), "_stack_attention", lambda *args: None)
    for layer in layers:

        def record(k, v, meta, layer=layer, write=layer.write):
            if layer is layers[0]:
                written.append([])
                rows.append(k.shape[0])
            written[-1].append((k[-1].clone(), v[-1].clone()))
            return write(k, v, meta)

        monkeypatch.setattr(layer, "write", record)
    prompt = _chat(llm, "Name three rivers of Europe, and say which of them is the longest.")
    token = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2))[0].outputs[0].token_ids[0]
    decoded = written[-1]  # the second step decoded `token`
    written.clear()
    rows.clear()
    # The prompt's blocks are cached now: the last one is recomputed, `token` included, as a prefill chunk.
    llm.generate([prompt + [token]], SamplingParams(temperature=0, max_tokens=1))
    prefilled = written[0]
    assert rows[0] > 1
    assert len(prefilled) == len(decoded) == len(layers)
    assert all(torch.equal(a, b) for pair_a, pair_b in zip(decoded, prefilled) for a, b in zip(pair_a, pair_b))


def test_the_one_call_decoder_stack_gives_the_layer_by_layer_bits(llm, monkeypatch):
    model = llm.engine.runner.model
    prompts = [_chat(llm, f"Give me {i + 2} reasons to learn {'the history of ' * i}chemistry.") for i in range(4)]
    steps = []
    stack = type(model)._stack_attention
    monkeypatch.setattr(type(model), "_stack_attention", lambda *args: steps.append(stack(*args)) or steps[-1])
    fused = _answers(llm, prompts)
    assert any(s is not None for s in steps)  # the stack ran (every step attends by rows here)
    monkeypatch.setattr(type(model), "_stack_attention", lambda *args: None)
    assert _answers(llm, prompts) == fused


@pytest.mark.slow
def test_the_decoder_stack_gives_the_same_bits_at_every_thread_count(llm, isa_level, monkeypatch):
    """The stack's threads meet at its spin barrier after every matmul and take work on demand.
    Many calls of uneven work (prefill chunks beside decodes, a batch that shrinks as sequences end)
    at several thread counts, more than the cores included (waiting threads yield): every call's
    hidden states equal one thread's, bit for bit (a thread past the barrier early reads rows not yet
    written; work taken twice or never changes them)."""
    if isa_level != LEVELS[-1]:
        pytest.skip("the barrier and the work queues are the same at every level: tested at the CPU's own")
    engine, model = llm.engine, llm.engine.runner.model
    # Without the step-time target every run schedules the same steps (chunks sized by the token budget).
    monkeypatch.setattr(engine, "pacer", None)
    monkeypatch.setattr(engine.scheduler, "prefill_budget", None)
    stack, forward = type(model)._stack_attention, type(model).forward
    ran: list[bool] = []
    calls: list[tuple[bool, torch.Tensor]] = []

    def recording_stack(*args):
        step = stack(*args)
        ran.append(step is not None)
        return step

    def recording_forward(*args, **kwargs):
        hidden = forward(*args, **kwargs)
        calls.append((ran.pop(), hidden.clone()))
        return hidden

    monkeypatch.setattr(type(model), "_stack_attention", recording_stack)
    monkeypatch.setattr(type(model), "forward", recording_forward)
    prompts = [_chat(llm, f"Describe {'a long and winding ' * (4 * i)}road number {i}.") for i in range(5)]
    params = [SamplingParams(temperature=0, max_tokens=4 + 6 * i, ignore_eos=True) for i in range(5)]

    def run(threads: int) -> list[tuple[bool, torch.Tensor]]:
        calls.clear()
        llm.reset_prefix_cache()  # every run computes every prompt
        torch.set_num_threads(threads)
        llm.generate(prompts, params)
        return list(calls)

    previous = torch.get_num_threads()
    try:
        alone = run(1)
        runs = {threads: run(threads) for threads in (2, 3, 4)}
    finally:
        torch.set_num_threads(previous)
    assert len(alone) >= 30 and all(stacked for stacked, _ in alone), "every step runs the stack"
    assert len({hidden.shape[0] for _, hidden in alone}) >= 5, "rows vary from step to step"
    for threads, calls_at in runs.items():
        assert [h.shape for _, h in calls_at] == [h.shape for _, h in alone], threads
        for i, ((_, a), (_, b)) in enumerate(zip(alone, calls_at)):
            assert torch.equal(a, b), (threads, i)
