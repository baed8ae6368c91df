"""The engine on the bundled SmolLM2 model: exactness against transformers, batching, paging."""

import os

import pytest
import torch

from kvbank import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)

TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "List three colors:",
    "Water boils at",
    "The quick brown fox",
    "In 1492, Columbus",
    "My favourite recipe for pancakes needs flour, eggs and",
    "Q: What is the largest planet in the solar system?\nA:",
]


@pytest.fixture(scope="module")
def llm():
    """float32, to compare with transformers' float32 reference."""
    return LLM(dtype="float32")


@pytest.fixture(scope="module")
def default_llm():
    """The default configuration (bfloat16, packed weights, batch-invariant): what batching,
    preemption and sampling must leave exact is tested where users run it."""
    return LLM()


@pytest.fixture(scope="module")
def hf_model(bundled_transformers_model):
    return bundled_transformers_model


def _prompts(llm) -> list[list[int]]:
    tok = llm.get_tokenizer()
    chat = tok.apply_chat_template([{"role": "user", "content": "Write a haiku about the sea."}], tokenize=True)
    return [tok.encode(t) for t in TEXTS] + [chat]


def _assert_all_free(llm):
    manager = llm.engine.manager
    assert manager.num_free_blocks == llm.engine.num_blocks
    assert all(block.ref_count == 0 for block in manager.pool.blocks)


@pytest.mark.slow
def test_greedy_matches_transformers(llm, hf_model):
    prompts = _prompts(llm)
    assert len(prompts) >= 10
    outputs = llm.generate(prompts, GREEDY)
    # transformers' reference in one left-padded batch (it derives each row's positions from the
    # mask); an explicit mask, since the chat prompt holds <|im_end|>, which is also the pad id.
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        ref = hf_model.generate(
            ids, attention_mask=mask, max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    for row, (prompt, output) in enumerate(zip(prompts, outputs)):
        assert output.outputs[0].token_ids == ref[row, width:].tolist(), llm.get_tokenizer().decode(prompt)
    _assert_all_free(llm)


def test_prompt_logprobs_match_transformers(llm, hf_model):
    prompt = llm.get_tokenizer().encode(TEXTS[2])
    output = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(prompt)
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt])).logits[0].log_softmax(-1)
    for i in range(1, len(prompt)):
        entry = output.prompt_logprobs[i]
        assert abs(entry[prompt[i]].logprob - ref[i - 1, prompt[i]].item()) < 1e-3
        assert {token for token, lp in entry.items() if lp.rank <= 2} == set(ref[i - 1].topk(2).indices.tolist())


def _mixed_prompts(llm) -> list[list[int]]:
    tok = llm.get_tokenizer()
    base = tok.encode(" ".join(TEXTS))
    return [base[: 3 + (i * 37) % len(base)] + tok.encode(f" Item {i}:") for i in range(10)]


def _tokens_and_logprobs(outputs) -> list[tuple]:
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs) for o in outputs]


@pytest.mark.slow
def test_tokens_and_logprobs_do_not_depend_on_chunking_or_neighbours(default_llm):
    """Each prompt in one chunk alone, in chunks of 16 alone, and in chunks of 64 beside the others
    (prefills mixed with decodes): the same tokens and the same logprobs, bit for bit."""
    prompts = _mixed_prompts(default_llm)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    alone = _tokens_and_logprobs(default_llm.generate([p], params)[0] for p in prompts)
    scheduler = default_llm.engine.scheduler
    try:
        scheduler.max_num_batched_tokens = 16
        small = _tokens_and_logprobs(default_llm.generate([p], params)[0] for p in prompts[-3:])
        scheduler.max_num_batched_tokens = 64
        together = _tokens_and_logprobs(default_llm.generate(prompts, params))
    finally:
        scheduler.max_num_batched_tokens = 2048
    assert max(len(p) for p in prompts[-3:]) > 64, "the small-chunk runs split their prompts"
    assert small == alone[-3:]
    assert together == alone
    _assert_all_free(default_llm)


@pytest.mark.slow
def test_preemption_keeps_results_exact(default_llm):
    prompts = _mixed_prompts(default_llm)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in default_llm.generate(prompts, params)]
    small = LLM(num_gpu_blocks=24, enable_prefix_caching=False)
    got = [o.outputs[0].token_ids for o in small.generate(prompts, params)]
    assert small.stats()["num_preemptions"] > 0
    assert got == expected
    _assert_all_free(small)


def test_waiting_prompt_tokens_count_the_prompts_not_scheduled_yet(default_llm):
    engine, prompts = default_llm.engine, _prompts(default_llm)[:3]
    for i, ids in enumerate(prompts):
        engine.add_request(ids, SamplingParams(max_tokens=2), f"waiting-{i}")
    assert engine.waiting_prompt_tokens() == sum(map(len, prompts))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.waiting_prompt_tokens() == 0


