"""Gemma 3 270M (the gemma3 GGUF architecture) against transformers' reading of the same file:
greedy tokens in float32 (sliding windows included), the tokenizer, the chat template; the
default bfloat16 configuration; and the configurations it refuses."""

import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F
from gemma import gemma_path, transformers_folder

from kvbank import LLM, SamplingParams
from kvbank.attention.metadata import AttentionMetadata, PrefillChunk
from kvbank.attention.window import window_attention, window_rows
from kvbank.config import EngineConfig
from kvbank.models.build import check_supported
from kvbank.models.loader import describe_model

GREEDY = SamplingParams(temperature=0, max_tokens=24)
STORY = (
    "The lighthouse keeper had lived on the island for thirty-one years. Every evening he climbed the "
    "spiral stairs, trimmed the wick, polished the great lens and watched the ships pass. "
)
PROMPTS = [
    "The capital of France is",
    "Write a Python function that returns the n-th Fibonacci number.\n\ndef fib(n):",
    # longer than the 512-token window: the local layers no longer see the start
    "Remember this number: 7391.\n\n" + STORY * 14 + "\nQuestion: what number did I ask you to remember?\nAnswer:",
]
# Gemma 3's published chat template (the GGUF carries none): both renderers must agree on it.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}{%- set first_user_prefix = "
    "messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}{%- else -%}"
    "{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{%- set role = 'model' -%}{%- else -%}"
    "{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


@pytest.fixture(scope="module")
def path():
    return gemma_path()


@pytest.fixture(scope="module")
def reference(path):
    import transformers

    folder = transformers_folder(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, transformers.AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def llm32(path):
    # A 256-token budget prefills the long prompt in chunks, next to the other prompts' decodes.
    return LLM(path, dtype="float32", max_num_batched_tokens=256, num_gpu_blocks=256, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def llm(path):
    # the default hybrid cache: a block holds 3 layers, 15 windowed layers hold their windows
    return LLM(path, num_gpu_blocks=1024, max_num_batched_tokens=512)


@pytest.fixture(scope="module")
def llm_full(path):
    # every token in every layer (llama.cpp's --swa-full): 18 layers per block
    return LLM(path, num_gpu_blocks=256, max_num_batched_tokens=512, swa_full=True)


@pytest.fixture(scope="module")
def llm32_greedy(llm32):
    """llm32's greedy answers to PROMPTS (24 tokens, 5 logprobs): float32 Gemma takes seconds a run."""
    return llm32.generate(_encode(llm32, PROMPTS), SamplingParams(temperature=0, max_tokens=24, logprobs=5))


def _encode(llm, prompts):
    return [llm.get_tokenizer().encode(p) for p in prompts]


def test_metadata_gives_gemmas_shape(path):
    config = describe_model(path).config
    assert (config.arch, config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (
        "gemma3",
        18,
        4,
        1,
        256,
    )
    assert config.layer_windows == tuple(None if (i + 1) % 6 == 0 else 512 for i in range(18))
    assert (config.rope_theta, config.rope_local_theta, config.query_pre_attn_scalar) == (1e6, 1e4, 256)
    assert config.final_logit_softcapping is None and config.tie_word_embeddings and not config.attention_bias


@pytest.mark.slow
def test_greedy_tokens_match_transformers_in_float32_and_need_the_window(llm32, llm32_greedy, reference, monkeypatch):
    model, _ = reference
    prompts = _encode(llm32, PROMPTS)
    assert len(prompts[2]) > 520
    outputs = llm32_greedy
    for prompt, output in zip(prompts, outputs):
        with torch.inference_mode():
            expected = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt) :]
        assert output.outputs[0].token_ids == expected.tolist()
    # Without the window the long prompt's first answer differs: the test above would fail.
    for layer in llm32.engine.runner.model.layers:
        monkeypatch.setattr(layer.self_attn, "window", None)
    unwindowed = llm32.generate(prompts[2:], SamplingParams(temperature=0, max_tokens=1, logprobs=5))
    first, other = outputs[2].outputs[0].logprobs[0], unwindowed[0].outputs[0].logprobs[0]
    assert max(abs(first[t].logprob - other[t].logprob) for t in set(first) & set(other)) > 0.01


def test_window_attention_reads_exactly_the_last_window_positions():
    torch.manual_seed(0)
    window, block_size, heads, dim, length = 8, 4, 4, 16, 21
    keys, values = torch.randn(length, 1, dim), torch.randn(length, 1, dim)
    table = torch.randperm(8)[:6]
    k_cache, v_cache = torch.zeros(8, block_size, 1, dim), torch.zeros(8, block_size, 1, dim)
    slots = table[torch.arange(length) // block_size] * block_size + torch.arange(length) % block_size
    k_cache.view(-1, 1, dim)[slots], v_cache.view(-1, 1, dim)[slots] = keys, values
    q = torch.randn(length, heads, dim)
    # one decode at the last position, then a chunk continuing from position 5
    meta = AttentionMetadata(
        slot_mapping=slots[[20, *range(5, 20)]],
        num_decode_tokens=1,
        decode_block_tables=table.unsqueeze(0),
        decode_context_lens=torch.tensor([length]),
        prefills=[PrefillChunk(1, 16, 5, table)],
        block_size=block_size,
        dtype=torch.float32,
    )
    rows = q[[20, *range(5, 20)]]
    got = window_attention(rows, k_cache, v_cache, window_rows(meta, window), 0.25)
    key, query = torch.arange(length).unsqueeze(0), torch.arange(length).unsqueeze(1)
    visible = (key <= query) & (key > query - window)  # transformers' sliding-window mask
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), attn_mask=visible, scale=0.25, enable_gqa=True
    ).transpose(0, 1)
    torch.testing.assert_close(got, expected[[20, *range(5, 20)]])
    # the last position again, now inside a prefill chunk: the same bits as its decode
    chunked = dataclasses.replace(
        meta,
        slot_mapping=slots[5:],
        num_decode_tokens=0,
        decode_block_tables=None,
        decode_context_lens=None,
        prefills=[PrefillChunk(0, 16, 5, table)],
    )
    assert torch.equal(window_attention(q[5:], k_cache, v_cache, window_rows(chunked, window), 0.25)[-1], got[0])


