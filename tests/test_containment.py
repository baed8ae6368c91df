"""A failure is contained to its own request: streams of any frame sizes, windows, sinks, step budgets
and contexts never fail, and a sequence the engine cannot run fails alone while the others keep their
bits (default configuration: bfloat16, packed weights, batch-invariant)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbank import LLM, SamplingParams

#: (max_model_len, max_num_batched_tokens): the contexts and step budgets the streams run under
CONFIGS = [(512, 64), (1024, 256), (2048, 512)]
SYSTEM = "You watch a log."
NEIGHBOUR_PROMPT = "The capital of France is"
NEIGHBOUR_POLICIES = [None, "sink_window(sinks=4,window=64)"]


def _neighbour_params(policy: str | None) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, kv_policy=policy)


class Engines:
    """One LLM per configuration, each with its neighbours' outputs computed alone."""

    def __init__(self) -> None:
        self._llms: dict[tuple[int, int], LLM] = {}
        self._alone: dict[tuple[tuple[int, int], str | None], list[int]] = {}

    def llm(self, config: tuple[int, int]) -> LLM:
        if config not in self._llms:
            context, budget = config
            self._llms[config] = LLM(max_model_len=context, max_num_batched_tokens=budget, kv_cache_memory_gb=0.05)
        return self._llms[config]

    def alone(self, config: tuple[int, int], policy: str | None) -> list[int]:
        key = (config, policy)
        if key not in self._alone:
            output = self.llm(config).generate(NEIGHBOUR_PROMPT, _neighbour_params(policy))[0]
            self._alone[key] = output.outputs[0].token_ids
        return self._alone[key]


@pytest.fixture(scope="module")
def engines() -> Engines:
    return Engines()


def _frame(size: int, salt: int) -> list[int]:
    return [100 + (7 * i + salt) % 900 for i in range(size)]


def _run(engine, request_ids: set[str], outputs: dict) -> None:
    """Step until every request in `request_ids` has finished, keeping every output by request id."""
    while not request_ids <= {rid for rid, out in outputs.items() if out.finished}:
        for output in engine.step():
            assert output.error is None, output.error
            outputs[output.request_id] = output


@settings(
    max_examples=15,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    config=st.sampled_from(CONFIGS),
    window=st.integers(1, 3),
    sinks=st.sampled_from([0, 4, 40]),
    neighbour_policy=st.sampled_from(NEIGHBOUR_POLICIES),
    rounds=st.lists(st.lists(st.floats(0.002, 1.0), min_size=1, max_size=3), min_size=1, max_size=4),
)
def test_streams_of_any_frames_never_fail_and_leave_their_neighbours_bits_alone(
    engines, config, window, sinks, neighbour_policy, rounds
):
    llm, context = engines.llm(config), config[0]
    engine = llm.engine
    free_before = engine.manager.pool.num_free
    outputs: dict = {}
    neighbour = engine.add_request(NEIGHBOUR_PROMPT, _neighbour_params(neighbour_policy))
    opened = engine.open_stream(SYSTEM, policy=f"frame_window(frames={window},sinks={sinks})")
    stream_id = opened.stream.stream_id
    _run(engine, {opened.request_id}, outputs)
    accepted = 0
    for r, fractions in enumerate(rounds):
        # the frames of a round are sent together, so several are pending at once
        sent = set()
        for f, fraction in enumerate(fractions):
            try:
                sent.add(engine.append_frame(stream_id, _frame(max(1, int(fraction * context)), r * 3 + f)).request_id)
            except ValueError as refusal:  # a frame the stream cannot hold is refused, naming the limit
                assert "max_model_len" in str(refusal) or "blocks" in str(refusal), refusal
        _run(engine, sent, outputs)
        accepted += len(sent)
        stream = engine.stream(stream_id)
        assert stream.seq.num_computed_tokens == stream.seq.num_tokens <= context
        try:
            question = engine.ask_stream(stream_id, "What happened?", SamplingParams(temperature=0, max_tokens=4))
        except ValueError as refusal:  # near the end of the positions a question is refused, naming the room
            assert "exceeds max_model_len" in str(refusal) and "positions are left" in str(refusal), refusal
            continue
        _run(engine, {question.request_id}, outputs)
        assert len(outputs[question.request_id].outputs[0].token_ids) >= 1
    _run(engine, {neighbour.request_id}, outputs)
    engine.close_stream(stream_id)
    assert outputs[neighbour.request_id].outputs[0].token_ids == engines.alone(config, neighbour_policy)
    assert engine.manager.pool.num_free == free_before  # cached blocks count as free: nothing leaked
    assert not engine.has_unfinished_requests()


def test_the_frames_that_crashed_the_step_are_computed(engines):
    """A frame window of one frame, frames of 600 tokens on a context of 1024 with 256-token steps:
    the second frame no longer runs past the context while the first is still held."""
    llm = engines.llm((1024, 256))
    with llm.open_stream(SYSTEM, policy="frame_window(frames=1,sinks=4)") as stream:
        infos = [stream.append(_frame(600, i)) for i in range(3)]
        assert [info.kept_frames for info in infos] == [1, 1, 1]
        assert infos[-1].evicted_frames == 2
        assert stream.ask("What happened?", SamplingParams(temperature=0, max_tokens=4)).outputs[0].token_ids


def _sabotage_positions(engine, request_id: str) -> None:
    """Positions past the rotary tables (the class of the stream bug): found before the step runs."""
    engine.requests[request_id].seqs[0].rope_offset = engine.max_model_len


def _sabotage_embeds(engine, request_id: str) -> None:
    """Embedding rows no model takes (the model raises for them in the middle of the step)."""
    request = engine.requests[request_id]
    request.prompt_embeds = torch.zeros(request.prompt_embeds.shape[0], 3)


@pytest.mark.parametrize(("sabotage", "after_steps"), [(_sabotage_positions, 1), (_sabotage_embeds, 0)])
def test_a_sequence_the_engine_cannot_run_fails_alone_and_the_others_keep_their_bits(engines, sabotage, after_steps):
    """One sequence of a batch that reaches outside the pool or that the model raises for: that
    request ends with a generic error, the step goes on for the others, and their tokens are those
    they get alone."""
    config = (1024, 256)
    llm = engines.llm(config)
    engine = llm.engine
    alone = engines.alone(config, None)
    embeds = llm.embed_tokens(llm.get_tokenizer().encode("Name a colour:"))
    victim = engine.add_request({"prompt_embeds": embeds}, _neighbour_params(None))
    others = [engine.add_request(NEIGHBOUR_PROMPT, _neighbour_params(None)) for _ in range(2)]
    outputs: dict = {}
    for step in range(after_steps + 1000):
        if step == after_steps:
            sabotage(engine, victim.request_id)
        for output in engine.step():
            outputs[output.request_id] = output
        if not engine.has_unfinished_requests():
            break
    failed = outputs[victim.request_id]
    message = str(failed.error)
    assert message.startswith("internal error while running this request (incident "), message
    assert failed.outputs[0].finish_reason == "error"
    assert "rotary" not in message and "Error" not in message  # the details stay in the log
    for other in others:
        assert outputs[other.request_id].error is None
        assert outputs[other.request_id].outputs[0].token_ids == alone
    assert not engine.has_unfinished_requests()
