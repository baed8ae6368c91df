"""An asyncio front for `LLMEngine`: one background thread owns the engine, coroutines talk to it
through an inbox and get each request's outputs back on their own event loop.

Outputs travel as deltas (RequestOutputKind.DELTA), so a step costs the same at the thousandth token
as at the first, and deltas a reader has not collected yet are merged into one: a slow client holds
one pending output per request, not one per step. Text is tokenized on a small worker pool, never
on the engine thread (where it would stall every running request's decoding) nor on the event loop.

Other threads never touch the engine's structures: they read what never changes (`info`), the
snapshots the engine thread publishes after each step (`stats`, `waiting_prompt_tokens`, `memory`,
...), or run work on the engine thread (`call`).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from kvbank.engine.blend_plan import separator_segments, tokenized_segments
from kvbank.engine.llm_engine import EngineInfo, LLMEngine, PromptType
from kvbank.engine.outputs import RequestFailed, RequestOutput, RequestOutputKind
from kvbank.engine.params import SamplingParams
from kvbank.memory import MemoryReport

T = TypeVar("T")
log = logging.getLogger("kvbank")
TOKENIZER_THREADS = 2
#: how often tier gauges that cost a round trip (Redis memory and key count) are refreshed, and
#: the stats snapshot republished while the engine is idle
TIER_REFRESH_S = 2.0


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; no request can run any more."""


class QueueFullError(RuntimeError):
    """Admitting more work would put more than `limit` items in the engine's queue (the server
    answers 429 with Retry-After: the queue drains as requests get their first token)."""

    def __init__(self, queued: int, asked: int, limit: int) -> None:
        super().__init__(
            f"the server is busy: {queued} requests are queued and the limit is {limit} "
            "(--max-queued-requests); retry later"
        )
        self.queued, self.asked, self.limit = queued, asked, limit


@dataclass(slots=True)
class _Add:
    request_id: str
    #: queues the request on the engine thread and returns it (a Request, or a stream's FrameRequest)
    start: Callable[[LLMEngine], Any]
    text: str | None
    mailbox: _Mailbox


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Call:
    work: Callable[[LLMEngine], Any]
    mailbox: _Mailbox


class _Wake:
    """Sent only so that the engine thread publishes fresh stats while it is idle."""


class _Stop:
    pass


# Sent once the engine has accepted a request, so `add_request` can report a refusal as an exception.
_ACCEPTED = object()
# Put by a pump of `merged` when its stream has ended.
_END = object()


class _Mailbox:
    """Where the engine thread posts one request's items for a coroutine on `loop`, never blocking.

    An output posted while the previous one is still unread is merged into it (both are deltas),
    so at most one output waits, plus the acceptance and a final error.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._items: deque[object] = deque()
        self._lock = threading.Lock()
        self._ready = asyncio.Event()

    def __len__(self) -> int:
        return len(self._items)

    def post(self, item: object) -> bool:
        """Hand `item` to the caller's loop; False if that loop is gone (nobody will read it)."""
        with self._lock:
            last = self._items[-1] if self._items else None
            if isinstance(item, RequestOutput) and isinstance(last, RequestOutput):
                last.add(item)
                return not self.loop.is_closed()
            self._items.append(item)
            wake = len(self._items) == 1
        if wake:
            try:
                self.loop.call_soon_threadsafe(self._ready.set)
            except RuntimeError:
                return False
        return True

    async def get(self) -> object:
        """The oldest unread item, waiting for one if there is none (on the caller's loop)."""
        while True:
            with self._lock:
                if self._items:
                    return self._items.popleft()
                self._ready.clear()
            await self._ready.wait()


class RequestStream:
    """The outputs of one accepted request, in order, each a delta (what is new since the previous
    one, several steps' worth if the reader fell behind); the last has `finished` set.

    Stopping early, by `close()` or by cancelling the task that awaits the next output, aborts the
    request so that its KV blocks are freed.
    """

    def __init__(self, engine: AsyncEngine, request_id: str, mailbox: _Mailbox) -> None:
        self.request_id = request_id
        self._engine = engine
        self._mailbox = mailbox
        self._done = False
        self._waiting = True  # counted in AsyncEngine.num_queued until its first item

    def _started(self) -> None:
        if self._waiting:
            self._waiting = False
            self._engine._started()

    @property
    def num_pending(self) -> int:
        """Items posted but not read yet: at most one output (unread deltas merge) and an error."""
        return len(self._mailbox)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._mailbox.get()
        except BaseException:
            self.close()
            raise
        self._started()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        self._done = item.finished
        return item

    def close(self) -> None:
        """Abort the request unless it already finished; safe to call more than once."""
        self._started()
        if not self._done:
            self._done = True
            self._engine.abort(self.request_id)