TEXTS = [
    "Hello world",
    "  two leading spaces,   runs   of spaces\n\n\n\ttabs\r\nand CRLF",
    "digits 0 7 42 1234567890 3.14159 1,000,000 -12e-3",
    "héllo naïve café Ünïcödé 日本語のテキスト 한국어 Привет мир عربى",
    "emoji 😀👍🏽 👨‍👩‍👧 🇫🇷 ✨",
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "a\u00a0b\u200bc\u3000d",
    "",
    " ",
    "def f(x):\n    return {'k': x ** 2}  # square",
]


def test_tokenizer_matches_transformers(llm, reference):
    ours, (_, theirs) = llm.get_tokenizer(), reference
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs(text).input_ids, text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids), text
    assert (ours.bos_token_id, ours.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id)
    assert ours.stop_token_ids == {theirs.eos_token_id, theirs.convert_tokens_to_ids("<end_of_turn>")}


def test_chat_template_renders_like_transformers(llm, reference):
    ours, (_, theirs) = llm.get_tokenizer(), reference
    messages = [{"role": "user", "content": "Hi!"}]
    assert ours.chat_template is None and theirs.chat_template is None  # the file carries none
    with pytest.raises(ValueError, match="no chat template"):
        ours.apply_chat_template(messages)
    conversation = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "  And 3 + 3?  "},
    ]
    ours.chat_template = GEMMA3_TEMPLATE
    try:
        for generation_prompt in (True, False):
            expected = theirs.apply_chat_template(
                conversation, chat_template=GEMMA3_TEMPLATE, tokenize=False, add_generation_prompt=generation_prompt
            )
            assert ours.apply_chat_template(conversation, add_generation_prompt=generation_prompt) == expected
        assert ours.apply_chat_template(conversation, tokenize=True) == theirs.apply_chat_template(
            conversation, chat_template=GEMMA3_TEMPLATE, tokenize=True, add_generation_prompt=True, return_dict=False
        )
    finally:
        ours.chat_template = None


def _chat(llm, text):
    return llm.get_tokenizer().encode(f"<start_of_turn>user\n{text}<end_of_turn>\n<start_of_turn>model\n")


def test_default_bfloat16_completes_in_fluent_english(llm):
    assert llm.engine.runner.model.norm.weight.dtype == torch.bfloat16
    text = llm.generate(_encode(llm, PROMPTS[:1]), GREEDY)[0].outputs[0].text
    assert "France" in text and re.fullmatch(r"[A-Za-z0-9 ,.'\n-]+", text), text