def test_parallel_sampling_shares_prompt_blocks(llm):
    engine = llm.engine
    prompt = llm.get_tokenizer().encode(" ".join(TEXTS))[:40]  # 2 full blocks + 8 tokens
    params = SamplingParams(n=4, temperature=1.0, seed=123, max_tokens=8, ignore_eos=True)
    engine.add_request(prompt, params, request_id="fork")
    while not engine.requests["fork"].forked:
        engine.step()
    used = lambda: engine.num_blocks - engine.manager.num_free_blocks  # noqa: E731
    assert used() == 3  # four sequences, one copy of the prompt
    engine.step()
    assert used() == 3 + 3  # the shared partial block was copied for three of the four writers
    while engine.has_unfinished_requests():
        engine.step()
    first = llm.generate([prompt], params)[0]
    again = llm.generate([prompt], params)[0]
    texts = [c.token_ids for c in first.outputs]
    assert len(texts) == 4 and texts == [c.token_ids for c in again.outputs]
    assert len({tuple(t) for t in texts}) > 1
    _assert_all_free(llm)


def test_seeded_sampling_is_independent_of_batch(default_llm):
    prompts = _prompts(default_llm)[:4]
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7, max_tokens=12, ignore_eos=True)
    alone = default_llm.generate([prompts[1]], params)[0].outputs[0].token_ids
    batched = default_llm.generate(prompts, params)[1].outputs[0].token_ids
    assert alone == batched


def test_top_k_one_is_greedy(default_llm):
    prompt = _prompts(default_llm)[0]
    greedy = default_llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    sampled = default_llm.generate([prompt], SamplingParams(temperature=1.5, top_k=1, max_tokens=32, ignore_eos=True))[
        0
    ]
    assert sampled.outputs[0].token_ids == greedy


def test_logprobs_and_stop_strings(llm):
    prompt = TEXTS[0]
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, logprobs=3, ignore_eos=True))[0].outputs[0]
    assert len(full.logprobs) == len(full.token_ids)
    for token, entry in zip(full.token_ids, full.logprobs):
        assert entry[token].rank == 1 and len(entry) == 3
    assert full.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(full.token_ids, full.logprobs)))
    stop = full.text.strip().split()[1]
    cut = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, stop=[stop]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full.text[: full.text.index(stop)]
    assert full.finish_reason == "length"


def test_generation_ending_inside_a_character_keeps_its_bytes_as_a_replacement_character(llm):
    tok = llm.get_tokenizer()
    first_byte = tok.encode("☕")[0]  # ☕ takes three bytes; this token holds only the first
    assert tok.decode([first_byte]) == "\ufffd"
    forced = dict(temperature=0, max_tokens=1, logit_bias={first_byte: 100})
    out = llm.generate(TEXTS[0], SamplingParams(**forced))[0].outputs[0]
    assert out.token_ids == [first_byte] and out.text == "\ufffd" and out.finish_reason == "length"
    cut = llm.generate(TEXTS[0], SamplingParams(stop=["\ufffd"], **forced))[0].outputs[0]
    assert cut.text == "" and cut.finish_reason == "stop" and cut.stop_reason == "\ufffd"


def test_stream_yields_growing_text(llm):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    chunks = list(llm.stream(TEXTS[3], params))
    final = llm.generate(TEXTS[3], params)[0].outputs[0]
    assert chunks[-1].finished and chunks[-1].outputs[0].text == final.text
    assert len(chunks) == 12
    assert all(a.outputs[0].text == b.outputs[0].text[: len(a.outputs[0].text)] for a, b in zip(chunks, chunks[1:]))


def test_stream_abandoned_frees_blocks(llm):
    stream = llm.stream(TEXTS[4], SamplingParams(temperature=0, max_tokens=50))
    next(stream)
    stream.close()
    _assert_all_free(llm)


def test_chat_renders_the_template_and_answers_like_transformers(llm, hf_model):
    tok = llm.get_tokenizer()
    messages = [{"role": "user", "content": "Say hello."}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=16))[0]
    prompt = tok.apply_chat_template(messages, tokenize=True)
    assert out.prompt_token_ids == prompt and prompt[:1] == tok.encode("<|im_start|>")
    with torch.no_grad():
        ids = torch.tensor([prompt])
        ref = hf_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=16,
            do_sample=False,
            eos_token_id=sorted(tok.stop_token_ids),
        )[0, len(prompt) :].tolist()
    answer = out.outputs[0]
    assert answer.token_ids == ref
    assert answer.text == tok.decode(ref) and answer.text.strip()


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ("", None, "empty"),
        ([], None, "empty"),
        ([10**6], None, "out of range"),
        ("hi", SamplingParams(max_tokens=9000), "max_model_len=8192"),
        ("hi", SamplingParams(logit_bias={10**6: 1.0}), r"logit_bias token id=1000000 is out of range \[0, 49152\)"),
        ("hi", SamplingParams(stop_token_ids=[49152]), r"stop_token_ids=49152 is out of range"),
    ],
)
def test_bad_requests_raise_and_leak_nothing(llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([TEXTS[0], prompt], params)
    assert not llm.engine.has_unfinished_requests()
    _assert_all_free(llm)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=-1),
        dict(top_p=0),
        dict(n=0),
        dict(top_k=-5),
        dict(max_tokens=0),
        dict(logprobs=99),
        dict(stop=[""]),
    ],
)
def test_bad_sampling_params_raise(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)