class AsyncEngine:
    """Runs an `LLMEngine` on a background thread, which becomes its only user.

    The thread drains an inbox of adds, aborts and calls, steps the engine while any request is
    unfinished, and sleeps on the inbox otherwise. Every coroutine method must be awaited on a
    running event loop; outputs are delivered with `loop.call_soon_threadsafe`.
    """

    def __init__(self, engine: LLMEngine) -> None:
        #: the engine, for the engine thread alone: other threads go through `call`, `info` and the snapshots
        self.engine = engine
        #: what the engine is (model, limits, pool size): fixed, safe from any thread
        self.info: EngineInfo = engine.info()
        self._tokenizer_pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="kvbank-tokenizer")
        self._inbox: queue.SimpleQueue[_Add | _Abort | _Call | _Wake | _Stop] = queue.SimpleQueue()
        self._mailboxes: dict[str, _Mailbox] = {}
        self._stats = engine.stats()
        self._tiers = engine.tier_stats()
        self._waiting_tokens = engine.waiting_prompt_tokens()
        self._memory = engine.memory_now()
        self._blocks = engine.block_states()
        self._blocks_time = 0.0
        self._error: BaseException | None = None
        #: called on the engine thread with every step's outputs (e.g. latency metrics)
        self.observers: list[Callable[[list[RequestOutput]], None]] = []
        self._pending_adds = 0
        #: work waiting for the engine (requests without a first output, queued calls that
        #: compute) beyond which `admit` refuses more; None: no bound
        self.max_queued: int | None = None
        #: longest prompt `add_request` accepts, checked once it is tokenized (and from a text's
        #: byte count before, where that already proves it too long); None: no bound
        self.max_prompt_tokens: int | None = None
        self._bytes_per_token = self.info.tokenizer.max_token_bytes if self.info.tokenizer is not None else None
        self._thread = threading.Thread(target=self._run, name="kvbank-engine", daemon=True)
        self._thread.start()
        self._stopping = threading.Event()
        self._tier_thread: threading.Thread | None = None
        if self.info.has_tiers:
            self._tier_thread = threading.Thread(target=self._refresh_tiers, name="kvbank-tier-stats", daemon=True)
            self._tier_thread.start()

    # --- the caller's side ----------------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive()

    @property
    def num_queued(self) -> int:
        """Requests submitted on this loop that have no output yet (queued, or being prefilled)."""
        return self._pending_adds

    def admit(self, count: int = 1) -> None:
        """Raise QueueFullError unless `count` more items fit in the queue (`max_queued`): the one
        admission check every kind of work that queues on the engine passes."""
        limit = self.max_queued
        if limit is not None and self._pending_adds + count > limit:
            raise QueueFullError(self._pending_adds, count, limit)

    async def add_request(
        self, prompt: PromptType, params: SamplingParams | None = None, request_id: str | None = None
    ) -> RequestStream:
        """Queue a request and wait until the engine accepts it.

        Text is tokenized on the tokenizer pool first. Raises the engine's ValueError for a prompt
        or parameters it refuses, and EngineDeadError after `shutdown()`. Iterate the returned
        stream to the end, or `close()` it.
        """
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        tokenized: dict[str, Any] = {}

        async def prepare() -> None:
            tokenized["prompt"], tokenized["text"] = await self._tokenized(prompt)
            self._check_prompt_length(tokenized["prompt"])

        def start(engine: LLMEngine):
            return engine.add_request(tokenized["prompt"], params, request_id)

        return await self.submit(start, request_id, prepare, lambda: tokenized["text"])

    async def submit(
        self,
        start: Callable[[LLMEngine], Any],
        request_id: str,
        prepare: Callable[[], Awaitable[None]] | None = None,
        text: Callable[[], str | None] = lambda: None,
    ) -> RequestStream:
        """Queue the request `start(engine)` makes on the engine thread (after awaiting `prepare()`)
        and wait until it is accepted; its outputs come back as a RequestStream (see `add_request`)."""
        if not self.is_running:
            raise EngineDeadError("the engine thread is not running") from self._error
        self.admit()
        self._pending_adds += 1  # before any await, so that admission control sees it at once
        try:
            if prepare is not None:
                await prepare()
            mailbox = _Mailbox(asyncio.get_running_loop())
            self._inbox.put(_Add(request_id, start, text(), mailbox))
            reply = await mailbox.get()
        except BaseException:
            self._pending_adds -= 1
            self.abort(request_id)
            raise
        if isinstance(reply, BaseException):
            self._pending_adds -= 1
            raise reply
        assert reply is _ACCEPTED
        return RequestStream(self, request_id, mailbox)

    async def run_tokenizer(self, work: Callable[..., T], *args: Any) -> T:
        """`work(*args)` on the tokenizer pool (tokenizing, rendering a chat template), awaited here."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, work, *args)

    async def _tokenized(self, prompt: PromptType) -> tuple[PromptType, str | None]:
        """The prompt with its text replaced by token ids, and that text (None if there was none)."""
        tokenizer = self.info.tokenizer
        as_dict = prompt if isinstance(prompt, dict) else {"prompt": prompt}
        text = as_dict.get("prompt")
        if tokenizer is None or not isinstance(text, str) or "prompt_token_ids" in as_dict:
            return prompt, None  # nothing to tokenize, or the engine will say what is wrong
        self.check_text_length([text])
        rest = {k: v for k, v in as_dict.items() if k != "prompt"}
        separator = self.info.config.blend_separator
        segments = separator_segments(text, separator) if separator is not None else None
        if segments is not None:  # documents marked in the text (engine/blend.py), tokenized one by one
            return {**rest, "segments": await self.run_tokenizer(tokenized_segments, segments, tokenizer.encode)}, text
        return {**rest, "prompt_token_ids": await self.run_tokenizer(tokenizer.encode, text)}, text

    def check_text_length(self, texts: Sequence[str], what: str = "prompt") -> None:
        """Refuse a prompt whose texts' byte count alone proves it over the prompt limit, before the
        tokenizer spends seconds on it (no token stands for more than `max_token_bytes` bytes, and
        a chat's rendered prompt holds every message's text)."""
        limit, per_token = self.max_prompt_tokens, self._bytes_per_token
        if limit is None or per_token is None or sum(map(len, texts)) <= limit:  # a character is at least a byte
            return
        size = sum(len(text.encode("utf-8", "surrogatepass")) for text in texts)
        least = -(-size // per_token)
        if least > limit:
            raise ValueError(
                f"{what} of {size} bytes has at least {least} tokens (no token stands for more than {per_token} "
                f"bytes), over this server's limit of {limit} (--max-prompt-tokens)"
            )

    def _started(self) -> None:
        self._pending_adds -= 1

    def _check_prompt_length(self, prompt: PromptType) -> None:
        limit = self.max_prompt_tokens
        ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else prompt
        if limit is not None and isinstance(ids, list) and len(ids) > limit:
            raise ValueError(f"prompt has {len(ids)} tokens, over this server's limit of {limit} (--max-prompt-tokens)")

    async def generate(
        self, prompt: PromptType, params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yield what is new in the request after every engine step that advanced it (deltas).

        The engine's ValueError for a bad request is raised by the first iteration. Leaving the
        loop early, or being cancelled, aborts the request and frees its blocks.
        """
        stream = await self.add_request(prompt, params, request_id)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        """Ask the engine thread to stop a request and free its blocks (unknown ids are ignored)."""
        self._inbox.put(_Abort(request_id))

    async def call(self, work: Callable[[LLMEngine], T], queued: bool = False) -> T:
        """Run `work(engine)` on the engine thread between two steps; returns its result or raises its exception.

        For short work on the pool (saving or installing a session): every running request waits for it.
        `queued` work computes (a session save prefills its prompt), so it passes `admit` and counts
        in `num_queued` until it is done.
        """
        if not self.is_running:
            raise EngineDeadError("the engine thread is not running") from self._error
        if queued:
            self.admit()
            self._pending_adds += 1
        try:
            mailbox = _Mailbox(asyncio.get_running_loop())
            self._inbox.put(_Call(work, mailbox))
            reply = await mailbox.get()
        finally:
            if queued:
                self._pending_adds -= 1
        if isinstance(reply, BaseException):
            raise reply
        return reply

    def stats(self) -> dict[str, float]:
        """The engine's counters as of its latest step (a snapshot; safe from any thread)."""
        return dict(self._stats)

    def tier_stats(self) -> dict[str, dict[str, float]]:
        """`LLMEngine.tier_stats()` as of the latest step, or of the last few seconds while idle (a snapshot)."""
        return self._tiers

    def block_states(self) -> bytes:
        """`LLMEngine.block_states()` as of the latest step (refreshed at most every 0.25 s while busy)."""
        return self._blocks

    def waiting_prompt_tokens(self) -> int:
        """`LLMEngine.waiting_prompt_tokens()` as of the latest step (a snapshot)."""
        return self._waiting_tokens

    def memory(self) -> MemoryReport:
        """`LLMEngine.memory_now()` as of the latest step (refreshed with `block_states`)."""
        return self._memory

    async def flush_tiers(self, timeout: float) -> bool:
        """Wait, off the engine thread and the event loop, until the tiers' writer has stored what
        it has queued; False if `timeout` passed first (True at once without tiers)."""
        return await asyncio.to_thread(self.engine.flush_tiers, timeout)

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the engine thread; requests still running end with EngineDeadError."""
        self._stopping.set()
        self._inbox.put(_Stop())
        self._thread.join(timeout)
        if self._tier_thread is not None:
            self._tier_thread.join(timeout)
        self._tokenizer_pool.shutdown(wait=False)
        if not self._thread.is_alive():
            self.engine.close()

    # --- the engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._drain_inbox(block=not self.engine.has_unfinished_requests()):
                self._publish_stats()  # queue depths count the requests just added
                if self.engine.has_unfinished_requests():
                    self._step()
                now = time.monotonic()
                if now - self._blocks_time > 0.25 or not self.engine.has_unfinished_requests():
                    self._blocks, self._blocks_time = self.engine.block_states(), now
                    self._memory = self.engine.memory_now()
        except BaseException as error:
            self._error = error
            raise
        finally:
            self._fail_all(EngineDeadError("the engine thread has stopped"))
            self._refuse_queued_adds()

    def _drain_inbox(self, block: bool) -> bool:
        """Apply every queued command, waiting for the first one if `block`; False on stop."""
        try:
            command = self._inbox.get(block=block)
        except queue.Empty:
            return True
        while True:
            if isinstance(command, _Stop):
                return False
            if isinstance(command, _Add):
                self._add(command)
            elif isinstance(command, _Call):
                self._call(command)
            elif isinstance(command, _Abort):
                self._abort(command.request_id)
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _add(self, command: _Add) -> None:
        try:
            request = command.start(self.engine)
        except Exception as error:
            command.mailbox.post(error)
            return
        request.output_kind = RequestOutputKind.DELTA
        if command.text is not None:
            request.prompt = command.text
        self._mailboxes[command.request_id] = command.mailbox
        if not command.mailbox.post(_ACCEPTED):
            self._abort(command.request_id)

    def _call(self, command: _Call) -> None:
        try:
            result = command.work(self.engine)
        except Exception as error:
            result = error
        command.mailbox.post(result)

    def _publish_stats(self) -> None:
        self._stats = self.engine.stats()
        self._tiers = self.engine.tier_stats()
        self._waiting_tokens = self.engine.waiting_prompt_tokens()

    def _refresh_tiers(self) -> None:
        """Refresh gauges that cost a round trip, off the engine thread, and have the snapshot republished."""
        while not self._stopping.wait(TIER_REFRESH_S):
            self.engine.refresh_tier_stats()
            self._inbox.put(_Wake())

    def _abort(self, request_id: str) -> None:
        self._mailboxes.pop(request_id, None)
        output = self.engine.abort_request(request_id)
        if output is not None:
            # Observers hear of every end, aborts included, so per-request state never lingers.
            for observer in self.observers:
                observer([output])

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as error:
            # The engine contains what one sequence causes (LLMEngine._execute); a step that still
            # fails is the engine's own bug: failing everyone in flight keeps every caller from
            # waiting forever, and they hear only an incident id (the details are in the log).
            incident = uuid.uuid4().hex[:16]
            log.error("engine step failed (incident %s)", incident, exc_info=error)
            self._fail_all(RequestFailed(f"internal error in the engine (incident {incident})"))
            return
        # Before anyone hears of these outputs, so a caller never sees stats older than its output.
        self._publish_stats()
        for observer in self.observers:
            observer(outputs)
        for output in outputs:
            mailbox = self._mailboxes.get(output.request_id)
            if mailbox is None:
                continue
            if output.finished:
                del self._mailboxes[output.request_id]
            if output.error is not None:
                mailbox.post(output.error)
                continue
            if not mailbox.post(output) and not output.finished:
                self._abort(output.request_id)

    def _fail_all(self, error: BaseException) -> None:
        for request_id, mailbox in list(self._mailboxes.items()):
            self._abort(request_id)
            mailbox.post(error)

    def _refuse_queued_adds(self) -> None:
        # Adds that raced with the stop would otherwise wait for an answer forever.
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, (_Add, _Call)):
                command.mailbox.post(EngineDeadError("the engine thread has stopped"))


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs (deltas) of several streams as they arrive, tagged with the stream's position.

    Leaving early (or being cancelled) closes every stream, which aborts its request. A reader
    that falls behind (a slow client) holds up the pumps rather than growing a queue here, so
    the steps it missed pile up merged in each stream's mailbox.
    """
    events: asyncio.Queue = asyncio.Queue(maxsize=1)

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                await events.put((index, output))
        except Exception as error:
            await events.put((index, error))
        await events.put((index, _END))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await events.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.close()


async def final_outputs(streams: list[RequestStream]) -> list[RequestOutput]:
    """Each stream's deltas folded into one whole output."""
    finals: list[RequestOutput | None] = [None] * len(streams)
    async for index, output in merged(streams):
        if finals[index] is None:
            finals[index] = output
        else:
            finals[index].add(output)
    return finals
