"""What a request gives back, shaped like vLLM's RequestOutput."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class RequestFailed(RuntimeError):
    """The engine failed a request through no fault of the caller's; the message is generic and
    quotes the incident id the engine's log holds the details under."""


class RequestOutputKind(enum.Enum):
    """Whether each output of a request holds everything so far or only what is new since the last.

    CUMULATIVE suits callers that keep only the latest output (`LLM.generate`); DELTA keeps the
    cost of a step independent of the output's length, for streams (the server).
    """

    CUMULATIVE = "cumulative"
    DELTA = "delta"


@dataclass(slots=True)
class Logprob:
    """Log-probability of one token, its rank in the distribution and its text."""

    logprob: float
    rank: int
    decoded_token: str


TokenLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One of the `n` completions of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, later: CompletionOutput) -> None:
        """Append the delta `later` (the same completion's next delta) to this one."""
        assert later.index == self.index
        self.text += later.text
        self.token_ids.extend(later.token_ids)
        if self.logprobs is not None and later.logprobs is not None:
            self.logprobs.extend(later.logprobs)
        self.cumulative_logprob = later.cumulative_logprob
        self.finish_reason, self.stop_reason = later.finish_reason, later.stop_reason


@dataclass
class RequestMetrics:
    """Timestamps (time.time()) of a request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    """The state of one request after an engine step: cumulative, or new since the previous output
    when the request asked for RequestOutputKind.DELTA (then `prompt_logprobs` holds new entries too)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[TokenLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    #: a stream question that asked to recall evicted frames: the frames it got back (empty when
    #: none came back and it ran on the kept frames alone); None for every other request
    recalled_frames: list[int] | None = None
    #: why the request ended early, when it did (it is finished): RequestFailed for the engine's own
    #: failures, or PoolFull when what the pool holds for streams left it no room
    error: Exception | None = None
    #: the request's `SamplingParams.priority` (0 for a stream's frames), which latency metrics are labelled by
    priority: int = 0

    def add(self, later: RequestOutput) -> None:
        """Fold the next delta of the same request into this one, so that it covers both."""
        assert later.request_id == self.request_id
        if later.prompt_logprobs is not None:
            self.prompt_logprobs = (self.prompt_logprobs or []) + later.prompt_logprobs
        mine = {c.index: c for c in self.outputs}
        for completion in later.outputs:
            if completion.index in mine:
                mine[completion.index].add(completion)
            else:
                self.outputs.append(completion)
        self.outputs.sort(key=lambda c: c.index)
        self.finished, self.metrics, self.num_cached_tokens = later.finished, later.metrics, later.num_cached_tokens
        self.recalled_frames, self.error = later.recalled_frames, later.error


class Reports:
    """How anything the engine runs for a caller (a request, a stream's frame) reports its state.

    The class sets `request_id`, `prompt`, `prompt_token_ids`, `metrics`, `num_cached_tokens`,
    `finished` and, where it has one, `priority`; says what it has produced (`progress`) and anything
    its own output type adds.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    metrics: RequestMetrics
    num_cached_tokens: int
    priority: int = 0
    #: the output type: RequestOutput, or a subclass with the fields `extra` fills
    output_type: type[RequestOutput] = RequestOutput

    @property
    def finished(self) -> bool:
        raise NotImplementedError

    def progress(self) -> tuple[list[CompletionOutput], list[TokenLogprobs | None] | None]:
        """The completions and prompt logprobs to report now."""
        return [], None

    def extra(self) -> dict:
        """Fields of `output_type` beyond RequestOutput's."""
        return {}

    def output(self) -> RequestOutput:
        """The state to hand the caller now."""
        completions, prompt_logprobs = self.progress()
        return self.output_type(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=completions,
            finished=self.finished,
            metrics=self.metrics,
            num_cached_tokens=self.num_cached_tokens,
            priority=self.priority,
            **self.extra(),
        )