def test_every_weight_of_the_q4_k_m_file_runs_on_the_integer_kernels(llm, path):
    """Q5_0 projections as 5-bit records (8-bit where fused with a Q8_0 tensor), Q4_K as 4-bit
    records with float32 scales, Q6_K as 8-bit records with float32 scales per 16 inputs; the Q8_0
    table is the embedding and the head."""
    from kvbank.models.gguf_file import GGUFFile
    from kvbank.models.qweights import KIND_Q4F, KIND_Q5, KIND_Q8, KIND_Q8H, QuantEmbedding, QuantHead, QuantLinear

    types = {t.name: t.tensor_type.name for t in GGUFFile(path).tensors}
    model = llm.engine.runner.model
    expected = {"Q4_K": KIND_Q4F, "Q6_K": KIND_Q8H}
    for i, layer in enumerate(model.layers):
        linears = {
            "attn_output": layer.self_attn.o_proj,
            "ffn_down": layer.mlp.down_proj,
            "attn_qkv": layer.self_attn.qkv_proj,
            "ffn_gate_up": layer.mlp.gate_up_proj,
        }
        assert all(isinstance(m, QuantLinear) and m.weight is None for m in linears.values()), i
        for name in ("attn_output", "ffn_down"):
            assert linears[name].kind == expected[types[f"blk.{i}.{name}.weight"]], (i, name)
        assert linears["ffn_gate_up"].kind == KIND_Q5  # Q5_0 as stored
        # q and k are Q5_0; fused with a Q8_0 v they share the 8-bit form
        assert linears["attn_qkv"].kind == (KIND_Q8 if types[f"blk.{i}.attn_v.weight"] == "Q8_0" else KIND_Q5), i
    assert isinstance(model.embed_tokens, QuantEmbedding) and isinstance(model.lm_head, QuantHead)
    # `kvbank plan` predicts the same kernels and bytes from the header alone
    from kvbank import memory

    predicted, measured = memory.predict(EngineConfig(model=path)), llm.engine.memory
    assert (
        predicted.projections
        == measured.projections
        == (
            ("integer 4-bit, float32 scales (Q4_K)", 27),
            ("integer 5-bit (Q5_0/Q4_0)", 27),
            ("integer 8-bit (Q8_0, or Q5_0/Q4_0 fused with it)", 9),
            ("integer 8-bit, scales per 16 (Q6_K)", 9),
        )
    )
    for part in ("packed_weights", "dense_weights", "embeddings", "lm_head", "rope_tables"):
        assert getattr(predicted, part) == getattr(measured, part), part


def test_the_files_k_quant_and_q5_0_tensors_decode_to_gguf_values_to_the_bit(path):
    import gguf

    from kvbank.models.gguf_file import GGUFFile
    from kvbank.models.packed import INT8_TYPES, Int4Blocks, Int8Blocks

    seen = set()
    for tensor in GGUFFile(path).tensors:
        kind = tensor.tensor_type.name
        if kind in ("Q4_K", "Q5_0", "Q6_K") and kind not in seen:
            seen.add(kind)
            rows = tensor.data.shape[0]
            if kind in INT8_TYPES:
                blocks = Int8Blocks.from_gguf(tensor.data, rows, kind)
            else:
                blocks = Int4Blocks.from_gguf(tensor.data, kind, rows)
            expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            assert torch.equal(blocks.dequantize(), torch.from_numpy(expected)), tensor.name
    assert seen == {"Q4_K", "Q5_0", "Q6_K"}


def test_default_bfloat16_gives_a_request_the_same_bits_whatever_shares_its_steps(llm):
    """With every matmul on the integer kernels (rows independent by construction) and attention
    by rows, the default configuration is batch-invariant for Gemma too: tokens and logprobs."""
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=0, ignore_eos=True)
    prompts = _encode(llm, PROMPTS)

    def run(batch):
        outs = llm.generate(batch, params)
        return [(c.token_ids, [s[t] for s, t in zip(c.logprobs, c.token_ids)]) for c in (o.outputs[0] for o in outs)]

    alone = [run([p])[0] for p in prompts]
    assert run([prompts[0]] * 16) == [alone[0]] * 16  # 16 copies
    assert run(prompts * 3) == alone * 3  # mixed lengths, one past the window
    assert llm.engine.manager.num_free_blocks == llm.engine.num_blocks


