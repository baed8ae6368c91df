"""Streaming sessions: frames through a bounded cache, questions answered from it, prompt_embeds."""

import math

import pytest
import torch
from policy_reference import Recorder, assert_lead_unread, reference_logits
from stream_notes import NOTES

from kvbank import LLM, SamplingParams
from kvbank.cache.policies import FrameWindow, parse_policy
from kvbank.cache.recall import Archived, word_scores
from kvbank.engine.streams import PoolFull

SYSTEM = "You watch a video of moving objects and answer questions about it briefly."


@pytest.fixture(scope="module")
def llm():
    # A small context so that frame windows rebase their positions within a few dozen frames.
    return LLM(dtype="float32", max_model_len=256, num_gpu_blocks=96, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def default_llm():
    """The same small engine in the default configuration (bfloat16, packed weights, batch-invariant),
    for what does not compare logits against a float32 reference."""
    return LLM(max_model_len=256, num_gpu_blocks=96, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def whole_pool_llm():
    """`default_llm` whose streams may take the whole pool: what the pool itself refuses."""
    return LLM(max_model_len=256, num_gpu_blocks=96, max_num_batched_tokens=64, max_stream_pool_fraction=1.0)


def _frame(i: int) -> str:
    # Frames of varied length, so that frames straddle blocks and evictions move partial blocks.
    extra = "; id 7 entered left; id 9 left right" if i % 3 == 0 else ""
    return f"t={i * 0.4:.1f}s: id {i % 5} at ({20 + 7 * i},{40 + i}) moving right{extra}"


def _assert_all_free(llm):
    manager = llm.engine.manager
    assert manager.num_free_blocks == llm.engine.num_blocks
    assert all(block.ref_count == 0 for block in manager.pool.blocks)


def _greedy(max_tokens=8, logprobs=None):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)


def test_frame_window_spelling_and_where_it_is_refused():
    assert parse_policy("frame_window(frames=8,sinks=0)", stream=True) == FrameWindow(frames=8, sinks=0)
    assert str(FrameWindow()) == "frame_window(frames=64,sinks=4)"
    with pytest.raises(ValueError, match="streaming session's policy"):
        parse_policy("frame_window(frames=8)")
    with pytest.raises(ValueError, match="must be frame_window"):
        parse_policy("sink_window(sinks=4,window=64)", stream=True)
    with pytest.raises(ValueError, match="frames=0 must be an integer >= 1"):
        FrameWindow(frames=0)
    with pytest.raises(ValueError, match="streaming session's policy"):
        SamplingParams(kv_policy="frame_window(frames=4)")


def test_asking_without_eviction_equals_computing_the_frames_and_question_fresh(llm):
    with llm.open_stream(SYSTEM, policy="frame_window(frames=64,sinks=4)") as session:
        for i in range(6):
            info = session.append(_frame(i))
            assert (info.index, info.evicted_frames, info.kept_frames) == (i, 0, i + 1)
        asked = session.ask("Which ids are in view?", _greedy(logprobs=3))
        assert asked.num_cached_tokens == len(session.kept_token_ids())
    llm.reset_prefix_cache()
    fresh = llm.generate([asked.prompt_token_ids], _greedy(logprobs=3))[0]
    assert fresh.num_cached_tokens == 0
    assert asked.outputs[0].token_ids == fresh.outputs[0].token_ids
    for got, want in zip(asked.outputs[0].logprobs, fresh.outputs[0].logprobs):
        assert got.keys() == want.keys()
        for token in got:
            assert got[token].logprob == pytest.approx(want[token].logprob, abs=1e-4)
    _assert_all_free(llm)


def test_after_evictions_an_answer_equals_a_fresh_computation_on_the_kept_frames(llm):
    """The cache after many evictions and rebases: system prompt and the last 3 frames, at the
    positions of their slots; every answer token's logits match a reference forward over exactly those."""
    engine = llm.engine
    llm.reset_prefix_cache()  # the recorder must see every token computed
    recorder = Recorder(engine)
    try:
        session = llm.open_stream(SYSTEM, policy="frame_window(frames=3,sinks=4)")
        system_len = len(session.kept_token_ids())
        tokens = [list(range(system_len))]  # recorded row indices of each frame, computed in order
        computed = system_len
        for i in range(40):
            info = session.append(_frame(i))
            tokens.append(list(range(computed, computed + info.num_tokens)))
            computed += info.num_tokens
            kept = [tokens[0]] + tokens[-min(3, i + 1) :]
            assert info.kept_tokens == sum(map(len, kept)), "frames are kept or evicted whole"
        stream = engine.stream(session.stream_id)
        assert stream.seq.frames.num_evicted == 37 and stream.seq.pristine_blocks
        request = engine.ask_stream(session.stream_id, "Which ids are in view?", _greedy(max_tokens=10))
        _assert_answer_matches_reference(engine, recorder, request.seqs[0], [r for f in kept for r in f], computed, 9)
        assert session.stats()["rope_offset"] >= 0
        session.close()
    finally:
        recorder.remove()
    _assert_all_free(llm)


def _assert_answer_matches_reference(engine, recorder, seq, rows, computed, count):
    """Step `seq` (a question) to its end; the logits of each of its `count` decode steps must equal a
    reference forward over the recorded rows `rows`, then the question's and answer's own (recorded
    from row `computed` on), at positions 0, 1, ..."""
    c = engine.model_config
    checks, logits = [], []
    while engine.requests:
        check = seq.num_pending == 1 and seq.num_computed_tokens > len(rows)
        if check:
            done = seq.num_computed_tokens
            held = rows + list(range(computed, computed + done - len(rows)))
            kept = torch.tensor(held).expand(c.num_layers, c.num_kv_heads, len(held))
            checks.append(
                (seq.token_ids[done], kept.clone(), torch.arange(len(held)).expand_as(kept).clone(), len(held))
            )
        engine.step()
        if check:
            logits.append(recorder.logits[-1][0])
    assert len(checks) == count
    expected = reference_logits(recorder, checks)
    for i, got in enumerate(logits):
        torch.testing.assert_close(got, expected[i], atol=2e-4, rtol=1e-4, msg=lambda m, i=i: f"check {i}: {m}")


@pytest.mark.slow
def test_memory_is_constant_over_2000_frames_and_asking_leaves_it_unchanged():
    # The default configuration (bfloat16, packed weights); frames arrive ten at a time, as they do
    # when a camera is faster than the model: each step computes them together, then evicts.
    llm = LLM(kv_cache_memory_gb=0.05, max_model_len=1024)
    engine, tokenizer = llm.engine, llm.get_tokenizer()
    frames = [tokenizer.encode(f" {i % 97} at {i % 13}") for i in range(2000)]
    session = llm.open_stream(SYSTEM, policy="frame_window(frames=16,sinks=4)")
    blocks, free = [], []
    for i in range(0, 2000, 10):
        for frame in frames[i : i + 10]:
            engine.append_frame(session.stream_id, frame)
        while engine.has_unfinished_requests():
            engine.step()
        if i >= 100:  # the window is full
            blocks.append(session.stats()["blocks"])
            free.append(engine.manager.num_free_blocks)
        if i % 500 == 490:
            before = (session.stats()["blocks"], engine.manager.num_free_blocks, session.kept_token_ids())
            answer = session.ask("What was the last position?", _greedy(max_tokens=6))
            assert len(answer.outputs[0].token_ids) == 6
            after = (session.stats()["blocks"], engine.manager.num_free_blocks, session.kept_token_ids())
            assert after == before, "a question leaves the stream and the pool as they were"
    assert max(blocks) - min(blocks) <= 1 and max(free) - min(free) <= 1
    stats = session.stats()
    assert stats["frames"] == 2000 and stats["kept_frames"] == 16 and stats["evicted_frames"] == 1984
    assert len(session.kept_token_ids()) == stats["kept_tokens"] < 200
    assert stats["rope_offset"] < 1024, "positions were rebased into the model's context"
    session.close()
    _assert_all_free(llm)


def test_two_questions_and_a_fork_share_the_stream_blocks(default_llm):
    session = default_llm.open_stream(SYSTEM, policy="frame_window(frames=4,sinks=4)")
    for i in range(8):
        session.append(_frame(i))
    kept = session.kept_token_ids()
    engine = default_llm.engine
    first = engine.ask_stream(session.stream_id, "Which ids are in view?", _greedy())
    second = engine.ask_stream(session.stream_id, "Which ids are in view?", _greedy())
    shared = set(engine.stream(session.stream_id).seq.block_table)
    assert shared <= set(first.seqs[0].block_table) | {first.seqs[0].block_table[-1]}
    outputs = {}
    while engine.requests:
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output
    assert outputs[first.request_id].outputs[0].token_ids == outputs[second.request_id].outputs[0].token_ids
    fork = session.fork()
    fork.append("t=9.9s: id 42 entered right")
    assert session.kept_token_ids() == kept, "appending to a fork leaves the original as it was"
    assert fork.kept_token_ids()[: len(kept)] != kept or len(fork.kept_token_ids()) > len(kept)
    again = session.ask("Which ids are in view?", _greedy())
    assert again.outputs[0].token_ids == outputs[first.request_id].outputs[0].token_ids
    fork.close()
    session.close()
    _assert_all_free(default_llm)


def test_frames_queued_before_a_question_are_computed_before_it(default_llm):
    session = default_llm.open_stream(SYSTEM, policy="frame_window(frames=4,sinks=4)")
    engine = default_llm.engine
    frames = [engine.append_frame(session.stream_id, _frame(i)) for i in range(6)]
    question = engine.ask_stream(session.stream_id, "Which ids are in view?", _greedy(max_tokens=4))
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished[:6] == [f.request_id for f in frames] and finished[-1] == question.request_id
    assert session.stats()["kept_frames"] == 4
    assert question.prompt_token_ids[: len(session.kept_token_ids())] == session.kept_token_ids()
    session.close()
    _assert_all_free(default_llm)


def test_stream_errors_name_the_value_and_the_limit(llm):
    with pytest.raises(ValueError, match="must be frame_window"):
        llm.open_stream(SYSTEM, policy="h2o(heavy=8,recent=8)")
    session = llm.open_stream(SYSTEM, policy="frame_window(frames=4,sinks=4)")
    with pytest.raises(ValueError, match="would make the stream hold"):
        session.append(list(range(1, 250)))
    with pytest.raises(ValueError, match="out of range"):
        session.append([10**9])
    with pytest.raises(ValueError, match="max_tokens=500 exceeds max_model_len=256"):
        session.ask("Hi?", SamplingParams(max_tokens=500))
    with pytest.raises(ValueError, match="prompt_logprobs"):
        session.ask("Hi?", SamplingParams(max_tokens=2, prompt_logprobs=1))
    session.close()
    with pytest.raises(ValueError, match="is closed"):
        session.append("late")
    with pytest.raises(KeyError, match="no open stream"):
        llm.engine.append_frame("nope", "x")
    _assert_all_free(llm)


def test_work_the_pool_cannot_hold_without_preempting_a_stream_is_refused(whole_pool_llm):
    default_llm = whole_pool_llm
    sessions, refused = [], None
    for _ in range(12):
        try:
            session = default_llm.open_stream(SYSTEM, policy="frame_window(frames=64,sinks=4)")
            sessions.append(session)
            for i in range(200):
                session.append(list(range(100 + i * 40, 140 + i * 40)))
                if session.stats()["kept_tokens"] > 200:
                    break
        except PoolFull as error:
            refused = str(error)
            break
    assert refused is not None and len(sessions) >= 4, "streams fill the 96-block pool within a few of 16 blocks"
    assert "more KV blocks, but only" in refused and "never preempted" in refused
    assert len(sessions[0].ask("Which ids?", _greedy(max_tokens=2)).outputs[0].token_ids) == 2  # room for this
    for session in sessions:
        session.close()
    _assert_all_free(default_llm)


def test_streams_stop_at_their_share_of_the_pool_and_requests_keep_the_rest(default_llm):
    """Streams that grow are refused at max_stream_pool_fraction (half the pool by default), so a
    request as long as the context still runs beside them; closing them frees every block."""
    engine = default_llm.engine
    sessions, refused = [], None
    for _ in range(12):
        try:
            sessions.append(default_llm.open_stream(SYSTEM, policy="frame_window(frames=64,sinks=4)"))
            for i in range(200):
                sessions[-1].append(list(range(100 + i * 40, 140 + i * 40)))
                if sessions[-1].stats()["kept_tokens"] > 200:
                    break
        except PoolFull as error:
            refused = str(error)
            break
    assert refused is not None and "max_stream_pool_fraction=0.5 of 96" in refused, refused
    assert engine.streams_host.held_blocks() <= 48
    prompt = list(range(1000, 1000 + 200))
    output = default_llm.generate({"prompt_token_ids": prompt}, _greedy(max_tokens=40))[0]
    assert len(output.outputs[0].token_ids) == 40 and output.error is None
    for session in sessions:
        session.close()
    _assert_all_free(default_llm)


def test_streams_that_reserve_their_window_are_refused_at_open_never_frame_by_frame(whole_pool_llm):
    """Each stream reserves 144 tokens: the 96-block pool promises that to a few of them, refuses
    the next at open, and every promised stream then fills its window without a PoolFull, however
    the others grow; a frame beyond a stream's own reservation is refused naming it."""
    default_llm = whole_pool_llm
    engine = default_llm.engine
    sessions, refused = [], None
    for _ in range(16):
        try:
            policy = "frame_window(frames=4,sinks=4)"
            sessions.append(default_llm.open_stream(SYSTEM, policy=policy, reserve_tokens=144))
        except PoolFull as error:
            refused = str(error)
            break
    assert refused is not None and 2 <= len(sessions) < 16
    assert "a stream reserving 144 tokens needs" in refused and "reserved by other streams" in refused
    stats = sessions[0].stats()
    reserved = stats["reserved_blocks"]
    # 144 tokens (starting up to a block in once frames left), the unrotated copies of the system
    # prompt and sinks
    assert reserved == 9 + 1 + -(-(stats["system_tokens"] + 4) // 16)
    for i in range(12):  # every stream's window fills, then slides
        for s, session in enumerate(sessions):
            session.append(list(range(100 + i * 20 + s, 120 + i * 20 + s)))
            assert session.stats()["blocks"] <= reserved
    assert all(session.stats()["evicted_frames"] == 8 for session in sessions)
    with pytest.raises(ValueError, match="over its reserve_tokens=144"):
        sessions[0].append(list(range(100, 190)))
    with pytest.raises(ValueError, match=r"reserve_tokens=10 must be an integer above the system prompt's"):
        default_llm.open_stream(SYSTEM, reserve_tokens=10)
    with pytest.raises(ValueError, match="reserve_tokens=9999 exceeds max_model_len=256"):
        default_llm.open_stream(SYSTEM, reserve_tokens=9999)
    for session in sessions:
        session.close()
    assert engine.streams_host.promised() == 0
    _assert_all_free(default_llm)


def test_a_fork_of_a_reserving_stream_is_promised_a_window_of_its_own(default_llm):
    """A fork copies what it shares with its source as the two diverge, so it inherits the source's
    reservation: promised at fork (refused there when the pool cannot promise it), after which the
    source, the fork and every other reserving stream fill and slide their windows without a
    PoolFull."""
    engine, policy = default_llm.engine, "frame_window(frames=4,sinks=4)"
    source = default_llm.open_stream(SYSTEM, policy=policy, reserve_tokens=144)
    for i in range(6):
        source.append(list(range(100 + 20 * i, 120 + 20 * i)))
    fork = source.fork()
    assert fork.stats()["reserved_blocks"] == source.stats()["reserved_blocks"] > 0
    others = []
    with pytest.raises(PoolFull, match="a stream reserving 144 tokens needs"):
        for _ in range(16):
            others.append(default_llm.open_stream(SYSTEM, policy=policy, reserve_tokens=144))
    with pytest.raises(PoolFull, match="a fork of stream .* reserving 144 tokens needs"):
        source.fork()
    for i in range(6):  # the fork diverges from its source (different frames), everyone slides
        for s, session in enumerate([source, fork, *others]):
            session.append(list(range(300 + i * 20 + s, 320 + i * 20 + s)))
    assert fork.stats()["evicted_frames"] == source.stats()["evicted_frames"] == 8
    assert all(session.stats()["evicted_frames"] == 2 for session in others)
    for session in [source, fork, *others]:
        session.close()
    assert engine.streams_host.promised() == 0
    _assert_all_free(default_llm)


def test_a_streams_rows_never_read_the_slots_before_its_lead_on_a_dense_pool(default_llm):
    """The dense bfloat16 pool's version of tests/test_kv_compose.py's lead test: after frames
    left, garbage in the slots before the sequence's first token changes nothing of an answer."""
    params = _greedy(max_tokens=6, logprobs=2)
    with default_llm.open_stream(SYSTEM, policy="frame_window(frames=2,sinks=4)") as session:
        for i in range(7):
            session.append(_frame(i))
        assert_lead_unread(default_llm, session, "Which ids are in view?", params)
    _assert_all_free(default_llm)


# --- prompt_embeds -------------------------------------------------------------------------------


def test_prompt_embeds_of_the_token_embeddings_give_the_text_path_exactly(llm):
    ids = llm.get_tokenizer().encode(SYSTEM + " " + _frame(3) + " The three primary colours are")
    params = _greedy(max_tokens=8, logprobs=2)
    llm.reset_prefix_cache()
    text = llm.generate([ids], params)[0]
    embeds = llm.generate([{"prompt_embeds": llm.embed_tokens(ids)}], params)[0]
    assert embeds.outputs[0].token_ids == text.outputs[0].token_ids
    assert embeds.outputs[0].logprobs == text.outputs[0].logprobs
    # Hashed by content: the same rows again reuse the cached blocks, other rows do not.
    again = llm.generate([{"prompt_embeds": llm.embed_tokens(ids)}], params)[0]
    assert again.num_cached_tokens == len(ids) // 16 * 16 > 0
    other = llm.generate([{"prompt_embeds": llm.embed_tokens(ids) * 1.01}], params)[0]
    assert other.num_cached_tokens == 0
    # A repetition penalty counts no placeholder id as a token seen.
    request = llm.engine.add_request({"prompt_embeds": llm.embed_tokens(ids)}, SamplingParams(repetition_penalty=1.3))
    assert request.seqs[0].seen_token_ids == []
    llm.engine.abort_request(request.request_id)
    _assert_all_free(llm)


def test_embedding_frames_equal_token_frames_and_repeats_are_recognised(default_llm):
    runs = []
    for as_embeds in (False, True):
        default_llm.reset_prefix_cache()
        runs.append(_frames_run(default_llm, as_embeds))
    (tokens, token_infos, token_hits), (embeds, embed_infos, embed_hits) = runs
    # Equal by construction: with no cached prefix both runs compute the same tokens in the same
    # steps and shapes, and embed_tokens' rows are the very rows the model looks up for those ids.
    assert token_hits == embed_hits == 0
    assert embeds.token_ids == tokens.token_ids
    assert embeds.logprobs == tokens.logprobs
    for infos in (token_infos, embed_infos):
        assert [i.repeat_of for i in infos] == [None, None, None, 2, None, None, None]
    # Embedding frames after a system prompt taken from the cache (computed in other chunks).
    cached, cached_infos, cached_hits = _frames_run(default_llm, as_embeds=True)
    assert cached_hits > 0
    assert cached.token_ids == tokens.token_ids
    assert [i.repeat_of for i in cached_infos] == [i.repeat_of for i in embed_infos]
    _assert_all_free(default_llm)


def _frames_run(llm, as_embeds: bool):
    """Frames 0, 1, 2, 2, 3, 4, 5 (token ids, or their embeddings) into a new stream, then a question.

    Returns the answer, the frames' infos and the system prompt's tokens found in the prefix cache;
    checks on the way what a question counts as seen and that a repeated last frame is skipped.
    """
    tokenizer = llm.get_tokenizer()
    hits = llm.stats()["prefix_cache_hits"]
    session = llm.open_stream(SYSTEM, policy="frame_window(frames=4,sinks=4)")
    hits = llm.stats()["prefix_cache_hits"] - hits
    infos = []
    for i in [0, 1, 2, 2, 3, 4, 5]:
        ids = tokenizer.encode(_frame(i) + "\n")
        infos.append(session.append(llm.embed_tokens(ids) if as_embeds else ids))
    answer = session.ask("Which ids are in view?", _greedy(logprobs=2)).outputs[0]
    asked = llm.engine.ask_stream(session.stream_id, "Which ids?", _greedy())
    seen = asked.seqs[0].seen_token_ids
    assert len(seen) == len(asked.prompt_token_ids) - (sum(i.num_tokens for i in infos[-4:]) if as_embeds else 0)
    llm.engine.abort_request(asked.request_id)
    ids = tokenizer.encode(_frame(5) + "\n")
    skipped = session.append(llm.embed_tokens(ids) if as_embeds else ids, skip_repeat=True)
    assert skipped.skipped and skipped.repeat_of == 6 and session.stats()["frames"] == 7
    session.close()
    return answer, infos, hits


@pytest.mark.parametrize(
    "embeds, message",
    [
        (torch.zeros(3, 17), r"shape \[3, 17\]; the model takes \[tokens, 576\]"),
        (torch.zeros(2, 3, 576), r"shape \[2, 3, 576\]"),
        (torch.zeros(0, 576), "is empty"),
        (torch.full((2, 576), float("nan")), "NaN or infinite"),
        (torch.zeros(2, 576, dtype=torch.int32), "dtype int32; allowed: float32, bfloat16, float16"),
        ([[0.0] * 576], "must be a torch.Tensor"),
    ],
    ids=["hidden", "rank", "empty", "nan", "dtype", "list"],
)
def test_malformed_prompt_embeds_are_refused(llm, embeds, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([{"prompt_embeds": embeds}], _greedy())
    with pytest.raises(ValueError, match="prompt_logprobs"):
        llm.generate([{"prompt_embeds": torch.zeros(2, 576)}], SamplingParams(prompt_logprobs=1))
    with pytest.raises(ValueError, match="has 300 tokens"):
        llm.generate([{"prompt_embeds": torch.zeros(300, 576)}], _greedy())
    _assert_all_free(llm)


# --- recall of evicted frames from a tier ---------------------------------------------------------


@pytest.fixture(scope="module")
def tiered():
    return LLM(dtype="float32", max_model_len=256, num_gpu_blocks=96, max_num_batched_tokens=64, kv_host_gb=0.05)


def test_recalled_frames_sit_between_the_sinks_and_the_kept_frames_exactly(tiered):
    """A question with recall=2 attends over the sinks, two evicted frames brought back from the
    host tier and the kept frames, at positions 0, 1, ...: its logits match a reference forward over
    exactly those tokens' recorded K/V."""
    engine = tiered.engine
    tiered.reset_prefix_cache()
    recorder = Recorder(engine)
    try:
        session = tiered.open_stream(SYSTEM, policy="frame_window(frames=3,sinks=4)")
        rows = [list(range(len(session.kept_token_ids())))]
        computed = len(rows[0])
        for i in range(12):
            info = session.append(_frame(i))
            rows.append(list(range(computed, computed + info.num_tokens)))
            computed += info.num_tokens
        assert session.stats()["recallable_frames"] == 9
        recorder.recording = False  # the question's probe forward (for its queries) is no cached token
        request = engine.ask_stream(session.stream_id, "Where was id 2 at t=0.8s?", _greedy(max_tokens=6), recall=2)
        recorder.recording = True
        assert len(request.recalled_frames) == 2 and set(request.recalled_frames) <= set(range(9))
        frames = [rows[0]] + [rows[1 + i] for i in request.recalled_frames] + rows[-3:]
        held_rows = [r for f in frames for r in f]
        assert request.seqs[0].num_computed_tokens == len(held_rows)
        _assert_answer_matches_reference(engine, recorder, request.seqs[0], held_rows, computed, 5)
        assert session.stats()["recall_recalled"] == 2
        session.close()
    finally:
        recorder.remove()
    _assert_all_free(tiered)


@pytest.mark.parametrize("engine_fixture", ["tiered", "tiered_bf16"])
@pytest.mark.parametrize("as_embeds", [False, True], ids=["tokens", "embeddings"])
def test_recall_brings_back_the_frame_the_question_is_about(request, engine_fixture, as_embeds):
    """Ten notes are evicted; each question about one of them recalls one frame (recall=1). A random
    choice would bring back the right note with probability 1/10 per question.

    Notes given as text are ranked by their keys and by the rare words they share with the
    question: every question finds its own note. Notes given as embeddings (the same tokens' rows,
    so the same keys) have no words to share and are ranked by keys alone: 6 or more of 10 (chance:
    1.5e-4) says the keys find the frame asked about (mean keys against mean queries cannot tell
    apart notes whose questions share most of their words). In float32 and in the default
    configuration."""
    tiered = request.getfixturevalue(engine_fixture)
    tiered.reset_prefix_cache()
    tokenizer = tiered.get_tokenizer()
    with tiered.open_stream(
        "You read notes one at a time and answer questions about them briefly.", policy="frame_window(frames=2,sinks=4)"
    ) as session:
        for i, (who, what, value) in enumerate(NOTES):
            note = f"Note {i}: the {what} of {who} is {value}."
            session.append(tiered.embed_tokens(tokenizer.encode(note + "\n")) if as_embeds else note)
        assert session.stats()["recallable_frames"] == 10
        found = []
        for i, (who, what, _) in enumerate(NOTES[:10]):
            answer = session.ask(f"What is the {what} of {who}?", _greedy(max_tokens=1), recall=1)
            assert answer.recalled_frames == session.last_recall()[0] and len(answer.recalled_frames) == 1
            found.append(answer.recalled_frames[0] == i)
        assert sum(found) >= 6 if as_embeds else all(found), found
        assert session.stats()["recall_recalled"] == 10 and session.stats()["recall_fallbacks"] == 0
    _assert_all_free(tiered)


def test_word_scores_weigh_the_question_tokens_a_frame_holds_by_their_rarity():
    frames = [
        Archived(0, b"a", [5, 6, 7], torch.zeros(1)),
        Archived(1, b"b", [5, 8, 8, 9], torch.zeros(1)),
        Archived(2, b"c", [5, 6], torch.zeros(1)),
        Archived(3, b"d", [9, 8], torch.zeros(1), embedded=True),  # placeholders: no words
    ]
    scores = word_scores(frames, [5, 8, 8, 7, 42])
    # 5 is in every text frame (adds 0); 8 in one of three (log 3, once however often); 7 in one
    assert scores.tolist() == pytest.approx([math.log(3), math.log(3), 0.0, 0.0])
    assert word_scores(frames, [42]).tolist() == [0.0, 0.0, 0.0, 0.0]
    assert word_scores(frames[3:], [9, 8]).tolist() == [0.0]


@pytest.fixture(scope="module")
def tiered_bf16():
    """`tiered` in the default configuration (bfloat16, packed weights)."""
    return LLM(max_model_len=256, num_gpu_blocks=96, max_num_batched_tokens=64, kv_host_gb=0.05)


@pytest.mark.parametrize("engine_fixture", ["tiered", "tiered_bf16"])
def test_a_fork_recalls_what_its_source_evicted_before_the_fork(request, engine_fixture):
    """A fork holds its source's archive from the fork on: asked the same question, it recalls the
    same frames evicted before the fork and answers alike; those entries stay in the tier while the
    fork holds them, after the source has closed, and go when the last holder closes. Frames the
    fork evicts afterwards are its own. In float32 and in the default configuration."""
    tiered = request.getfixturevalue(engine_fixture)
    tiered.reset_prefix_cache()
    engine, host = tiered.engine, tiered.engine.offload.tiers[0]
    session = tiered.open_stream(
        "You read notes one at a time and answer questions about them briefly.", policy="frame_window(frames=2,sinks=4)"
    )
    for i, (who, what, value) in enumerate(NOTES[:6]):
        session.append(f"Note {i}: the {what} of {who} is {value}.")
    fork = session.fork()
    inherited = [a.key for a in engine.stream(session.stream_id).archive.frames]
    assert len(inherited) == 4 and [a.key for a in engine.stream(fork.stream_id).archive.frames] == inherited
    assert fork.stats()["recallable_frames"] == 4
    question = f"What is the {NOTES[1][1]} of {NOTES[1][0]}?"
    from_source = session.ask(question, _greedy(max_tokens=4), recall=2)
    from_fork = fork.ask(question, _greedy(max_tokens=4), recall=2)
    assert len(from_fork.recalled_frames) == 2 and from_fork.recalled_frames == from_source.recalled_frames
    assert from_fork.outputs[0].token_ids == from_source.outputs[0].token_ids
    fork.append(f"Note 6: the {NOTES[6][1]} of {NOTES[6][0]} is {NOTES[6][2]}.")
    assert fork.stats()["recallable_frames"] == 5 and session.stats()["recallable_frames"] == 4
    session.close()
    engine.offload.flush()
    assert all(host.contains(inherited)), "the fork still holds its source's frames"
    again = fork.ask(question, _greedy(max_tokens=4), recall=4)  # of 5: at least 3 are the source's
    assert len(again.recalled_frames) == 4 and len(set(again.recalled_frames) & {0, 1, 2, 3}) >= 3
    assert fork.stats()["recall_missing"] == fork.stats()["recall_corrupt"] == 0
    own = [a.key for a in engine.stream(fork.stream_id).archive.frames]
    fork.close()
    engine.offload.flush()
    assert not any(host.contains(own)) and not engine.streams_host.archive_holders
    _assert_all_free(tiered)


def test_a_question_that_recalls_nothing_says_so(tiered):
    """Recall asked of a stream that has evicted nothing yet runs on the kept frames alone, and the
    answer and the stream's counters say so; a question that did not ask carries no recall field."""
    with tiered.open_stream(SYSTEM, policy="frame_window(frames=8,sinks=4)") as session:
        session.append(_frame(0))
        plain = session.ask("Which ids are in view?", _greedy(max_tokens=4))
        asked = session.ask("Which ids are in view?", _greedy(max_tokens=4), recall=2)
        assert plain.recalled_frames is None and asked.recalled_frames == []
        assert asked.outputs[0].token_ids == plain.outputs[0].token_ids
        assert session.stats()["recall_fallbacks"] == 1 and session.stats()["recall_recalled"] == 0
    _assert_all_free(tiered)


def test_a_corrupted_recall_entry_is_detected_and_never_served(tiered, llm):
    session = tiered.open_stream(SYSTEM, policy="frame_window(frames=2,sinks=4)")
    for i in range(6):
        session.append(_frame(i))
    assert tiered.engine.offload.flush()  # evicted frames reach the tier on the store thread
    tier = tiered.engine.offload.tiers[0]
    assert len(tier._entries) >= 3
    for key in list(tier._entries):
        blob = bytearray(tier._entries[key])
        blob[-1] ^= 0xFF
        tier._entries[key] = memoryview(blob)
    plain = session.ask("Which ids are in view?", _greedy(max_tokens=4))
    corrupted = session.ask("Which ids are in view?", _greedy(max_tokens=4), recall=3)
    assert session.last_recall()[0] == [] and corrupted.outputs[0].token_ids == plain.outputs[0].token_ids
    assert session.stats()["recall_corrupt"] == 3 and session.stats()["recall_recalled"] == 0
    assert corrupted.recalled_frames == [] and session.stats()["recall_fallbacks"] == 1
    session.close()
    _assert_all_free(tiered)
    with llm.open_stream(SYSTEM) as untiered, pytest.raises(ValueError, match="recall=2 needs a KV tier"):
        untiered.ask("Hi?", _greedy(), recall=2)