def test_bad_engine_config_raises():
    with pytest.raises(ValueError, match="float16"):
        LLM(dtype="float16", device="cpu")
    with pytest.raises(ValueError, match="max_model_len=100000"):
        LLM(max_model_len=100000)


def test_padded_rows_come_from_few_sizes_and_waste_little():
    from kvbank.models.llama import padded_rows

    sizes = {padded_rows(n) for n in range(1, 2049)}
    assert len(sizes) == 8 + 47
    assert all(n <= padded_rows(n) <= max(n + 7, n * 1.125) for n in range(1, 5000))


def test_bfloat16_matmul_row_padding_changes_no_result():
    llm = LLM(dtype="bfloat16", num_gpu_blocks=64, enable_prefix_caching=False)
    model = llm.engine.runner.model
    assert model.pad_rows  # CPU bfloat16 pads its matmul rows
    prompts = [list(range(1000, 1037)), list(range(2000, 2020))]  # 57 prefill rows: 64 padded
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=1)
    padded = llm.generate(prompts, params)
    model.pad_rows = False
    exact = llm.generate(prompts, params)
    for a, b in zip(padded, exact):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [{t: p.logprob for t, p in d.items()} for d in a.prompt_logprobs[1:]] == [
            {t: p.logprob for t, p in d.items()} for d in b.prompt_logprobs[1:]
        ]


def test_native_norm_and_rope_match_pytorch_ops(native):
    import torch.nn.functional as F

    from kvbank.models.llama import apply_rope

    gen = torch.Generator().manual_seed(0)
    x, res = (torch.randn(11, 576, generator=gen).bfloat16() for _ in range(2))
    weight = (1 + torch.randn(576, generator=gen) * 0.1).bfloat16()
    residual = res.clone()
    normed = native.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(residual, x + res)  # added in place, rounded like PyTorch
    torch.testing.assert_close(normed, F.rms_norm(x + res, (576,), weight, 1e-5), atol=0, rtol=1 / 128)
    assert (normed != F.rms_norm(x + res, (576,), weight, 1e-5)).float().mean() < 0.01
    qkv = torch.randn(11, 15 * 64, generator=gen).bfloat16()
    cos, sin = torch.randn(11, 64, generator=gen).bfloat16(), torch.randn(11, 64, generator=gen).bfloat16()
    expected = apply_rope(qkv.view(11, 15, 64)[:, :12], cos.unsqueeze(1), sin.unsqueeze(1))
    rotated = qkv.clone()
    native.rope_(rotated, cos, sin, 12)
    assert torch.equal(rotated.view(11, 15, 64)[:, :12], expected)
    assert torch.equal(rotated.view(11, 15, 64)[:, 12:], qkv.view(11, 15, 64)[:, 12:])  # v untouched
    with pytest.raises(RuntimeError, match="residual"):
        native.add_rms_norm(x, res[:3], weight, 1e-5)


def test_bfloat16_engine_with_native_layers_matches_pytorch_ops(native):
    from pathlib import Path

    llm = LLM(dtype="bfloat16", num_gpu_blocks=64, enable_prefix_caching=False)
    model = llm.engine.runner.model
    assert model.norm.native is native  # CPU bfloat16 runs the fused ops
    text = (Path(__file__).parent / "data" / "austen_excerpt.txt").read_text()
    prompt = llm.get_tokenizer().encode(text[:400])
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)

    def logprobs(engine):
        return torch.tensor(
            [next(iter(d.values())).logprob for d in engine.generate([prompt], params)[0].prompt_logprobs[1:]]
        )

    fused = logprobs(llm)
    model.use_native(None)
    plain = logprobs(llm)
    exact = logprobs(LLM(dtype="float32", num_gpu_blocks=64, enable_prefix_caching=False))
    # The norm sums its squares in another order than PyTorch's kernel, so last bits differ now and
    # then; bfloat16 amplifies that as it amplifies any rounding. Both must be as close to float32.
    fused_error, plain_error = (fused - exact).abs().mean(), (plain - exact).abs().mean()
    assert fused_error < 1.5 * plain_error and plain_error < 0.1, (fused_error, plain_error)


def test_engine_without_a_compiler_runs_on_pytorch_alone(tmp_path):
    import subprocess
    import sys

    script = (
        "from kvbank import LLM, SamplingParams, kernels\n"
        "llm = LLM(dtype='bfloat16', num_gpu_blocks=32)\n"
        "assert kernels.native() is None and 'Error building extension' in kernels.failure(), kernels.failure()\n"
        "assert llm.engine.runner.storage.kind('dense').decode_kernel is None\n"
        "assert llm.engine.runner.model.norm.native is None\n"
        "out = llm.generate([list(range(1000, 1020))] * 2, SamplingParams(max_tokens=4, ignore_eos=True))\n"
        "assert [len(o.outputs[0].token_ids) for o in out] == [4, 4]\n"
    )
    env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"), TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "native CPU kernels unavailable" in result.stderr