def test_chat_through_a_real_server_with_the_openai_client_and_a_given_template(path, llm, tmp_path, kvbank_env):
    """The file has no chat template: --chat-template gives Gemma's, and the server's chat answer is
    the engine's greedy completion of the rendered turns (bfloat16, batch-invariant: same tokens)."""
    import openai
    from serving import start_server, stop_server, wait_healthy

    template = tmp_path / "gemma3.jinja"
    template.write_text(GEMMA3_TEMPLATE)
    log = tmp_path / "server.log"
    process, url = start_server(
        ["--model", path, "--chat-template", str(template), "--num-gpu-blocks", "256"], kvbank_env, log
    )
    try:
        wait_healthy(process, url, log)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        reply = client.chat.completions.create(model=path, messages=messages, max_tokens=12, temperature=0)
    finally:
        stop_server(process)
    prompt = llm.get_tokenizer().encode(_render(messages), add_special_tokens=False)
    expected = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    assert reply.choices[0].message.content == expected.text and expected.text.strip()
    assert reply.usage.prompt_tokens == len(prompt)


def test_a_chat_template_that_is_neither_a_file_nor_a_template_is_refused_before_loading(path):
    with pytest.raises(ValueError, match="chat_template='gemma' is neither a file nor a Jinja template"):
        LLM(path, chat_template="gemma")
    with pytest.raises(ValueError, match="chat_template does not compile"):
        LLM(path, chat_template="{% for m in messages %}")


def _render(messages):
    import jinja2

    return (
        jinja2.Environment()
        .from_string(GEMMA3_TEMPLATE)
        .render(messages=messages, add_generation_prompt=True, bos_token="<bos>")
    )


def test_a_request_or_stream_policy_that_evicts_is_refused(llm):
    # Windowed layers read the last positions by slot: a policy that moves tokens between slots
    # would make them read the wrong tokens, so a request's or a stream's own policy is refused too.
    prompt = _encode(llm, PROMPTS[:1])[0]
    for policy in ("sink_window(sinks=4,window=64)", "context_shift(keep=4)"):
        with pytest.raises(ValueError, match="kv_policy=.* is not supported for gemma3: its sliding-window"):
            llm.generate([prompt], SamplingParams(max_tokens=2, kv_policy=policy))
    with pytest.raises(ValueError, match="streams are not supported with the hybrid.*swa_full=True"):
        llm.open_stream("You watch a camera.", chat=False)
    assert llm.engine.manager.num_free_blocks == llm.engine.num_blocks


def test_with_every_token_kept_a_streams_frame_window_is_refused(llm_full):
    with pytest.raises(ValueError, match="kv_policy=frame_window.* is not supported for gemma3"):
        llm_full.open_stream("You watch a camera.", chat=False)


@pytest.mark.parametrize(
    "option, match",
    [
        ({"kv_cache_dtype": "int8"}, "kv_cache_dtype='int8'.*head_dim=256"),
        ({"kv_policy": "h2o(heavy=256,recent=256)"}, "kv_policy=.*sliding-window"),
    ],
)
def test_refuses_what_the_windows_cannot_run(path, option, match):
    config = describe_model(path).config
    with pytest.raises(ValueError, match=match):
        check_supported(config, EngineConfig(model=path, **option))
    check_supported(dataclasses.replace(config, layer_windows=()), EngineConfig(model=path, **option))


def test_kvbank_plan_marks_the_kv_dtypes_this_model_refuses(path):
    from kvbank.cli import _plan_row

    config = describe_model(path).config
    engine = EngineConfig(model=path)
    assert _plan_row(config, engine, "auto", 8192)["refused"] is None
    assert "not supported for gemma3" in _plan_row(config, engine, "int8", 8192)["refused"]


def test_the_engine_refuses_a_quantized_kv_cache_at_load(path):
    with pytest.raises(ValueError, match="kv_cache_dtype='int4'.*head_dim=256.*sliding-window"):
        LLM(path, kv_cache_dtype="int4")


# --- the hybrid sliding-window KV cache ---------------------------------------------------------------

LONG = "Remember this number: 7391.\n\n" + STORY * 40 + "\nQuestion: what number did I ask you to remember?\nAnswer:"


