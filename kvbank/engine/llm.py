"""The offline Python API, shaped like vLLM's `LLM`."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from kvbank import kernels
from kvbank.cache.policies import DEFAULT_STREAM_POLICY
from kvbank.cache.session import PrefixNotCached
from kvbank.config import EngineConfig
from kvbank.engine.blend_plan import rendered_prompt
from kvbank.engine.llm_engine import LLMEngine, PromptType
from kvbank.engine.outputs import RequestOutput
from kvbank.engine.params import SamplingParams
from kvbank.engine.streams import FrameInfo, FrameType
from kvbank.kernels import isa
from kvbank.models.loader import model_name
from kvbank.tokenizer import Tokenizer

_ENGINE_OPTIONS = {f.name for f in dataclasses.fields(EngineConfig)} - {"model"}
log = logging.getLogger("kvbank")


class LLM:
    """Load a model once, then generate for many prompts with continuous batching.

    `model=None` runs the bundled SmolLM2-135M-Instruct; otherwise pass a .gguf file or a Hugging
    Face model folder. Keyword arguments are the fields of `EngineConfig`; an unknown one is a
    TypeError naming it. Once loaded, it logs the model, the KV cache, memory by part and the
    kernels to the `kvbank` logger at INFO (the startup log the commands print).
    """

    def __init__(self, model: str | None = None, *, show_progress: bool = False, **options: Any) -> None:
        unknown = sorted(set(options) - _ENGINE_OPTIONS)
        if unknown:
            raise TypeError(
                f"LLM() got unknown option(s) {', '.join(unknown)}; "
                f"EngineConfig takes {', '.join(sorted(_ENGINE_OPTIONS))}"
            )
        config = EngineConfig(model=model, **options)
        self.engine = LLMEngine(config, progress=_progress_bar() if show_progress else None)
        for line in startup_log(self.engine):
            log.info(line)

    def get_tokenizer(self) -> Tokenizer:
        if self.engine.tokenizer is None:
            raise ValueError("this model has no tokenizer")
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, batched; outputs come back in the order of `prompts`.

        A prompt dict may name a "tenant" (a string of up to 256 characters): the scheduler shares
        prefill fairly among tenants, and a prompt that names none is its "cache_salt"'s.

        A request that fails inside the engine fails alone: its output has `error` set and its
        completions end with finish_reason "error"; the others run on unaffected."""
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        ids = self._add_all(prompts, params)
        finished: dict[str, RequestOutput] = {}
        while len(finished) < len(ids):
            for output in self.engine.step():
                if output.finished:
                    finished[output.request_id] = output
        return [finished[i] for i in ids]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.render_chat(c, add_generation_prompt, **(chat_template_kwargs or {})) for c in conversations]
        return self.generate(prompts, sampling_params)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> list[int] | dict:
        """Token ids of a conversation rendered with the model's chat template; where the engine has a
        `blend_separator` and the rendered text holds it, a prompt of segments (engine/blend.py)."""
        tokenizer = self.get_tokenizer()
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        return rendered_prompt(text, self.engine.config.blend_separator, tokenizer.encode)

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield the request's cumulative output after every step that advanced it, until it finishes.

        Stopping the iteration early aborts the request and frees its blocks.
        """
        yield from self.follow(self.engine.add_request(prompt, sampling_params).request_id)

    def open_stream(
        self,
        system: PromptType,
        policy: str = DEFAULT_STREAM_POLICY,
        separator: str = "\n",
        chat: bool = True,
        reserve_tokens: int | None = None,
    ) -> StreamSession:
        """Open a streaming session: compute `system` (text, token ids, or a dict with "cache_salt")
        once, then `append` frames and `ask` questions of what the cache holds.

        `policy` is `frame_window(frames=N,sinks=S)`: the system prompt, leading frames up to S
        tokens in all, and the last N frames are kept; frames are evicted whole. `separator` is
        appended to every text frame. With `chat` (and a text system prompt) the chat template frames
        the stream: frames fill a user turn and a text question ends it and opens the answer.

        `reserve_tokens` bounds what the stream holds at once (system prompt, kept leading frames,
        window and the frame being computed) and promises it that room in the KV pool now: its
        frames are never refused for room, and a stream the pool cannot promise it to is refused
        here (PoolFull). Without it, each frame is checked against the pool as it comes.
        """
        request = self.engine.open_stream(system, policy, separator, chat=chat, reserve_tokens=reserve_tokens)
        try:
            self.run_until(request.request_id)
        except BaseException:
            self.engine.close_stream(request.stream.stream_id)
            raise
        return StreamSession(self, request.stream.stream_id)

    def embed_tokens(self, token_ids: list[int]) -> torch.Tensor:
        """The model's input embeddings of `token_ids` [tokens, hidden]: the form of `prompt_embeds`."""
        return self.engine.embed_tokens(token_ids)

    def run_until(self, request_id: str) -> RequestOutput:
        """Step the engine until request `request_id` finishes; its final (cumulative) output."""
        output = None
        for output in self.follow(request_id):  # noqa: B007 -- the last one is the final output
            pass
        return output

    def follow(self, request_id: str) -> Iterator[RequestOutput]:
        """Step the engine, yielding request `request_id`'s outputs until it finishes; stopping early aborts it."""
        try:
            while True:
                for output in self.engine.step():
                    if output.request_id == request_id:
                        if output.error is not None:
                            raise output.error
                        yield output
                        if output.finished:
                            return
        finally:
            self.engine.abort_request(request_id)

    def precompute_documents(self, documents: list, cache_salt: str | None = None) -> dict[str, int]:
        """Compute and cache documents (texts or token id lists) before any prompt uses them, so the
        first prompt that does reuses them (docs/documents.md); returns documents, computed,
        cached (already in the pool) and tokens stored (whole blocks of each)."""
        return self.engine.precompute_documents(documents, cache_salt)

    def pin_prefix(self, prompt: PromptType) -> int:
        """Compute a prefix (a system prompt, say) once and keep its full blocks out of eviction.

        `prompt` is text, token ids or a prompt dict (with "cache_salt" for a tenant's own copy).
        Returns the number of tokens pinned: the prefix rounded down to whole blocks (0, with a
        warning, for a prefix shorter than one block). Pinned blocks count against
        `max_pinned_fraction` of the pool.
        """
        self.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
        return self.engine.pin_prefix(prompt)

    def unpin_prefix(self, prompt: PromptType) -> int:
        """Return a pinned prefix to normal LRU eviction; returns the tokens unpinned (0 if not pinned)."""
        return self.engine.unpin_prefix(prompt)

    def save_session(
        self, tokens_or_request: PromptType | RequestOutput, path: str | os.PathLike, cache_salt: str | None = None
    ) -> int:
        """Save a conversation's KV to one file (llama.cpp's slot save); returns the tokens saved.

        `tokens_or_request` is a prompt (text, token ids or a prompt dict) or a RequestOutput (its
        prompt and first completion). What the pool lacks is computed first. The file holds every
        token and the K/V of the whole blocks; `cache_salt` is not written, but the file can only
        be loaded with the same salt.
        """
        prompt = self.engine.sessions.prompt(tokens_or_request, cache_salt)
        try:
            self.engine.sessions.save(prompt, path)
        except PrefixNotCached:
            self.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
            self.engine.sessions.save(prompt, path)
        return len(prompt["prompt_token_ids"])

    def load_session(self, path: str | os.PathLike, cache_salt: str | None = None) -> list[int]:
        """Load a `save_session` file into the prefix cache; returns the session's token ids.

        A prompt that starts with them reuses every whole block without computing it. A corrupted,
        truncated or foreign file, or another `cache_salt` than it was saved with, is a ValueError
        naming the file and the reason; so is a pool with too few free blocks.
        """
        sessions = self.engine.sessions
        return sessions.install(sessions.read(path, cache_salt))

    def stats(self) -> dict[str, float]:
        """Engine counters: prefix-cache queries/hits/hit rate, pool usage, preemptions, queue depths."""
        return self.engine.stats()

    def tier_stats(self) -> dict[str, dict[str, float]]:
        """Per tier (host, disk, redis): bytes used, hits, misses, load/store bytes and seconds, errors."""
        return self.engine.tier_stats()

    def close(self) -> None:
        """Finish writing offloaded KV to the tiers and close them (a disk tier is complete after this)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def reset_prefix_cache(self) -> int:
        """Drop the pool's cached prefix blocks (not pinned ones, not the tiers'); returns blocks dropped."""
        return self.engine.reset_prefix_cache()

    def _add_all(self, prompts: list[PromptType], params: list[SamplingParams]) -> list[str]:
        ids: list[str] = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(self.engine.add_request(prompt, p).request_id)
        except Exception:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        return ids


class StreamSession:
    """A streaming session over `LLM` (blocking): append frames, ask questions, close.

    Made by `LLM.open_stream`; also a context manager that closes the stream.
    """

    def __init__(self, llm: LLM, stream_id: str) -> None:
        self._llm = llm
        self.stream_id = stream_id
        self._closed = False

    def append(self, frame: FrameType, skip_repeat: bool = False) -> FrameInfo:
        """Compute one frame (text, token ids, or embeddings [tokens, hidden]) after the kept ones;
        returns what the stream keeps afterwards. With `skip_repeat`, a frame identical to one the
        stream still holds (a static camera) is recognised and not computed again."""
        engine = self._engine()
        request = engine.append_frame(self.stream_id, frame, skip_repeat=skip_repeat)
        return self._llm.run_until(request.request_id).frame

    def ask(
        self, question: str | list[int] | dict, sampling_params: SamplingParams | None = None, recall: int = 0
    ) -> RequestOutput:
        """Answer from the cached frames; the question's and answer's tokens are dropped afterwards.

        `recall=k` (with a KV tier) first brings back the k evicted frames most relevant to the
        question; `last_recall()` then says which and how long that took."""
        request = self._engine().ask_stream(self.stream_id, question, sampling_params, recall=recall)
        self._last = request
        return self._llm.run_until(request.request_id)

    def last_recall(self) -> tuple[list[int], float]:
        """(indices of the frames the last `ask` recalled, seconds spent recalling them)."""
        request = getattr(self, "_last", None)
        return (list(request.recalled_frames), request.recall_seconds) if request is not None else ([], 0.0)

    def ask_stream(
        self, question: str | list[int] | dict, sampling_params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """`ask`, yielding the cumulative output after every step; stopping early aborts the answer only."""
        request = self._engine().ask_stream(self.stream_id, question, sampling_params)
        yield from self._llm.follow(request.request_id)

    def fork(self) -> StreamSession:
        """A second stream sharing every block of this one (copy-on-write), to diverge from here."""
        return StreamSession(self._llm, self._engine().fork_stream(self.stream_id).stream_id)

    def kept_token_ids(self) -> list[int]:
        """The tokens the cache holds now: the system prompt, then the kept frames (placeholders for embeddings)."""
        return list(self._engine().stream(self.stream_id).seq.token_ids)

    def stats(self) -> dict[str, int]:
        """Frames appended, kept and evicted, tokens kept, KV blocks held (see `Stream.stats`)."""
        return self._engine().stream(self.stream_id).stats()

    def close(self) -> None:
        """Free the stream's blocks; safe to call twice."""
        if not self._closed:
            self._closed = True
            self._llm.engine.close_stream(self.stream_id)

    def _engine(self):
        if self._closed:
            raise ValueError(f"stream {self.stream_id!r} is closed")
        return self._llm.engine

    def __enter__(self) -> StreamSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    return prompts


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, count: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} sampling params for {count} prompts")
    return params


