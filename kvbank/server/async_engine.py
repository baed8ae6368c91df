"""An asyncio front for `LLMEngine`: one background thread owns the engine, coroutines talk to it
through an inbox and get each request's outputs back on their own event loop."""
from __future__ import annotations

import asyncio
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from kvbank.engine.llm_engine import LLMEngine, PromptType
from kvbank.engine.outputs import RequestOutput
from kvbank.engine.params import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; no request can run any more."""


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: PromptType
    params: SamplingParams | None
    mailbox: _Mailbox


@dataclass(slots=True)
class _Abort:
    request_id: str


class _Stop:
    pass


# Sent once the engine has accepted a request, so `add_request` can report a refusal as an exception.
_ACCEPTED = object()


@dataclass(slots=True)
class _Mailbox:
    """Where the engine thread posts one request's items: on the caller's loop, never blocking it."""

    loop: asyncio.AbstractEventLoop
    items: asyncio.Queue

    def post(self, item: object) -> bool:
        """Hand `item` to the caller's loop; False if that loop is gone (nobody will read it)."""
        try:
            self.loop.call_soon_threadsafe(self.items.put_nowait, item)
        except RuntimeError:
            return False
        return True


class RequestStream:
    """The outputs of one accepted request, in order, each cumulative; the last has `finished` set.

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

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._mailbox.items.get()
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

    The thread drains an inbox of adds and aborts, steps the engine while any request is
    unfinished, and sleeps on the inbox otherwise. Every coroutine method must be awaited on a
    running event loop; outputs are delivered with `loop.call_soon_threadsafe`.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue[_Add | _Abort | _Stop] = queue.SimpleQueue()
        self._mailboxes: dict[str, _Mailbox] = {}
        self._stats = engine.stats()
        self._blocks = engine.block_states()
        self._blocks_time = 0.0
        self._error: BaseException | None = None
        #: called on the engine thread with every step's outputs (e.g. latency metrics)
        self.observers: list[Callable[[list[RequestOutput]], None]] = []
        self._pending_adds = 0
        self._thread = threading.Thread(target=self._run, name="kvbank-engine", daemon=True)
        self._thread.start()

    # --- the caller's side ----------------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive()

    @property
    def num_queued(self) -> int:
        """Requests submitted on this loop that have no output yet (queued, or being prefilled)."""
        return self._pending_adds

    async def add_request(self, prompt: PromptType, params: SamplingParams | None = None,
                          request_id: str | None = None) -> RequestStream:
        """Queue a request and wait until the engine accepts it.

        Raises the engine's ValueError for a prompt or parameters it refuses, and EngineDeadError
        after `shutdown()`. Iterate the returned stream to the end, or `close()` it.
        """
        if not self.is_running:
            raise EngineDeadError("the engine thread is not running") from self._error
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        mailbox = _Mailbox(asyncio.get_running_loop(), asyncio.Queue())
        self._pending_adds += 1
        self._inbox.put(_Add(request_id, prompt, params, mailbox))
        try:
            reply = await mailbox.items.get()
        except BaseException:
            self._pending_adds -= 1
            self.abort(request_id)
            raise
        if isinstance(reply, BaseException):
            self._pending_adds -= 1
            raise reply
        assert reply is _ACCEPTED
        return RequestStream(self, request_id, mailbox)

    def _started(self) -> None:
        self._pending_adds -= 1

    async def generate(self, prompt: PromptType, params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative output after every engine step that advanced it.

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

    def stats(self) -> dict[str, float]:
        """The engine's counters as of its latest step (a snapshot; safe from any thread)."""
        return dict(self._stats)

    def block_states(self) -> bytes:
        """`LLMEngine.block_states()` as of the latest step (refreshed at most every 0.25 s while busy)."""
        return self._blocks

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the engine thread; requests still running end with EngineDeadError."""
        self._inbox.put(_Stop())
        self._thread.join(timeout)

    # --- the engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._drain_inbox(block=not self.engine.has_unfinished_requests()):
                self._stats = self.engine.stats()  # queue depths count the requests just added
                if self.engine.has_unfinished_requests():
                    self._step()
                now = time.monotonic()
                if now - self._blocks_time > 0.25 or not self.engine.has_unfinished_requests():
                    self._blocks, self._blocks_time = self.engine.block_states(), now
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
            else:
                self._abort(command.request_id)
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _add(self, command: _Add) -> None:
        try:
            self.engine.add_request(command.prompt, command.params, command.request_id)
        except Exception as error:
            command.mailbox.post(error)
            return
        self._mailboxes[command.request_id] = command.mailbox
        if not command.mailbox.post(_ACCEPTED):
            self._abort(command.request_id)

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
            # A failed step is an engine bug, not a request's fault; failing everyone in flight
            # (rather than guessing who) keeps every caller from waiting forever.
            self._fail_all(error)
            return
        # Before anyone hears of these outputs, so a caller never sees stats older than its output.
        self._stats = self.engine.stats()
        for observer in self.observers:
            observer(outputs)
        for output in outputs:
            mailbox = self._mailboxes.get(output.request_id)
            if mailbox is None:
                continue
            if output.finished:
                del self._mailboxes[output.request_id]
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
            if isinstance(command, _Add):
                command.mailbox.post(EngineDeadError("the engine thread has stopped"))