def _outputs(llm, prompts, params):
    return [
        [(c.token_ids, [s[t] for s, t in zip(c.logprobs, c.token_ids)]) for c in o.outputs]
        for o in llm.generate(prompts, params)
    ]


def test_the_hybrid_cache_gives_the_bits_of_a_cache_that_keeps_every_token(llm, llm_full):
    """Default bfloat16: tokens and logprobs to the bit against --swa-full, cold, from prefix hits
    (the window's blocks found in the cache) and for n = 2 (forks share, then split, window blocks)."""
    prompts = _encode(llm, [*PROMPTS, LONG])
    assert len(prompts[-1]) > 2 * 512
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=0, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, seed=5, n=2, max_tokens=16, logprobs=0, ignore_eos=True)
    full = _outputs(llm_full, prompts, params), _outputs(llm_full, prompts[-1:], sampled)
    cold = _outputs(llm, prompts, params), _outputs(llm, prompts[-1:], sampled)
    assert cold == full
    again = llm.generate(prompts, params)
    assert [o.num_cached_tokens for o in again][-2:] == [(len(p) - 1) // 16 * 16 for p in prompts[-2:]]
    assert (_outputs(llm, prompts, params), _outputs(llm, prompts[-1:], sampled)) == full
    assert llm.engine.manager.num_free_blocks == llm.engine.num_blocks


@pytest.mark.parametrize("cache", ["hybrid", "swa_full"])
def test_the_one_call_decoder_stack_gives_the_layer_by_layer_bits(cache, llm, llm_full, monkeypatch):
    """Default bfloat16: every step runs all 18 layers in one native call (sandwich norms, q/k norms,
    GeGLU, local and global rotary tables; the hybrid cache's window tables and the sliding window as
    attention groups), and gives the tokens and logprobs of the layer-by-layer path, past the window too."""
    engine = llm if cache == "hybrid" else llm_full
    prompts = _encode(engine, [*PROMPTS, LONG])
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=0, ignore_eos=True)
    model = type(engine.engine.runner.model)
    step, steps = model._gemma_stack_step, []
    monkeypatch.setattr(model, "_gemma_stack_step", lambda *args: steps.append(step(*args)) or steps[-1])
    fused = _outputs(engine, prompts, params)
    assert steps and all(s is not None for s in steps)  # every step, prefill chunks and decodes alike
    # hybrid: the full table and each window table; swa_full: one table, with and without the window
    groups = 1 + engine.engine.manager.groups.num_window_tables if cache == "hybrid" else 2
    assert all(len(set(s.layer_groups)) == groups for s in steps)
    monkeypatch.setattr(model, "_gemma_stack_step", lambda *args: None)
    assert _outputs(engine, prompts, params) == fused
    assert engine.engine.manager.num_free_blocks == engine.engine.num_blocks