def startup_log(engine: LLMEngine) -> list[str]:
    """What a loaded engine is: its model, KV cache, memory by part and kernels, one line each."""
    config = engine.config
    return [
        f"model: {model_name(config.model, engine.model_path)}, {str(engine.dtype).removeprefix('torch.')} "
        f"on {engine.device}",
        f"KV cache: {engine.num_blocks} blocks of {engine.block_size} tokens, {config.kv_cache_dtype}, "
        f"{engine.kv_bytes_per_token:.0f} bytes per token{_windows_note(engine)}",
        *(f"memory: {line}" for line in engine.memory.lines()),
        f"kernels: {isa.describe(kernels.native())}",
    ]


def _windows_note(engine: LLMEngine) -> str:
    """What a hybrid cache's windows add to the bytes per token of its full-attention layers."""
    groups = engine.manager.groups
    if groups is None:
        return ""
    held = groups.num_window_tables * groups.window_blocks(engine.block_size)
    return (
        f" in the full-attention layers; the {groups.window}-token windows of the others take at most {held} "
        f"blocks ({held * engine.pool_plan.bytes_per_block / 2**20:.1f} MiB) per decoding sequence"
    )


def _progress_bar():
    from tqdm import tqdm

    bar = None

    def update(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, desc="Loading model", unit="tensor")
        bar.n = done
        bar.refresh()
        if done == total:
            bar.close()

    return update