def test_windowed_layers_hold_only_their_window_while_a_long_prompt_runs(llm):
    engine, groups = llm.engine, llm.engine.manager.groups
    prompt = _encode(llm, [LONG])[0]
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), "long")
    held = []
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.scheduler.running:
            # every token in the full-attention layers
            assert -(-seq.num_computed_tokens // 16) <= len(seq.block_table) <= -(-seq.num_tokens // 16)
            held.append(max(sum(1 for b in table if b >= 0) for table in seq.window_tables))
    prefill = -(-len(prompt) // 512)  # steps of a 512-token budget
    assert max(held) <= groups.chunk_blocks(512, 16)
    assert max(held[prefill:]) <= groups.window_blocks(16) < -(-len(prompt) // 16)
    assert engine.manager.num_free_blocks == engine.num_blocks


def test_preempted_sequences_come_back_to_the_same_bits(path, llm):
    """A pool too small for every sequence's growth: the newest are preempted (recomputed, or
    swapped whole with their window tables), and come back to the tokens and logprobs they get
    alone; the longer prompts (581 tokens) are past their first window."""
    prompts = _encode(llm, [f"{STORY * (1 + i % 2 * 15)}Chapter {i}." for i in range(4)])
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=0, ignore_eos=True)
    alone = _outputs(llm, prompts, params)  # a pool with room for all: batch-invariant, as alone
    for mode in ("recompute", "swap"):
        small = LLM(path, num_gpu_blocks=230, max_num_batched_tokens=512, preemption_mode=mode)
        assert _outputs(small, prompts, params) == alone, mode
        assert small.engine.scheduler.num_preemptions > 0
        swaps = small.stats()["num_swaps_out"]
        assert (swaps > 0) if mode == "swap" else (swaps == 0)
        assert small.engine.manager.num_free_blocks == small.engine.num_blocks
    with pytest.raises(ValueError, match="session files are not supported with the hybrid.*swa_full=True"):
        small.save_session(prompts[0], "unused.kvb")
    with pytest.raises(ValueError, match="KV tiers .* not supported with the hybrid .*swa_full=True"):
        LLM(path, num_gpu_blocks=64, kv_host_gb=0.1)


def test_kvbank_plan_counts_bytes_per_token_per_group(path):
    """`kvbank plan`'s arithmetic for Gemma 3 at 8k and 32k: 3 layers for every token, 15 for windows."""
    from kvbank.cli import _kv_groups_plan

    config, engine = describe_model(path).config, EngineConfig(model=path, kv_cache_memory_gb=1)
    at8k, at32k = _kv_groups_plan(config, engine, 8192), _kv_groups_plan(config, engine, 32768)
    assert at8k["swa_full_bytes_per_token"] == 18 * 1024 and at8k["full_bytes_per_token"] == 3 * 1024
    assert at8k["window_bytes_per_token"] == 5 * 33 * 16 * 3 * 1024 / 8192
    assert at32k["window_bytes_per_token"] == at8k["window_bytes_per_token"] / 4  # a constant total
    assert at8k["max_sequences"] >= 4 * at8k["swa_full_max_sequences"] > 0
    assert _kv_groups_plan(config, dataclasses.replace(engine, swa_full=True), 8192) is None


# --- Hugging Face gemma3_text folders -----------------------------------------------------------------


def test_a_hugging_face_gemma3_text_folder_gives_the_gguf_files_tokens(path, llm32, llm32_greedy):
    """transformers' own conversion of the file, saved as a folder (config.json in transformers 5.x's
    spelling, float32 safetensors, tokenizer.json): the same tokens and greedy answers as the GGUF."""
    folder = transformers_folder(path)
    from_folder = LLM(str(folder), dtype="float32", num_gpu_blocks=256, enable_prefix_caching=False)
    prompts = _encode(llm32, PROMPTS)
    assert _encode(from_folder, PROMPTS) == prompts
    params = SamplingParams(temperature=0, max_tokens=24)
    expected = [o.outputs[0].token_ids for o in llm32_greedy]
    assert [o.outputs[0].token_ids for o in from_folder.generate(prompts, params)] == expected
    assert from_folder.engine.manager.groups.window == 512  # the hybrid cache, from layer_types


def _folder_with(tmp_path, path, **changes):
    """transformers' Gemma folder with its config.json changed (None deletes a key)."""
    import json

    folder = transformers_folder(path)
    raw = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        raw.pop(key, None) if value is None else raw.__setitem__(key, value)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    (tmp_path / "model.safetensors").symlink_to(folder / "model.safetensors")
    return str(tmp_path)


def test_a_transformers_4_gemma3_text_config_is_read_the_same(path, tmp_path):
    """transformers 4.x writes the layer pattern and the local rotary base as their own keys."""
    expected = describe_model(str(transformers_folder(path))).config
    older = _folder_with(
        tmp_path, path, layer_types=None, rope_parameters=None, sliding_window_pattern=6,
        rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling=None,
    )  # fmt: skip
    config = describe_model(older).config
    for field in ("layer_windows", "rope_theta", "rope_local_theta", "query_pre_attn_scalar", "rope_scaling"):
        assert getattr(config, field) == getattr(expected, field), field
    assert expected.layer_windows == describe_model(path).config.layer_windows
    assert expected.rope_local_theta == 1e4 and expected.rope_theta == 1e6


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"model_type": "gemma3"}, "image-text model; only its text models"),
        ({"hidden_activation": "gelu"}, "hidden_activation='gelu'.*not supported"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
        ({"sliding_window": None}, "no sliding_window"),
    ],
)
def test_a_gemma3_folder_with_what_kvbank_does_not_run_is_refused(path, tmp_path, changes, match):
    with pytest.raises(ValueError, match=match):
        describe_model(_folder_with(tmp_path, path, **changes))
